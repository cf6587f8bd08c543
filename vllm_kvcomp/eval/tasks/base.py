"""Sample and task types shared by every generator, plus the seeded context they draw from."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from vllm_kvcomp.eval.tasks.sizing import SentencePool, TokenCounter

Scorer = Literal["exact", "prefix", "recall", "words"]


@dataclass(frozen=True)
class Turn:
    """One user message and what a correct reply must contain.

    ``scorer``: ``exact`` (the single digit key, all or nothing), ``prefix`` (the single digit key,
    partial credit by longest common prefix), ``recall`` (fraction of ``answers`` present as
    numbers), ``words`` (fraction of ``answers`` present as whole words, any case).
    ``question``: the end of ``user`` that asks (after the document), sent as a message of its own
    when only the context is compressed (``vllm-kvcomp eval --scope context``).
    ``answer_start``: the start of the reply (RULER's answer prefix): with ``--api completions``
    the prompt ends with it, so a base model that does not follow questions continues an answer.
    """

    user: str
    answers: tuple[str, ...]
    scorer: Scorer
    question: str | None = None
    answer_start: str | None = None

    def __post_init__(self) -> None:
        if self.question is not None and not self.user.endswith(self.question):
            raise ValueError("a turn's question must be the end of its user message")

    def messages(self, split: bool) -> list[dict[str, str]]:
        """The turn as user messages: one, or (``split`` and a question) the context then the question."""
        if not split or self.question is None:
            return [{"role": "user", "content": self.user}]
        context = self.user[: len(self.user) - len(self.question)].rstrip()
        return [{"role": "user", "content": context}, {"role": "user", "content": self.question}]


@dataclass(frozen=True)
class Sample:
    """A generated, self-contained test case: one or more user turns sent in order."""

    task: str
    index: int
    seed: int
    length: int
    tokens: int
    turns: tuple[Turn, ...]
    max_tokens: int
    depth: float | None = None

    @property
    def uid(self) -> str:
        return sample_uid(self.task, self.length, self.seed, self.index)


def sample_uid(task: str, length: int, seed: int, index: int) -> str:
    """Stable id of a sample, known before it is generated (resume keys build on it)."""
    return f"{task}/L{length}/s{seed}/{index}"


@dataclass
class TaskContext:
    """What generators share: seed, tokenizer, needle depths (0..1) and the sentence pools."""

    seed: int
    counter: TokenCounter
    depths: tuple[float, ...] = (0.0, 0.25, 0.5, 0.75, 1.0)
    essay_source: Callable[[], Sequence[str]] | None = None
    _pools: dict[str, SentencePool] = field(default_factory=dict, repr=False)

    def rng(self, task: str, length: int, index: int) -> random.Random:
        """A generator private to one sample (string seeds are stable across processes)."""
        return random.Random(f"{task}:{self.seed}:{length}:{index}")

    def depth(self, index: int) -> float:
        """Depths cycle over the sample index, so N samples cover the grid N/len(depths) times."""
        return self.depths[index % len(self.depths)]

    def pool(self, name: str, sentences: Callable[[], Sequence[str]]) -> SentencePool:
        if name not in self._pools:
            self._pools[name] = SentencePool(sentences(), self.counter)
        return self._pools[name]

    def essays(self) -> SentencePool:
        """The essay sentences, loaded from ``essay_source`` on first use."""
        if self.essay_source is None:
            raise ValueError("this task needs the essay haystack, but no source was given")
        return self.pool("essays", self.essay_source)


@dataclass(frozen=True)
class TaskInfo:
    """A registered task: how to make sample ``index`` at a target ``length`` in tokens."""

    name: str
    description: str
    max_tokens: int
    make: Callable[[TaskContext, int, int], Sample]


MAX_DRAWS = 10
Draw = tuple[str, int, tuple[str, ...]]


def draw_unique(attempt: Callable[[], Draw]) -> Draw:
    """Call ``attempt`` (-> prompt, tokens, answers) until each answer occurs once in the prompt."""
    for _ in range(MAX_DRAWS):
        prompt, tokens, answers = attempt()
        if all(prompt.count(a) == 1 for a in answers):
            return prompt, tokens, answers
    raise RuntimeError(f"no prompt with unique answers after {MAX_DRAWS} draws")
