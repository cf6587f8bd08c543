"""Scoring replies against a sample's answers.

Digit keys are read from the reply as *digit runs*: maximal sequences of digits in which single
spaces or commas between digits are dropped (``"123 456,789"`` -> ``"123456789"``).

- ``exact``: 1 if some digit run equals the key, else 0.
- ``prefix`` (64-digit passkeys; the "partial match" of LagKV §3.3): the longest common prefix
  of a digit run and the key, divided by the key length, best run wins. A reply that gets the
  first 48 of 64 digits right scores 0.75; a wrong first digit scores 0, however good the rest.
  ``digit_acc`` (reported beside it) is the best run's fraction of positions ``i`` with
  ``run[i] == key[i]``, over the key's length, so one dropped digit costs every later position.
- ``recall``: the fraction of answers found in the reply as numbers not embedded in longer ones.
- ``words`` (RULER's ``vt``, ``cwe``, ``fwe``; its ``string_match_all``): the fraction of answers
  found in the reply as whole words, in any case (``"cat"`` is not found in ``"catalog"``).

A sample's score is the mean over its turns; it is exact when every turn is exact.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from vllm_kvcomp.eval.tasks.base import Sample, Turn

_DIGIT_RUN = re.compile(r"\d(?:[ ,]?\d)*")


@dataclass(frozen=True)
class Score:
    """``score`` in [0, 1] (the task's primary metric), ``exact``, and extra named metrics."""

    score: float
    exact: bool
    details: dict[str, float] = field(default_factory=dict)


def digit_runs(text: str) -> list[str]:
    """Digit runs in ``text`` (single spaces / commas between digits removed)."""
    return [re.sub(r"[ ,]", "", m) for m in _DIGIT_RUN.findall(text)]


def common_prefix(a: str, b: str) -> int:
    """Length of the longest common prefix of ``a`` and ``b``."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def digit_accuracy(candidate: str, key: str) -> float:
    """Fraction of the key's positions that ``candidate`` matches (missing digits count wrong)."""
    return sum(c == k for c, k in zip(candidate, key)) / len(key)


def score_key(reply: str, key: str, *, partial: bool) -> Score:
    """A digit key: exact match, or with ``partial`` the prefix score plus ``digit_acc``."""
    runs = digit_runs(reply)
    exact = key in runs
    if not partial:
        return Score(float(exact), exact)
    prefix = max((common_prefix(r, key) for r in runs), default=0) / len(key)
    accuracy = max((digit_accuracy(r, key) for r in runs), default=0.0)
    return Score(prefix, exact, {"digit_acc": accuracy})


def score_recall(reply: str, answers: Sequence[str]) -> Score:
    """Fraction of ``answers`` present in ``reply`` as whole numbers."""
    found = sum(bool(re.search(rf"(?<!\d){re.escape(a)}(?!\d)", reply)) for a in answers)
    return Score(found / len(answers), found == len(answers))


def score_words(reply: str, answers: Sequence[str]) -> Score:
    """Fraction of ``answers`` present in ``reply`` as whole words, case-insensitive."""
    found = sum(bool(re.search(rf"(?<!\w){re.escape(a)}(?!\w)", reply, re.IGNORECASE))
                for a in answers)
    return Score(found / len(answers), found == len(answers))


def score_turn(turn: Turn, reply: str) -> Score:
    if turn.scorer == "recall":
        return score_recall(reply, turn.answers)
    if turn.scorer == "words":
        return score_words(reply, turn.answers)
    return score_key(reply, turn.answers[0], partial=turn.scorer == "prefix")


def score_sample(sample: Sample, replies: Sequence[str]) -> Score:
    """Mean over turns; multi-turn samples report each turn as ``turn1``, ``turn2``, ...."""
    if len(replies) != len(sample.turns):
        raise ValueError(f"{sample.uid}: {len(replies)} replies for {len(sample.turns)} turns")
    scores = [score_turn(t, r) for t, r in zip(sample.turns, replies)]
    details: dict[str, float] = {}
    for s in scores:
        for k, v in s.details.items():
            details[k] = details.get(k, 0.0) + v / len(scores)
    if len(scores) > 1:
        details.update({f"turn{i + 1}": s.score for i, s in enumerate(scores)})
    mean = sum(s.score for s in scores) / len(scores)
    return Score(mean, all(s.exact for s in scores), details)
