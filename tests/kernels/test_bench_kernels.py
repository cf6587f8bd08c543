"""``vllm-kvcomp bench kernels --device cpu`` runs every phase and backend on a tiny grid and writes its tables."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch

from tests.kernels.cases import INTERPRET
from vllm_kvcomp.bench import kernels as bench_kernels
from vllm_kvcomp.cli import main
from vllm_kvcomp.policies.registry import policy_variants


@pytest.mark.skipif(not INTERPRET, reason="the CPU smoke run needs Triton's interpreter (TRITON_INTERPRET=1)")
def test_cpu_smoke_run_writes_every_phase(tmp_path: Path, capsys) -> None:
    out, rows_json = tmp_path / "results" / "kernels.md", tmp_path / "rows.json"
    grid = ["--device", "cpu", "--contexts", "40", "--batches", "2", "--kv-heads", "2", "--kept", "0.5"]
    argv = [*grid, "--head-dim", "32", "--compact-context", "64", "--decide-contexts", "96", "--out", str(out),
            "--json", str(rows_json)]
    assert main(["bench", "kernels", *argv]) == 0
    text = out.read_text()
    assert text.splitlines()[0] == f"# `vllm-kvcomp bench kernels {' '.join(argv)}`"
    assert f"wrote {out}" in capsys.readouterr().out
    rows = json.loads(rows_json.read_text())["rows"]
    by_phase = {p: [r["what"] for r in rows if r["phase"] == p] for p in bench_kernels.PHASES}
    assert by_phase["decode"] == ["sdpa", "torch", "triton"]
    assert "kernel, block table (uncompressed)" in by_phase["pages"]
    attend = [r for r in rows if r["what"] == "engine attend (packed pages)"]
    assert [r["kept"] for r in attend] == [1.0, 0.5]
    assert all(r["extra"]["rel_err"] < 1e-5 for r in attend)  # float32 on CPU: the reference's own rounding
    assert by_phase["compact"] == ["CudaPagedCache.move", "generic read + write", "device copy, same bytes"]
    assert by_phase["decide"] == ["read pages to the host", *(label for label, _, _ in policy_variants())]
    decided = {r["what"]: r for r in rows if r["phase"] == "decide"}
    assert decided["full"]["kept"] == 1.0 and decided["snapkv"]["kept"] == pytest.approx(0.25, abs=16 / 96)
    assert all(r["ms"] > 0 and (r["gbps"] > 0 or r["phase"] == "decide") for r in rows)
    for title in ("## decode", "## pages", "## compact", "## decide"):
        assert title in text


def test_decide_profile_names_each_policys_functions_and_operators(tmp_path: Path) -> None:
    profile = tmp_path / "profile.txt"
    argv = ["--device", "cpu", "--phases", "decide", "--kv-heads", "2", "--head-dim", "16", "--decide-contexts", "64",
            "--policies", "snapkv,h2o adaptive", "--profile", str(profile), "--out", str(tmp_path / "k.md")]
    assert bench_kernels.main(argv) == 0
    sections = profile.read_text().split("######## ")[1:]
    assert [s.splitlines()[0] for s in sections] == ["snapkv N=64", "h2o adaptive N=64"]
    assert all("Ordered by: internal time" in s and "vllm_kvcomp/policies/" in s for s in sections)  # cProfile
    assert all("aten::" in s for s in sections)  # torch.profiler's operators


def test_bytes_moved_counts_kv_once_and_q_out_once() -> None:
    a = argparse.Namespace(kv_heads=2, group=4, head_dim=8, dtype=torch.bfloat16)
    # KV: 3 requests x 2 heads x 10 slots x (K + V) x 8 x 2 bytes; q and out: 2 x 3 x 8 x 8 x 2
    assert bench_kernels.bytes_decode(a, 10, 3) == 3 * 2 * 10 * 16 * 2 + 2 * 3 * 8 * 8 * 2


@pytest.mark.vllm
def test_cpu_phase_times_the_c_kernel_next_to_vllms_over_the_same_pages(tmp_path: Path) -> None:
    rows_json = tmp_path / "rows.json"
    argv = ["--device", "cpu", "--phases", "cpu", "--layers", "2", "--kv-heads", "2", "--group", "3", "--head-dim", "64",
            "--block-size", "32", "--dtype", "float32", "--contexts", "70", "--batches", "2", "--iters", "2",
            "--out", str(tmp_path / "k.md"), "--json", str(rows_json)]
    assert bench_kernels.main(argv) == 0
    rows = json.loads(rows_json.read_text())["rows"]
    assert [(r["what"], r["extra"]["pages"]) for r in rows] == [
        ("kvcomp C kernel", "block"), ("vLLM CPU kernel", "block"),
        ("kvcomp C kernel", "scattered"), ("vLLM CPU kernel", "scattered")]
    assert all(0 < r["extra"]["max_diff"] < 1e-4 and r["extra"]["ns_per_cell"] > 0 for r in rows)  # two kernels
    for ours, theirs in (rows[:2], rows[2:]):
        assert ours["extra"]["vs_vllm"] == pytest.approx(theirs["ms"] / ours["ms"])
    table = (tmp_path / "k.md").read_text()
    assert "## cpu" in table and "| kvcomp C kernel | scattered | 70 | 2 |" in table
    with pytest.raises(SystemExit, match="float32"):
        bench_kernels.main([*argv[:argv.index("--dtype")], "--dtype", "bfloat16", "--contexts", "70"])
    with pytest.raises(SystemExit, match="--cpu-pages: a comma list of block, scattered"):
        bench_kernels.main([*argv, "--cpu-pages", "random"])
