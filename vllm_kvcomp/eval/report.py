"""Summaries of a results JSONL: the cell table with 95 % intervals, the claims' verdicts, the
LagKV lag sweep (markdown), and PNG plots (:mod:`vllm_kvcomp.eval.plots`).

The cells are built by :func:`vllm_kvcomp.eval.cells.summarize`; the claims and their verdicts
live in :mod:`vllm_kvcomp.eval.claims`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from vllm_kvcomp.eval import claims, plots
from vllm_kvcomp.eval.cells import Row, format_length, latest, summarize
from vllm_kvcomp.eval.plots import plot_accuracy, plot_heatmaps, plot_memory
from vllm_kvcomp.eval.stats import wilson
from vllm_kvcomp.policies.registry import get_policy_class

TITLE = "# vllm-kvcomp eval summary"


def _num(value: float | None) -> str:
    return "–" if value is None else f"{value:.3f}"


def _interval(row: Row) -> str:
    return "–" if row.low is None or row.high is None else f"[{row.low:.2f}, {row.high:.2f}]"


def markdown(rows: Sequence[Row]) -> str:
    """The cells as a GitHub markdown table (accuracy with its Wilson 95 % interval)."""
    lines = ["| task | policy | ratio | length | n | accuracy | 95% CI | exact | kept | errors | "
             "details |", "|---|---|---:|---:|---:|---:|---|---:|---:|---:|---|"]
    for w in rows:
        details = ", ".join(f"{k}={v:.3f}" for k, v in w.details.items())
        lines.append(f"| {w.task} | {w.condition} | {w.ratio:g} | {format_length(w.length)} | "
                     f"{w.n} | {_num(w.accuracy)} | {_interval(w)} | {_num(w.exact)} | "
                     f"{_num(w.kept)} | {w.errors} | {details} |")
    return "\n".join(lines) + "\n"


def _side(condition: str) -> str:
    return condition.replace(":", " ")


def claims_markdown(verdicts: Sequence[claims.Verdict]) -> str:
    """The claims table: what is claimed, both cells with their intervals, the verdict."""
    lines = ["| claim | source | task | length | metric | A | B | A: mean [95% CI] | "
             "B: mean [95% CI] | verdict |", "|---|---|---|---:|---|---|---|---|---|---|"]
    for v in verdicts:
        a = v.a.text() if v.a else "–"
        b = v.b.text() if v.b else "–"
        lines.append(f"| {v.claim.text} | {v.claim.source} | {v.task} | {format_length(v.length)} "
                     f"| {v.claim.metric} | {_side(v.claim.a)} | {_side(v.claim.b)} | {a} | {b} "
                     f"| **{v.verdict}** |")
    return "\n".join(lines) + "\n"


def _setting(condition: str, key: str, default: Any) -> Any:
    """Value of ``key`` in a condition label whose only setting is ``key`` (None otherwise)."""
    settings = dict(part.split("=", 1) for part in condition.split(":")[1:])
    if set(settings) - {key}:
        return None
    return type(default)(settings[key]) if key in settings else default


def sweep_markdown(rows: Sequence[Row], policy: str = "lagkv", key: str = "lag") -> str:
    """One table per ratio at which ``policy`` ran with at least two values of ``key``:
    a line per value, a column per task (accuracy [95% CI], mean kept fraction)."""
    default = {f.name: f.default for f in fields(get_policy_class(policy))}[key]
    swept: dict[tuple[float, int], dict[Any, dict[str, Row]]] = {}
    for row in rows:
        value = _setting(row.condition, key, default) if row.policy == policy else None
        if value is not None:
            swept.setdefault((row.ratio, row.length), {}).setdefault(value, {})[row.task] = row
    out = []
    for (ratio, length), by_value in sorted(swept.items()):
        if len(by_value) < 2:
            continue
        tasks = sorted({t for cells in by_value.values() for t in cells})
        out.append(f"{policy}, ratio {ratio:g}, {format_length(length)} tokens "
                   f"(default {key}={default}): accuracy [95% CI] · kept\n")
        out.append(f"| {key} | " + " | ".join(tasks) + " |")
        out.append("|---:|" + "---|" * len(tasks))
        for value, cells in sorted(by_value.items()):
            text = [f"{_num(c.accuracy)} {_interval(c)} · {_num(c.kept)} (n={c.n})"
                    if (c := cells.get(t)) else "–" for t in tasks]
            out.append(f"| {value} | " + " | ".join(text) + " |")
        out.append("")
    return "\n".join(out)


@dataclass(frozen=True)
class Pooled:
    """One (condition, ratio)'s samples pooled over tasks: mean score, samples, mean kept
    fraction weighted by samples (None: the server reported none)."""

    mean: float
    n: int
    kept: float | None


def pooled(rows: Sequence[Row], length: int) -> tuple[list[str], dict[tuple[str, float], Pooled]]:
    """At ``length``: the tasks full cache ran, and every (condition, ratio) that ran all of them,
    its samples pooled over them (no tasks: full cache ran none)."""
    tasks = sorted({r.task for r in rows if r.length == length and r.policy == "full"})
    cells: dict[tuple[str, float], list[Row]] = {}
    for r in rows:
        if r.length == length and r.task in tasks and r.n and r.accuracy is not None:
            cells.setdefault((r.condition, r.ratio), []).append(r)
    out = {}
    for key, group in cells.items():
        if len({c.task for c in group}) < len(tasks):
            continue
        n = sum(c.n for c in group)
        kept = [(c.kept, c.n) for c in group if c.kept is not None]
        out[key] = Pooled(sum(c.accuracy * c.n for c in group) / n, n,
                          sum(k * m for k, m in kept) / sum(m for _, m in kept) if kept else None)
    return tasks, out


def pooled_markdown(rows: Sequence[Row]) -> str:
    """Every condition's samples pooled over the tasks that full cache also ran at that length
    (mean, Wilson 95 % interval over the pooled samples, the ratio to full's pooled mean, mean
    kept), best first; empty when no length has full cache and two tasks."""
    out = []
    for length in sorted({r.length for r in rows}):
        tasks, means = pooled(rows, length)
        if len(tasks) < 2:
            continue
        full = next((p.mean for (cond, _), p in means.items() if cond == "full"), None)
        out += [f"{format_length(length)} tokens, pooled over {', '.join(tasks)}:", "",
                "| policy | ratio | n | accuracy | 95% CI | vs full | kept |", "|---|---:|---:|---:|---|---:|---:|"]
        for (cond, ratio), p in sorted(means.items(), key=lambda kv: (-kv[1].mean, kv[0])):
            low, high = wilson(p.mean, p.n)
            versus = f"{p.mean / full:.2f}x" if full else "–"
            out.append(f"| {cond} | {ratio:g} | {p.n} | {p.mean:.3f} | [{low:.2f}, {high:.2f}] | {versus} | "
                       f"{_num(p.kept)} |")
        out.append("")
    return "\n".join(out)


def report_markdown(rows: Sequence[Row]) -> str:
    """The whole summary: cells, claims (if any claim cell ran), the lag sweep (if run)."""
    parts = [TITLE, "", "Accuracy is the mean score; 95% CI is its Wilson score interval "
             "(conservative for partial-credit scores); kept is the mean `kept_fraction` the "
             "server reported (KV held in decode over the full cache's).", "", markdown(rows)]
    pooled = pooled_markdown(rows)
    if pooled:
        parts += ["## Pooled over tasks", "", pooled]
    verdicts = claims.judge(rows)
    if verdicts:
        parts += ["## Claims", "", claims.RULES, "", claims_markdown(verdicts)]
        missing = claims.unjudged(verdicts)
        if missing:
            parts += [f"Not run (a side has no cell): {', '.join(missing)}.", ""]
    sweep = sweep_markdown(rows)
    if sweep:
        parts += ["## LagKV lag sweep", "", sweep]
    return "\n".join(parts)


def write_report(records: Sequence[dict[str, Any]], summary: Path, folder: Path | None) -> list[Row]:
    """Write the markdown summary (and plots into ``folder`` when given); returns the rows."""
    rows = summarize(records)
    summary.parent.mkdir(parents=True, exist_ok=True)
    summary.write_text(report_markdown(rows), encoding="utf-8")
    if folder is not None:
        plots.plot_accuracy(rows, folder)
        plots.plot_memory(rows, folder)
        plots.plot_heatmaps(records, folder)
    return rows


__all__ = ["Pooled", "Row", "claims_markdown", "format_length", "latest", "markdown", "plot_accuracy",
           "plot_heatmaps", "plot_memory", "pooled", "pooled_markdown", "report_markdown", "summarize",
           "sweep_markdown", "write_report"]
