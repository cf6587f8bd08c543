"""Report: aggregation, markdown table and PNG plots from synthetic results."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from vllm_kvcomp.eval.report import (
    format_length,
    markdown,
    plot_accuracy,
    plot_heatmaps,
    plot_memory,
    pooled_markdown,
    summarize,
    write_report,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _record(task: str, policy: str, ratio: float, length: int, index: int, score: float,
            depth: float | None = None, **extra: Any) -> dict[str, Any]:
    return {"key": f"{task}|{policy}|{ratio}|{length}|{index}", "task": task, "policy": policy,
            "ratio": ratio, "length": length, "index": index, "depth": depth, "score": score,
            "exact": score == 1.0, "kept_fraction": ratio, "details": {}, "error": None, **extra}


def _synthetic(seed: int = 0) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    out = []
    for policy, ratios in (("full", [1.0]), ("lagkv", [0.5, 0.25]), ("snapkv", [0.5, 0.25])):
        for ratio in ratios:
            for length in (1024, 4096):
                for i, depth in enumerate((0.0, 0.5, 1.0, 0.0, 0.5, 1.0)):
                    out.append(_record("niah", policy, ratio, length, i,
                                       float(rng.random() < ratio), depth))
                out.append(_record("passkey64", policy, ratio, length, 0, rng.random(),
                                   details={"digit_acc": 0.5}))
    return out


def test_summary_means_and_order() -> None:
    records = [
        _record("niah", "lagkv", 0.5, 100, 0, 1.0),
        _record("niah", "lagkv", 0.5, 100, 1, 0.0),
        _record("niah", "lagkv", 0.5, 100, 2, 1.0, kept_fraction=None),
        _record("niah", "lagkv", 0.5, 100, 3, 0.0, error="boom"),
        _record("niah", "full", 1.0, 100, 0, 1.0),
        _record("niah", "lagkv", 0.25, 100, 0, 0.5, details={"turn1": 1.0, "turn2": 0.0}),
    ]
    rows = summarize(records)
    assert [(r.policy, r.ratio) for r in rows] == [("full", 1.0), ("lagkv", 0.5), ("lagkv", 0.25)]
    half = rows[1]
    assert (half.n, half.errors) == (3, 1)
    assert half.accuracy == pytest.approx(2 / 3) and half.exact == pytest.approx(2 / 3)
    assert half.kept == pytest.approx(0.5)
    assert rows[2].details == {"turn1": 1.0, "turn2": 0.0}
    table = markdown(rows)
    assert "| niah | lagkv | 0.5 | 100 | 3 | 0.667 | [0.21, 0.94] | 0.667 | 0.500 | 1 |  |" in table
    assert (half.low, half.high) == pytest.approx((0.2077, 0.9385), abs=1e-4)  # Wilson, n=3
    assert "turn1=1.000, turn2=0.000" in table


def test_retry_replaces_earlier_failure() -> None:
    failed = _record("niah", "lagkv", 0.5, 100, 0, 0.0, error="timeout")
    retried = _record("niah", "lagkv", 0.5, 100, 0, 1.0)
    (row,) = summarize([failed, retried])
    assert (row.n, row.errors, row.accuracy) == (1, 0, 1.0)


def test_format_length() -> None:
    assert [format_length(n) for n in (700, 1024, 4096, 1500)] == ["700", "1k", "4k", "1500"]


def test_plots_are_written(tmp_path: Path) -> None:
    records = _synthetic()
    rows = summarize(records)
    accuracy = plot_accuracy(rows, tmp_path)
    heatmaps = plot_heatmaps(records, tmp_path)
    assert sorted(p.name for p in accuracy) == ["accuracy_niah.png", "accuracy_passkey64.png"]
    assert sorted(p.name for p in heatmaps) == ["heatmap_niah_full.png", "heatmap_niah_lagkv.png",
                                                "heatmap_niah_snapkv.png"]
    for path in accuracy + heatmaps:
        data = path.read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 5000


def test_memory_plot_when_the_mean_kept_rounds_past_every_sample(tmp_path: Path) -> None:
    """The powered run's crash: ten equal kept fractions whose float mean is below each of them
    gave matplotlib a negative error bar."""
    kept = 0.261538  # passkey64 knorm 0.25 in docs/results/quality/power.jsonl
    assert sum([kept] * 10) / 10 < kept  # the rounding this test is about
    records = [_record("niah", "full", 1.0, 2048, i, 1.0) for i in range(3)]
    records += [_record("niah", "lagkv", 0.25, 2048, i, float(i % 2), kept_fraction=kept) for i in range(10)]
    paths = plot_memory(summarize(records), tmp_path)
    assert [p.name for p in paths] == ["memory_niah.png"]
    assert paths[0].read_bytes().startswith(PNG_MAGIC)


def test_write_report_without_plots(tmp_path: Path) -> None:
    rows = write_report(_synthetic(1), tmp_path / "s" / "summary.md", None)
    text = (tmp_path / "s" / "summary.md").read_text()
    assert text.startswith("# vllm-kvcomp eval summary")
    assert text.count("\n| niah |") == len([r for r in rows if r.task == "niah"]) == 10
    assert not list(tmp_path.glob("*.png"))


def test_pooled_over_the_tasks_full_ran_best_first_with_the_ratio_to_full() -> None:
    records = [_record("niah", "full", 1.0, 2048, i, 1.0) for i in range(4)]
    records += [_record("vt", "full", 1.0, 2048, i, 0.5) for i in range(4)]  # full pools to 0.75
    records += [_record("niah", "snapkv", 0.25, 2048, i, float(i < 3)) for i in range(4)]
    records += [_record("vt", "snapkv", 0.25, 2048, i, 0.0) for i in range(4)]  # 3/8
    records += [_record("niah", "lagkv", 0.25, 2048, i, 1.0) for i in range(4)]  # no vt: left out
    records += [_record("cwe", "snapkv", 0.25, 2048, i, 1.0) for i in range(4)]  # full never ran cwe
    text = pooled_markdown(summarize(records))
    lines = [line for line in text.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert "pooled over niah, vt" in text
    assert [line.split(" | ")[0] for line in lines] == ["| full", "| snapkv"]
    assert lines[0].split(" | ")[2:4] == ["8", "0.750"]
    assert lines[1].split(" | ")[2:4] == ["8", "0.375"] and "| 0.50x |" in lines[1]
    assert "| 0.250 |" in lines[1]  # mean kept
    assert pooled_markdown(summarize(records[:8])) and not pooled_markdown(summarize(records[:4]))
