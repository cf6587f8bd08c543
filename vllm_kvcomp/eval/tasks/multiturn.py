"""Two questions about two unrelated needles, asked in two turns (RazorAttention, Fig. 2).

Turn 1 sends the essays with ``A's favorite number is X.`` and ``B's favorite number is Y.`` hidden
in them and asks for A's number; turn 2 is a new request whose history is turn 1 plus the model's
own answer, and asks for B's number. Every request's prompt is compressed on its own, so a policy
that ranks tokens by relevance to the *current* question keeps what each turn needs, while a
query-agnostic one has to keep both facts without knowing which will be asked.
"""

from __future__ import annotations

from collections.abc import Callable

from vllm_kvcomp.eval.tasks.base import Draw, Sample, TaskContext, TaskInfo, Turn, draw_unique
from vllm_kvcomp.eval.tasks.sizing import Needle, fit_prompt

INTRO = "Read the following document carefully. I will ask you questions about it afterwards."
NEEDLE = "{name}'s favorite number is {value}."
QUESTION = "What is {name}'s favorite number? Answer with the number only."
NAMES = ("Mary", "Bob", "Alice", "Omar", "Priya", "Chen", "Lucia", "Tomas", "Greta", "Kwame",
         "Yuki", "Ravi", "Nadia", "Felix", "Ingrid", "Diego")


def _render(name: str) -> Callable[[str], str]:
    return lambda haystack: f"{INTRO}\n\n{haystack}\n\n{QUESTION.format(name=name)}"


def make_multiturn(ctx: TaskContext, index: int, length: int) -> Sample:
    rng = ctx.rng("multiturn", length, index)
    pool = ctx.essays()
    start = rng.randrange(len(pool))
    first, second = rng.sample(NAMES, 2)

    def attempt() -> Draw:
        values = (str(rng.randint(10_000, 99_999)), str(rng.randint(10_000, 99_999)))
        depths = [rng.uniform(0.1, 0.45), rng.uniform(0.55, 0.9)]
        rng.shuffle(depths)
        needles = [Needle(NEEDLE.format(name=n, value=v), d)
                   for n, v, d in zip((first, second), values, depths)]
        return (*fit_prompt(pool, start, needles, length, _render(first)), values)

    prompt, tokens, answers = draw_unique(attempt)
    turns = (Turn(prompt, answers[:1], "exact", question=QUESTION.format(name=first)),
             Turn(QUESTION.format(name=second), answers[1:], "exact"))
    return Sample("multiturn", index, ctx.seed, length, tokens, turns,
                  TASKS["multiturn"].max_tokens)


TASKS = {
    "multiturn": TaskInfo("multiturn", "Q1 about needle A, then Q2 about needle B (two requests)",
                          48, make_multiturn),
}
