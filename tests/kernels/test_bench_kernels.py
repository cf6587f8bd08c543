"""``vllm-kvcomp bench kernels --device cpu`` runs every backend on a tiny grid and writes its table."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from vllm_kvcomp.bench import kernels as bench_kernels
from vllm_kvcomp.cli import main


def test_cpu_smoke_run_writes_the_markdown_table(tmp_path: Path, capsys) -> None:
    out, rows_json = tmp_path / "results" / "kernels.md", tmp_path / "rows.json"
    grid = ["--device", "cpu", "--contexts", "40", "--batches", "2", "--kv-heads", "2"]
    argv = [*grid, "--head-dim", "32", "--out", str(out), "--json", str(rows_json)]
    assert main(["bench", "kernels", *argv]) == 0
    lines = out.read_text().splitlines()
    assert lines[0] == f"# `vllm-kvcomp bench kernels {' '.join(argv)}`"
    rows = [line.split("|")[1:-1] for line in lines if line.startswith("| decode")]
    assert [r[1].strip() for r in rows] == ["sdpa", "torch", "triton"]
    assert all(r[2].strip() == "40" and r[3].strip() == "2" and float(r[4]) > 0 for r in rows)
    assert f"wrote {out}" in capsys.readouterr().out
    saved = json.loads(rows_json.read_text())
    assert saved["copy_gbps"] > 0 and len(saved["rows"]) == 3


def test_bytes_moved_counts_kv_once_and_q_out_once() -> None:
    a = argparse.Namespace(kv_heads=2, group=4, head_dim=8, dtype=torch.bfloat16)
    # KV: 3 requests x 2 heads x 10 slots x (K + V) x 8 x 2 bytes; q and out: 2 x 3 x 8 x 8 x 2
    assert bench_kernels.bytes_decode(a, 10, 3) == 3 * 2 * 10 * 16 * 2 + 2 * 3 * 8 * 8 * 2
