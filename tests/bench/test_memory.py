"""bench memory: the allocator's peak it reads, and its table."""

from __future__ import annotations

import torch

from vllm_kvcomp.bench import memory


def test_the_peak_is_what_was_held_at_once_above_what_was_held_before():
    _held = torch.empty(1 << 20)  # 4 MiB allocated before (alive throughout): not counted

    def work() -> None:
        a = torch.empty(1 << 20)  # 4 MiB, then 2 MiB more while it lives: 6 MiB at once
        b = torch.empty(1 << 19)
        del a, b
        torch.empty(1 << 18)  # after they are freed: 1 MiB, below the peak

    assert memory.peak_bytes(work, "cpu") == 6 << 20


def test_the_table_gives_each_policy_and_length_against_the_bound(tmp_path):
    out = tmp_path / "bench_memory.md"
    argv = ["--lengths", "256,512", "--policies", "snapkv,knorm", "--layers", "2", "--kv-heads", "2", "--group", "2",
            "--head-dim", "32", "--block-size", "16", "--widest", "--out", str(out)]
    assert memory.main(argv) == 0
    rows = [line.split("|")[1:-1] for line in out.read_text().splitlines() if line.startswith("| snapkv")
            or line.startswith("| knorm")]
    assert [(r[0].strip(), int(r[1])) for r in rows] == [("snapkv", 256), ("knorm", 256), ("snapkv", 512),
                                                         ("knorm", 512)]
    assert all(float(r[5]) > 0 for r in rows) and "Largest peak / bound" in out.read_text()
    assert "](bench_memory.png)" in out.read_text() and out.with_suffix(".png").stat().st_size > 0
