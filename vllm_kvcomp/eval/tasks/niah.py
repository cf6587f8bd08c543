"""Needle in a haystack over the Paul Graham essays: one needle, or several asked for at once.

Needles are RULER-style facts with checkable answers: ``One of the special magic numbers for
KEY is: N.`` with a random 7-digit N. ``niah`` puts one needle at the sample's depth (for the
depth x length heatmap); ``multi_niah`` spreads :data:`MULTI_NEEDLES` needles over the essays and
asks for all of them (partial credit: the fraction of numbers recalled).
"""

from __future__ import annotations

from collections.abc import Callable
from random import Random

from vllm_kvcomp.eval.tasks.base import Draw, Sample, TaskContext, TaskInfo, Turn, draw_unique
from vllm_kvcomp.eval.tasks.sizing import Needle, fit_prompt

MULTI_NEEDLES = 4
INTRO = ("Some special magic numbers are hidden within the following text. Make sure to memorize "
         "them. I will quiz you about the numbers afterwards.")
NEEDLE = "One of the special magic numbers for {key} is: {value}."
QUESTION = ("What is the special magic number for {key} mentioned in the provided text? "
            "Answer with the number only.")
ANSWER_START = "The special magic number for {key} mentioned in the provided text is"
MULTI_QUESTION = ("What are the special magic numbers for {keys} mentioned in the provided text? "
                  "List each of them with its number.")
MULTI_ANSWER_START = "The special magic numbers for {keys} mentioned in the provided text are"
ADJECTIVES = ("amber", "brave", "calm", "crimson", "dusty", "eager", "fancy", "gentle", "hollow",
              "icy", "jolly", "lucky", "misty", "noble", "quiet", "rapid", "silver", "tidy")
NOUNS = ("otter", "harbor", "violin", "lantern", "meadow", "falcon", "pebble", "canyon", "teapot",
         "glacier", "orchard", "compass", "walrus", "beacon", "saddle", "thistle", "quarry", "kite")


def random_keys(rng: Random, n: int) -> list[str]:
    """``n`` distinct ``adjective-noun`` keys."""
    keys: list[str] = []
    while len(keys) < n:
        key = f"{rng.choice(ADJECTIVES)}-{rng.choice(NOUNS)}"
        if key not in keys:
            keys.append(key)
    return keys


def random_value(rng: Random) -> str:
    return str(rng.randint(1_000_000, 9_999_999))


def _render(question: str) -> Callable[[str], str]:
    return lambda haystack: f"{INTRO}\n\n{haystack}\n\n{question}"


def _question(prompt: str) -> str:
    """The question that ends a rendered prompt (its last paragraph)."""
    return prompt.rsplit("\n\n", 1)[1]


def make_niah(ctx: TaskContext, index: int, length: int) -> Sample:
    rng = ctx.rng("niah", length, index)
    depth = ctx.depth(index)
    pool = ctx.essays()
    start = rng.randrange(len(pool))

    drawn = {}  # the last attempt's answer start (draw_unique keeps the last attempt)

    def attempt() -> Draw:
        key, value = random_keys(rng, 1)[0], random_value(rng)
        needle = Needle(NEEDLE.format(key=key, value=value), depth)
        render = _render(QUESTION.format(key=key))
        drawn["start"] = ANSWER_START.format(key=key)
        return (*fit_prompt(pool, start, [needle], length, render), (value,))

    prompt, tokens, answers = draw_unique(attempt)
    turn = Turn(prompt, answers, "exact", question=_question(prompt), answer_start=drawn["start"])
    return Sample("niah", index, ctx.seed, length, tokens, (turn,), TASKS["niah"].max_tokens, depth)


def make_multi_niah(ctx: TaskContext, index: int, length: int) -> Sample:
    rng = ctx.rng("multi_niah", length, index)
    pool = ctx.essays()
    start = rng.randrange(len(pool))

    drawn = {}  # the last attempt's answer start (draw_unique keeps the last attempt)

    def attempt() -> Draw:
        keys = random_keys(rng, MULTI_NEEDLES)
        values = tuple(random_value(rng) for _ in keys)
        depths = [rng.uniform(j / len(keys), (j + 1) / len(keys)) for j in range(len(keys))]
        needles = [Needle(NEEDLE.format(key=k, value=v), d) for k, v, d in zip(keys, values, depths)]
        asked = ", ".join(keys[:-1]) + f" and {keys[-1]}"
        render = _render(MULTI_QUESTION.format(keys=asked))
        drawn["start"] = MULTI_ANSWER_START.format(keys=asked)
        return (*fit_prompt(pool, start, needles, length, render), values)

    prompt, tokens, answers = draw_unique(attempt)
    turn = Turn(prompt, answers, "recall", question=_question(prompt), answer_start=drawn["start"])
    return Sample("multi_niah", index, ctx.seed, length, tokens, (turn,),
                  TASKS["multi_niah"].max_tokens)


TASKS = {
    t.name: t
    for t in (
        TaskInfo("niah", "one magic number in the essays at each depth (exact match)", 48,
                 make_niah),
        TaskInfo("multi_niah", f"{MULTI_NEEDLES} magic numbers in the essays, all asked at once "
                 "(recall)", 160, make_multi_niah),
    )
}
