"""Summaries of a results JSONL: a policy x ratio x length table (markdown) and PNG plots.

- ``accuracy_<task>.png``: mean score vs kept ratio, one line per policy, one panel per length;
  ``full`` is the dashed baseline.
- ``heatmap_<task>_<policy>.png`` (tasks with a needle depth): mean score over depth x length,
  one panel per ratio.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm_kvcomp.policies.registry import POLICY_NAMES


@dataclass(frozen=True)
class Row:
    """Aggregate of one (task, policy, ratio, length) cell."""

    task: str
    policy: str
    ratio: float
    length: int
    n: int
    errors: int
    accuracy: float | None
    exact: float | None
    kept: float | None
    details: dict[str, float] = field(default_factory=dict)


def latest(records: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """One record per key, the last one written (a retry replaces an earlier failure)."""
    by_key: dict[str, dict[str, Any]] = {}
    for r in records:
        by_key[r["key"]] = r
    return list(by_key.values())


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _policy_rank(policy: str) -> int:
    return POLICY_NAMES.index(policy) if policy in POLICY_NAMES else len(POLICY_NAMES)


def summarize(records: Iterable[dict[str, Any]]) -> list[Row]:
    """Rows sorted by task, policy (``full`` first), ratio (descending), length."""
    groups: dict[tuple[str, str, float, int], list[dict[str, Any]]] = defaultdict(list)
    for r in latest(records):
        groups[(r["task"], r["policy"], float(r["ratio"]), int(r["length"]))].append(r)
    rows = []
    for (task, policy, ratio, length), items in groups.items():
        ok = [r for r in items if not r.get("error")]
        keys = sorted({k for r in ok for k in (r.get("details") or {})})
        rows.append(Row(
            task, policy, ratio, length, len(ok), len(items) - len(ok),
            _mean([r["score"] for r in ok]), _mean([float(r["exact"]) for r in ok]),
            _mean([r["kept_fraction"] for r in ok if r.get("kept_fraction") is not None]),
            {k: v for k in keys if (v := _mean([r["details"][k] for r in ok if k in r["details"]]))
             is not None},
        ))
    return sorted(rows, key=lambda w: (w.task, _policy_rank(w.policy), -w.ratio, w.length))


def _num(value: float | None) -> str:
    return "–" if value is None else f"{value:.3f}"


def format_length(tokens: int) -> str:
    return f"{tokens // 1024}k" if tokens >= 1024 and tokens % 1024 == 0 else str(tokens)


def markdown(rows: Sequence[Row]) -> str:
    """The summary as a GitHub markdown table."""
    lines = ["| task | policy | ratio | length | n | accuracy | exact | kept | errors | details |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for w in rows:
        details = ", ".join(f"{k}={v:.3f}" for k, v in w.details.items())
        lines.append(f"| {w.task} | {w.policy} | {w.ratio:g} | {format_length(w.length)} | {w.n} | "
                     f"{_num(w.accuracy)} | {_num(w.exact)} | {_num(w.kept)} | {w.errors} | "
                     f"{details} |")
    return "\n".join(lines) + "\n"


def plot_accuracy(rows: Sequence[Row], folder: Path) -> list[Path]:
    """``accuracy_<task>.png`` per task: score vs kept ratio per policy, a panel per length."""
    from matplotlib.figure import Figure

    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for task in sorted({w.task for w in rows}):
        mine = [w for w in rows if w.task == task and w.accuracy is not None]
        lengths = sorted({w.length for w in mine})
        if not lengths:
            continue
        fig = Figure(figsize=(4.2 * len(lengths), 3.6), layout="constrained")
        axes = fig.subplots(1, len(lengths), squeeze=False)[0]
        ratios = sorted({w.ratio for w in mine})
        for ax, length in zip(axes, lengths):
            cells = [w for w in mine if w.length == length]
            for policy in sorted({w.policy for w in cells}, key=_policy_rank):
                line = sorted((w.ratio, w.accuracy) for w in cells if w.policy == policy)
                if policy == "full":
                    ax.axhline(line[0][1], color="black", linestyle="--", label="full")
                else:
                    ax.plot([x for x, _ in line], [y for _, y in line], marker="o", label=policy)
            ax.set_xscale("log", base=2)
            ax.set_xticks(ratios, [f"{r:g}" for r in ratios])
            ax.minorticks_off()
            ax.invert_xaxis()
            ax.set_ylim(-0.03, 1.03)
            ax.set_title(f"{task}, {format_length(length)} tokens")
            ax.set_xlabel("kept ratio (more compression →)")
            ax.set_ylabel("accuracy")
            ax.grid(alpha=0.3)
        axes[-1].legend(fontsize="small", loc="best")
        path = folder / f"accuracy_{task}.png"
        fig.savefig(path, dpi=110)
        paths.append(path)
    return paths


def plot_heatmaps(records: Iterable[dict[str, Any]], folder: Path) -> list[Path]:
    """``heatmap_<task>_<policy>.png``: mean score over depth x length, a panel per ratio."""
    from matplotlib.figure import Figure

    folder.mkdir(parents=True, exist_ok=True)
    cells: dict[tuple[str, str], dict[tuple[float, float, int], list[float]]] = defaultdict(
        lambda: defaultdict(list))
    for r in latest(records):
        if not r.get("error") and r.get("depth") is not None:
            cells[(r["task"], r["policy"])][(float(r["ratio"]), float(r["depth"]), int(r["length"]))
                                            ].append(r["score"])
    paths = []
    for (task, policy), grid in sorted(cells.items(), key=lambda kv: (kv[0][0], _policy_rank(kv[0][1]))):
        ratios = sorted({k[0] for k in grid}, reverse=True)
        depths = sorted({k[1] for k in grid})
        lengths = sorted({k[2] for k in grid})
        fig = Figure(figsize=(1.2 + 1.1 * len(lengths) * len(ratios) + 1.0, 1.4 + 0.45 * len(depths)),
                     layout="constrained")
        axes = fig.subplots(1, len(ratios), squeeze=False)[0]
        image = None
        for ax, ratio in zip(axes, ratios):
            matrix = [[_mean(grid.get((ratio, d, n), [])) for n in lengths] for d in depths]
            values = [[float("nan") if v is None else v for v in row] for row in matrix]
            image = ax.imshow(values, cmap="RdYlGn", vmin=0.0, vmax=1.0, aspect="auto")
            for i, row in enumerate(matrix):
                for j, v in enumerate(row):
                    if v is not None:
                        ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=8)
            ax.set_xticks(range(len(lengths)), [format_length(n) for n in lengths])
            ax.set_yticks(range(len(depths)), [f"{100 * d:g}%" for d in depths])
            ax.set_xlabel("context length (tokens)")
            ax.set_ylabel("needle depth")
            ax.set_title(policy if policy == "full" else f"{policy}, ratio {ratio:g}")
        fig.suptitle(f"{task}: accuracy by needle depth and length")
        fig.colorbar(image, ax=list(axes), shrink=0.9, label="accuracy")
        path = folder / f"heatmap_{task}_{policy}.png"
        fig.savefig(path, dpi=110)
        paths.append(path)
    return paths


def write_report(records: Sequence[dict[str, Any]], summary: Path, plots: Path | None) -> list[Row]:
    """Write the markdown summary (and plots when ``plots`` is given); returns the rows."""
    rows = summarize(records)
    summary.parent.mkdir(parents=True, exist_ok=True)
    summary.write_text("# vllm-kvcomp eval summary\n\n" + markdown(rows), encoding="utf-8")
    if plots is not None:
        plot_accuracy(rows, plots)
        plot_heatmaps(records, plots)
    return rows
