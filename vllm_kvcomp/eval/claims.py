"""The papers' quality claims that the harness can test, and their verdicts from 95 % intervals.

A claim compares two cells (task, condition, ratio, length): ``better`` says A scores higher than
B, ``no_worse`` says A loses nothing against B. Verdicts use the Wilson intervals of the two
cells (:mod:`vllm_kvcomp.eval.stats`), never the point estimates:

* ``better``: **reproduced** when A's interval lies entirely above B's, **refuted** when it lies
  entirely below, **undecided** when they overlap;
* ``no_worse``: **refuted** when A's interval lies entirely below B's, otherwise **not refuted**
  (overlapping intervals cannot show equality; they only fail to show a loss).

Conditions are written as on the command line (``lagkv:ratio=0.25``, see
:func:`vllm_kvcomp.eval.runner.parse_condition`); the claims' cells are the ones
``--claim-samples`` gives more samples to.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from vllm_kvcomp.eval.runner import Condition, conditions
from vllm_kvcomp.eval.stats import wilson

if TYPE_CHECKING:
    from vllm_kvcomp.eval.cells import Row

Kind = Literal["better", "no_worse"]

RULES = ("A claim compares cell A with cell B on the Wilson 95% intervals, not the point "
         "estimates. *A beats B*: **reproduced** if A's interval lies above B's, **refuted** if "
         "below, **undecided** if they overlap. *A loses nothing against B*: **refuted** if A's "
         "interval lies below B's, otherwise **not refuted** (overlap cannot show equality).")


@dataclass(frozen=True)
class Claim:
    """A: ``better`` (``no_worse``) than B on ``tasks``, read from ``metric`` (``score`` or a
    ``details`` key such as ``turn2``)."""

    name: str
    source: str
    text: str
    tasks: tuple[str, ...]
    a: str
    b: str
    metric: str = "score"
    kind: Kind = "better"

    def conditions(self) -> tuple[Condition, Condition]:
        """(A, B) as harness conditions."""
        (a,), (b,) = conditions([self.a], []), conditions([self.b], [])
        return a, b


#: Razor at about 3x on the bundled model at 2K: 24 of 90 KV heads keep everything, the rest
#: keep 4 sinks + ceil(0.07 N) recent + the compensation token, on 128-token pages (~0.32 held).
RAZOR_3X = "razor:buffer=64:exact=1:ratio=0.07"  # the paper's rule (the powered run's "razor:buffer=64:ratio=0.07")
#: SnapKV holding the same ~0.32 of the cache at 2K (its 0.3 rounds up to the page grid).
SNAPKV_3X = "snapkv:ratio=0.3"
#: The entropy policy with every layer at the mean budget: the same selection, uniform budgets.
ENTROPY_UNIFORM = "entropy:min_ratio=1:max_ratio=1:ratio=0.25"

CLAIMS: tuple[Claim, ...] = (
    Claim("lagkv>h2o@0.25", "LagKV §3.3, Fig. 3–5", "LagKV beats H2O on the 64-digit passkey",
          ("passkey64",), "lagkv:ratio=0.25", "h2o:ratio=0.25"),
    Claim("lagkv>h2o@0.5", "LagKV §3.3, Fig. 3–5", "LagKV beats H2O on the 64-digit passkey",
          ("passkey64",), "lagkv:ratio=0.5", "h2o:ratio=0.5"),
    Claim("lagkv>snapkv@0.25", "LagKV §3.2–3.3", "LagKV beats SnapKV on the 64-digit passkey",
          ("passkey64",), "lagkv:ratio=0.25", "snapkv:ratio=0.25"),
    Claim("lagkv>snapkv@0.5", "LagKV §3.2–3.3", "LagKV beats SnapKV on the 64-digit passkey",
          ("passkey64",), "lagkv:ratio=0.5", "snapkv:ratio=0.5"),
    Claim("razor>snapkv@3x", "RazorAttention Fig. 2",
          "at ~3x RazorAttention answers the second multi-turn question where SnapKV fails",
          ("multiturn",), RAZOR_3X, SNAPKV_3X, metric="turn2"),
    Claim("razor~full@3x", "RazorAttention Fig. 1, §1",
          "RazorAttention loses nothing against the full cache at ~3x", ("niah", "passkey5"),
          RAZOR_3X, "full", kind="no_worse"),
    Claim("sagekv>streamingllm@4x", "SAGE-KV §3, Fig. 2",
          "SAGE-KV beats StreamingLLM at the same 4x budget", ("niah", "passkey5"),
          "sagekv:ratio=0.25", "streamingllm:ratio=0.25"),
    Claim("entropy>uniform@4x", "Entropy-guided KV caching §4, Table 2",
          "entropy-scaled layer budgets beat uniform ones at the same mean budget",
          ("niah", "multi_niah"), "entropy:ratio=0.25", ENTROPY_UNIFORM),
)


def claim_cells(claims: Sequence[Claim] = CLAIMS) -> set[tuple[str, str, float]]:
    """(task, condition label, ratio) of every cell a claim reads."""
    cells = set()
    for claim in claims:
        for cond in claim.conditions():
            cells.update((task, cond.label, cond.kept_ratio) for task in claim.tasks)
    return cells


def claim_samples(samples: int, claims: Sequence[Claim] = CLAIMS) -> Callable[[str, Condition], int]:
    """``extra`` for :func:`~vllm_kvcomp.eval.runner.schedule`: ``samples`` in claim cells, else 0."""
    cells = claim_cells(claims)
    return lambda task, cond: samples if (task, cond.label, cond.kept_ratio) in cells else 0


@dataclass(frozen=True)
class Cell:
    """One side of a verdict: samples, mean metric, its Wilson interval and the mean kept fraction."""

    n: int
    mean: float
    low: float
    high: float
    kept: float | None

    def text(self) -> str:
        kept = "" if self.kept is None else f", kept {self.kept:.2f}"
        return f"{self.mean:.2f} [{self.low:.2f}, {self.high:.2f}] (n={self.n}{kept})"


@dataclass(frozen=True)
class Verdict:
    claim: Claim
    task: str
    length: int
    a: Cell | None
    b: Cell | None
    verdict: str


def decide(kind: Kind, a: Cell | None, b: Cell | None) -> str:
    """The verdict of one claim from the two intervals (``missing`` without data)."""
    if a is None or b is None or a.n == 0 or b.n == 0:
        return "missing"
    if kind == "no_worse":
        return "refuted" if a.high < b.low else "not refuted"
    if a.low > b.high:
        return "reproduced"
    return "refuted" if a.high < b.low else "undecided"


def _cell(row: Row | None, metric: str) -> Cell | None:
    if row is None or row.n == 0:
        return None
    mean = row.accuracy if metric == "score" else row.details.get(metric)
    if mean is None:
        return None
    return Cell(row.n, mean, *wilson(mean, row.n), row.kept)


def judge(rows: Sequence[Row], claims: Sequence[Claim] = CLAIMS) -> list[Verdict]:
    """A verdict per claim, task and length where both cells have a row."""
    index = {(r.task, r.condition, r.ratio, r.length): r for r in rows}
    lengths = sorted({r.length for r in rows})
    out = []
    for claim in claims:
        a, b = claim.conditions()
        for task in claim.tasks:
            for length in lengths:
                ra = index.get((task, a.label, a.kept_ratio, length))
                rb = index.get((task, b.label, b.kept_ratio, length))
                if ra is None or rb is None:
                    continue
                ca, cb = _cell(ra, claim.metric), _cell(rb, claim.metric)
                out.append(Verdict(claim, task, length, ca, cb, decide(claim.kind, ca, cb)))
    return out


def unjudged(verdicts: Sequence[Verdict], claims: Sequence[Claim] = CLAIMS) -> list[str]:
    """Names of the claims without any verdict (a side was not run)."""
    seen = {v.claim.name for v in verdicts}
    return [c.name for c in claims if c.name not in seen]
