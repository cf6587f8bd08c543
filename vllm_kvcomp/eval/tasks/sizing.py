"""Token counting and haystack sizing: fill a prompt to a target length in the model's tokens.

Filler comes from a :class:`SentencePool` (sentences taken in order from a start index, wrapping
around); the last sentence is cut at a word boundary so the filler meets its budget closely. Needles
go at sentence boundaries nearest to their depth, measured in filler tokens (0 = before the first
sentence, 1 = after the last). Token counts of joined sentences are not exactly additive, so
:func:`fit_prompt` measures the whole prompt and corrects the budget for a few rounds.
"""

from __future__ import annotations

import bisect
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FIT_ROUNDS = 4
_CHUNK = 256


class TokenCounter(ABC):
    """Counts tokens of texts as the served model's tokenizer does (no special tokens)."""

    @abstractmethod
    def count_many(self, texts: Sequence[str]) -> list[int]:
        """Token count of each text."""

    def count(self, text: str) -> int:
        return self.count_many([text])[0]


class TokenizersCounter(TokenCounter):
    """A ``tokenizers.Tokenizer`` (e.g. a model folder's ``tokenizer.json``)."""

    def __init__(self, tokenizer: Any):
        self._tok = tokenizer

    @classmethod
    def from_file(cls, path: Path) -> TokenizersCounter:
        from tokenizers import Tokenizer

        return cls(Tokenizer.from_file(str(path)))

    def count_many(self, texts: Sequence[str]) -> list[int]:
        return [len(e.ids) for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]


class TransformersCounter(TokenCounter):
    """A ``transformers`` tokenizer, for model folders without ``tokenizer.json`` or GGUF files."""

    def __init__(self, tokenizer: Any):
        self._tok = tokenizer

    def count_many(self, texts: Sequence[str]) -> list[int]:
        return [len(ids) for ids in self._tok(list(texts), add_special_tokens=False)["input_ids"]]


class CharEstimateCounter(TokenCounter):
    """No tokenizer: ``ceil(characters / chars_per_token)``; lengths are then only approximate."""

    def __init__(self, chars_per_token: float = 4.0):
        if chars_per_token <= 0:
            raise ValueError(f"chars_per_token must be positive, got {chars_per_token}")
        self.chars_per_token = chars_per_token

    def count_many(self, texts: Sequence[str]) -> list[int]:
        return [math.ceil(len(t) / self.chars_per_token) for t in texts]


def load_counter(path: Path) -> TokenCounter:
    """The tokenizer at ``path``: a folder (``tokenizer.json`` or HF files), a ``.json`` or ``.gguf``."""
    path = Path(path)
    if path.is_dir() and (path / "tokenizer.json").is_file():
        return TokenizersCounter.from_file(path / "tokenizer.json")
    if path.is_file() and path.suffix == ".json":
        return TokenizersCounter.from_file(path)
    if path.is_file() and path.suffix == ".gguf":
        from transformers import AutoTokenizer

        return TransformersCounter(AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name))
    if path.is_dir():
        from transformers import AutoTokenizer

        return TransformersCounter(AutoTokenizer.from_pretrained(path))
    raise FileNotFoundError(f"no tokenizer at {path}")


def tolerance(target: int) -> int:
    """Accepted distance between a requested and a generated prompt length, in tokens."""
    return max(8, target // 100)


@dataclass(frozen=True)
class Needle:
    """A sentence to hide in the filler at ``depth`` (0..1 of the filler's tokens)."""

    text: str
    depth: float


class SentencePool:
    """Sentences with lazily cached token counts (each counted with its joining space)."""

    def __init__(self, sentences: Sequence[str], counter: TokenCounter):
        if not sentences:
            raise ValueError("a sentence pool needs at least one sentence")
        self.sentences = list(sentences)
        self.counter = counter
        self._counts: list[int | None] = [None] * len(self.sentences)

    def __len__(self) -> int:
        return len(self.sentences)

    def _count(self, i: int) -> int:
        cached = self._counts[i]
        if cached is None:
            stop = min(i + _CHUNK, len(self.sentences))
            counts = self.counter.count_many([" " + s for s in self.sentences[i:stop]])
            self._counts[i:stop] = counts
            cached = counts[0]
        return cached

    def take(self, start: int, budget: int) -> list[tuple[str, int]]:
        """(sentence, tokens) pieces from ``start`` on, together about ``budget`` tokens."""
        pieces: list[tuple[str, int]] = []
        used, i = 0, start % len(self.sentences)
        while used < budget:
            n = self._count(i)
            if used + n > budget:
                cut = self._cut(self.sentences[i], budget - used)
                if cut is not None:
                    pieces.append(cut)
                break
            pieces.append((self.sentences[i], n))
            used += n
            i = (i + 1) % len(self.sentences)
        return pieces

    def _cut(self, sentence: str, room: int) -> tuple[str, int] | None:
        """The longest word prefix of ``sentence`` that fits in ``room`` tokens."""
        words = sentence.split(" ")
        prefixes = [" ".join(words[:j]) for j in range(1, len(words))]
        counts = self.counter.count_many([" " + p for p in prefixes]) if prefixes else []
        fitting = [(p, c) for p, c in zip(prefixes, counts) if c <= room]
        return fitting[-1] if fitting else None


def assemble(pieces: Sequence[tuple[str, int]], needles: Sequence[Needle]) -> str:
    """Join filler pieces with spaces, each needle at the boundary nearest its depth."""
    bounds = [0]
    for _, n in pieces:
        bounds.append(bounds[-1] + n)
    at: dict[int, list[str]] = {}
    for needle in sorted(needles, key=lambda x: x.depth):
        if not 0.0 <= needle.depth <= 1.0:
            raise ValueError(f"needle depth must be in [0, 1], got {needle.depth}")
        goal = needle.depth * bounds[-1]
        k = bisect.bisect_left(bounds, goal)
        if k == len(bounds) or (k > 0 and goal - bounds[k - 1] <= bounds[k] - goal):
            k -= 1
        at.setdefault(k, []).append(needle.text)
    out: list[str] = []
    for k in range(len(pieces) + 1):
        out.extend(at.get(k, ()))
        if k < len(pieces):
            out.append(pieces[k][0])
    return " ".join(out)


def fit_prompt(
    pool: SentencePool,
    start: int,
    needles: Sequence[Needle],
    target: int,
    render: Callable[[str], str],
) -> tuple[str, int]:
    """``render(haystack)`` sized to ``target`` tokens; returns (prompt, measured tokens)."""
    counter = pool.counter
    fixed = counter.count(render("")) + sum(counter.count_many([" " + n.text for n in needles]))
    if target <= fixed:
        raise ValueError(f"a length of {target} tokens is too short: instructions and needles alone "
                         f"take {fixed} tokens")
    budget = target - fixed

    def measure(size: int) -> tuple[str, int]:
        prompt = render(assemble(pool.take(start, size), needles))
        return prompt, counter.count(prompt)

    best = last = measure(budget)
    for _ in range(FIT_ROUNDS - 1):
        if abs(last[1] - target) <= tolerance(target):
            break
        budget = max(0, budget + target - last[1])
        last = measure(budget)
        if abs(last[1] - target) < abs(best[1] - target):
            best = last
    return best
