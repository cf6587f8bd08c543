"""README's quality table, generated from the powered runs' results so it cannot drift.

One row per condition (a policy and its non-default settings), one column per (scope, kept
fraction): the condition's samples pooled over the tasks full cache ran (2K tokens), as
``accuracy (vs full, KV held)``. A cell whose run asked for another ratio than its column's (razor
at 0.3 in the 0.25 column: its retrieval heads alone hold 0.27) says so. A cell short of
``--samples`` per task (a run still in progress) shows how many it has, not an accuracy.

    python3 -m vllm_kvcomp.eval.quality_table --write README.md \\
        [--context docs/results/quality/context_context.jsonl] [--all docs/results/quality/context_all.jsonl]
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from pathlib import Path

from vllm_kvcomp.eval.cells import policy_rank, summarize
from vllm_kvcomp.eval.report import Pooled, pooled

START = "<!-- quality-table:start (generated: python3 -m vllm_kvcomp.eval.quality_table) -->"
END = "<!-- quality-table:end -->"
COLUMNS = (0.5, 0.25, 0.125)
SCOPES = ("context", "all")
LENGTH = 2048
SAMPLES = 20  # per (task, cell): the powered run
ROOT = Path(__file__).resolve().parents[2]
DEFAULT_RESULTS = {scope: ROOT / "docs" / "results" / "quality" / f"context_{scope}.jsonl" for scope in SCOPES}


def column_of(ratio: float) -> float | None:
    """The column a requested ratio belongs to: the largest column at or below it (0.3 -> 0.25),
    None below the smallest."""
    return max((c for c in COLUMNS if c <= ratio + 1e-9), default=None)


def cell(p: Pooled, full: float | None, ratio: float, column: float, needed: int) -> str:
    """``0.40 (0.85x, 0.30)``: pooled accuracy, ratio to full's, mean KV held; ``at 0.3`` when the
    run asked for another ratio; ``n=12 of 80`` while short of ``needed`` samples."""
    if p.n < needed:
        return f"n={p.n} of {needed}"
    versus = f"{p.mean / full:.2f}x" if full else "–"
    held = f", {p.kept:.2f}" if p.kept is not None else ""
    at = f" at {ratio:g}" if abs(ratio - column) > 1e-9 else ""
    return f"{p.mean:.2f} ({versus}{held}){at}"


def table(results: Mapping[str, Sequence[dict]], samples: int = SAMPLES) -> str:
    """The markdown table (between its markers) from each scope's records (a scope may be
    missing or empty: its columns then say so)."""
    grid: dict[str, dict[tuple[str, float], str]] = {}
    full_cells: dict[str, str] = {}
    for scope in SCOPES:
        tasks, means = pooled(summarize(results.get(scope, ())), LENGTH)
        needed = samples * len(tasks)
        full = next((p for (cond, _), p in means.items() if cond == "full"), None)
        if full is not None:
            full_cells[scope] = f"{full.mean:.2f}" if full.n >= needed else f"n={full.n} of {needed}"
        for (cond, ratio), p in means.items():
            column = column_of(ratio)
            if cond == "full" or column is None:
                continue
            taken = grid.setdefault(cond, {})
            if (scope, column) not in taken or abs(ratio - column) < 1e-9:  # the column's own ratio first
                taken[(scope, column)] = cell(p, full.mean if full else None, ratio, column, needed)
    heads = [f"{scope} {c:g}" for scope in SCOPES for c in COLUMNS]
    lines = [START, "| policy | " + " | ".join(heads) + " |", "|---|" + "---:|" * len(heads)]
    lines.append("| full | " + " | ".join(full_cells.get(scope, "not run") for scope in SCOPES for _ in COLUMNS) + " |")
    for cond in sorted(grid, key=lambda c: (policy_rank(c), c)):
        row = [grid[cond].get((scope, c), "–") for scope in SCOPES for c in COLUMNS]
        lines.append(f"| {cond} | " + " | ".join(row) + " |")
    return "\n".join([*lines, END])


def rewrite(doc: str, results: Mapping[str, Sequence[dict]], samples: int = SAMPLES) -> str:
    """``doc`` with its table regenerated from ``results``."""
    if START not in doc or END not in doc:
        raise ValueError(f"no generated table markers in the document ({START} ... {END})")
    return doc[: doc.index(START)] + table(results, samples) + doc[doc.index(END) + len(END):]


def read_results(paths: Mapping[str, Path]) -> dict[str, list[dict]]:
    """Each scope's records (a file not there yet: none)."""
    from vllm_kvcomp.eval.runner import read_jsonl

    return {scope: read_jsonl(path) if path.exists() else [] for scope, path in paths.items()}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m vllm_kvcomp.eval.quality_table", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write", help="markdown file whose table to regenerate in place (default: print it)")
    for scope in SCOPES:
        parser.add_argument(f"--{scope}", type=Path, default=DEFAULT_RESULTS[scope],
                            help=f"scope={scope} results JSONL (default: %(default)s)")
    parser.add_argument("--samples", type=int, default=SAMPLES, help="samples per (task, cell) a cell needs")
    args = parser.parse_args(argv)
    results = read_results({scope: getattr(args, scope) for scope in SCOPES})
    if not args.write:
        print(table(results, args.samples))
        return 0
    path = Path(args.write)
    path.write_text(rewrite(path.read_text(encoding="utf-8"), results, args.samples), encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
