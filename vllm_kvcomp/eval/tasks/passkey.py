"""Passkey retrieval (Mohtashami & Jaggi, 2023) with 5-digit and 64-digit keys.

Repeated filler sentences, ``The pass key is X. Remember it.`` at the sample's depth, then the
question. The 64-digit variant is the harder test of LagKV §3.3 and is scored by prefix match.
"""

from __future__ import annotations

from random import Random

from vllm_kvcomp.eval.tasks.base import Draw, Sample, TaskContext, TaskInfo, Turn, draw_unique
from vllm_kvcomp.eval.tasks.sizing import Needle, fit_prompt

INTRO = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize "
         "it. I will quiz you about the important information there.")
FILLER = ("The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.",
          "There and back again.")
NEEDLE = "The pass key is {key}. Remember it."
QUESTION = "What is the pass key? Answer with the pass key only."
ANSWER_START = "The pass key is"


def random_key(rng: Random, digits: int) -> str:
    """A ``digits``-long decimal key without a leading zero."""
    return str(rng.randint(1, 9)) + "".join(rng.choice("0123456789") for _ in range(digits - 1))


def _render(haystack: str) -> str:
    return f"{INTRO}\n\n{haystack}\n\n{QUESTION}"


def _make(name: str, digits: int, ctx: TaskContext, index: int, length: int) -> Sample:
    rng = ctx.rng(name, length, index)
    depth = ctx.depth(index)
    pool = ctx.pool("passkey", lambda: FILLER)

    def attempt() -> Draw:
        key = random_key(rng, digits)
        needle = Needle(NEEDLE.format(key=key), depth)
        return (*fit_prompt(pool, 0, [needle], length, _render), (key,))

    prompt, tokens, answers = draw_unique(attempt)
    turn = Turn(prompt, answers, "exact" if digits <= 8 else "prefix", question=QUESTION,
                answer_start=ANSWER_START)
    return Sample(name, index, ctx.seed, length, tokens, (turn,), TASKS[name].max_tokens, depth)


def make_passkey5(ctx: TaskContext, index: int, length: int) -> Sample:
    return _make("passkey5", 5, ctx, index, length)


def make_passkey64(ctx: TaskContext, index: int, length: int) -> Sample:
    return _make("passkey64", 64, ctx, index, length)


TASKS = {
    t.name: t
    for t in (
        TaskInfo("passkey5", "5-digit passkey in repeated filler (exact match)", 32, make_passkey5),
        TaskInfo("passkey64", "64-digit passkey in repeated filler (prefix match)", 128,
                 make_passkey64),
    )
}
