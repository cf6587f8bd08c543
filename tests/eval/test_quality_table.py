"""README's quality table is generated from the powered runs' JSONL files."""

from __future__ import annotations

from pathlib import Path

import pytest

from vllm_kvcomp.eval import quality_table

ROOT = Path(__file__).resolve().parents[2]


def test_readme_table_matches_the_results() -> None:
    doc = (ROOT / "README.md").read_text(encoding="utf-8")
    results = quality_table.read_results(quality_table.DEFAULT_RESULTS)
    assert quality_table.rewrite(doc, results) == doc, (
        "README.md's quality table is out of date: python3 -m vllm_kvcomp.eval.quality_table --write README.md")


def _records(condition: str, ratio: float, scores: dict[str, list[float]], kept: float | None = 0.3) -> list[dict]:
    policy = condition.split(":", 1)[0]
    return [{"key": f"{condition}|{ratio}|{task}|{i}", "task": task, "policy": policy, "condition": condition,
             "ratio": ratio, "length": 2048, "score": s, "exact": s, "kept_fraction": kept, "error": None}
            for task, values in scores.items() for i, s in enumerate(values)]


def _row(text: str, condition: str) -> list[str]:
    line = next(line for line in text.splitlines() if line.startswith(f"| {condition} |"))
    return [c.strip() for c in line.strip("|").split("|")][1:]


def test_cells_pool_over_tasks_against_full_and_prefer_the_columns_own_ratio() -> None:
    both = {"niah": [1.0, 1.0], "cwe": [0.0, 1.0]}
    records = (_records("full", 1.0, both, kept=None)
               + _records("razor", 0.3, {"niah": [1.0, 0.0], "cwe": [0.0, 0.0]}, kept=0.32)
               + _records("razor", 0.5, {"niah": [1.0, 1.0], "cwe": [1.0, 0.0]}, kept=0.55)
               + _records("lagkv", 0.25, {"niah": [1.0, 1.0], "cwe": [0.0, 0.0]})
               + _records("lagkv", 0.3, {"niah": [0.0, 0.0], "cwe": [0.0, 0.0]})  # the column's own ratio wins
               + _records("snapkv", 0.125, {"niah": [1.0]}))  # one task only: not pooled
    text = quality_table.table({"context": records}, samples=2)
    assert _row(text, "full") == ["0.75"] * 3 + ["not run"] * 3
    assert _row(text, "razor")[:3] == ["0.75 (1.00x, 0.55)", "0.25 (0.33x, 0.32) at 0.3", "–"]
    assert _row(text, "lagkv")[1] == "0.50 (0.67x, 0.30)"
    assert "| snapkv |" not in text
    short = quality_table.table({"context": records}, samples=3)
    assert _row(short, "lagkv")[1] == "n=4 of 6" and _row(short, "full")[0] == "n=4 of 6"


@pytest.mark.parametrize(("ratio", "column"), [(0.5, 0.5), (0.3, 0.25), (0.25, 0.25), (0.2, 0.125), (0.1, None)])
def test_a_ratio_belongs_to_the_largest_column_at_or_below_it(ratio, column) -> None:
    assert quality_table.column_of(ratio) == column


def test_rewrite_needs_the_markers() -> None:
    with pytest.raises(ValueError, match="markers"):
        quality_table.rewrite("no table", {})
