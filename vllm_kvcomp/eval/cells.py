"""Results JSONL -> cells: one aggregate per (task, condition, ratio, length), with its interval."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from vllm_kvcomp.eval.stats import wilson
from vllm_kvcomp.policies.registry import policy_names


@dataclass(frozen=True)
class Row:
    """Aggregate of one (task, condition, ratio, length) cell.

    ``condition`` is the policy plus its non-default settings (``lagkv:lag=64``); ``low``/``high``
    the Wilson 95 % interval of ``accuracy``; ``kept`` the mean kept fraction the server reported
    (``None`` when it reported nothing), ``kept_min``/``kept_max`` its range over the samples.
    """

    task: str
    policy: str
    condition: str
    ratio: float
    length: int
    n: int
    errors: int
    accuracy: float | None
    exact: float | None
    kept: float | None
    details: dict[str, float] = field(default_factory=dict)
    low: float | None = None
    high: float | None = None
    kept_min: float | None = None
    kept_max: float | None = None


def latest(records: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """One record per key, the last one written (a retry replaces an earlier failure)."""
    by_key: dict[str, dict[str, Any]] = {}
    for r in records:
        by_key[r["key"]] = r
    return list(by_key.values())


def mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def condition_of(record: dict[str, Any]) -> str:
    """The record's condition label (older files have only ``policy``)."""
    return record.get("condition") or record["policy"]


def policy_rank(policy: str) -> int:
    """Registry order (``full`` first); unknown names last."""
    base, names = policy.split(":", 1)[0], policy_names()
    return names.index(base) if base in names else len(names)


def format_length(tokens: int) -> str:
    return f"{tokens // 1024}k" if tokens >= 1024 and tokens % 1024 == 0 else str(tokens)


def _row(task: str, condition: str, ratio: float, length: int, items: list[dict[str, Any]]) -> Row:
    ok = [r for r in items if not r.get("error")]
    keys = sorted({k for r in ok for k in (r.get("details") or {})})
    accuracy = mean([r["score"] for r in ok])
    kept = [r["kept_fraction"] for r in ok if r.get("kept_fraction") is not None]
    low, high = wilson(accuracy, len(ok)) if accuracy is not None else (None, None)
    return Row(
        task, condition.split(":", 1)[0], condition, ratio, length, len(ok), len(items) - len(ok),
        accuracy, mean([float(r["exact"]) for r in ok]), mean(kept),
        {k: v for k in keys if (v := mean([r["details"][k] for r in ok if k in r["details"]]))
         is not None},
        low, high, min(kept, default=None), max(kept, default=None),
    )


def summarize(records: Iterable[dict[str, Any]]) -> list[Row]:
    """Rows sorted by task, policy (``full`` first), condition, ratio (descending), length."""
    groups: dict[tuple[str, str, float, int], list[dict[str, Any]]] = defaultdict(list)
    for r in latest(records):
        groups[(r["task"], condition_of(r), float(r["ratio"]), int(r["length"]))].append(r)
    rows = [_row(*key, items) for key, items in groups.items()]
    return sorted(rows, key=lambda w: (w.task, policy_rank(w.condition), w.condition, -w.ratio,
                                       w.length))


__all__ = ["Row", "condition_of", "format_length", "latest", "mean", "policy_rank", "summarize"]
