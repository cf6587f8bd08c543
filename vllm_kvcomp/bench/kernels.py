"""Achieved bandwidth of the paged decode-attention kernel against the device's copy bandwidth.

One run measures a plain large tensor copy (the device's practical bandwidth), then for every
(context N, batch B) of the grid: torch SDPA on contiguous K/V of the same total size (the
baseline) and ``vllm_kvcomp.kernels.decode_attention`` (per-head ranges + compensation token) on
every backend (Triton, the CUDA extension if built; on CPU the torch path and the Triton
interpreter).

Bandwidth = the bytes the kernel must move (each KV byte read once, q read and out written once)
/ median time. The table shows GB/s, % of the copy bandwidth and the time ratio SDPA / ours
(> 1: ours is faster). Usage::

    vllm-kvcomp bench kernels                      # GPU, default grid
    vllm-kvcomp bench kernels --contexts 4096,131072 --batches 1,64 --json out.json
    python -m vllm_kvcomp.bench.kernels --device cpu   # tiny smoke grid, Triton interpreter
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from vllm_kvcomp.bench.common import module_main, write_report

GPU_CONTEXTS = "4096,16384,65536,131072"
GPU_BATCHES = "1,8,64"
CPU_CONTEXTS = "256,512"
CPU_BATCHES = "1,2"

Measure = Callable[[Callable[[], object]], float]


@dataclass
class Row:
    kernel: str
    backend: str
    context: int
    batch: int
    ms: float
    gbps: float
    pct_copy: float
    vs_sdpa: float | None = None


def add_arguments(p: argparse.ArgumentParser) -> None:
    gpu = torch.cuda.is_available()
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if gpu else "cpu")
    p.add_argument("--contexts", help=f"comma list of N (default GPU {GPU_CONTEXTS}, CPU {CPU_CONTEXTS})")
    p.add_argument("--batches", help=f"comma list of B (default GPU {GPU_BATCHES}, CPU {CPU_BATCHES})")
    p.add_argument("--kv-heads", type=int, help="H_kv (default GPU 8, CPU 2)")
    p.add_argument("--group", type=int, default=4, help="query heads per KV head")
    p.add_argument("--head-dim", type=int, help="D (default GPU 128, CPU 64)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    p.add_argument("--num-splits", type=int, help="decode key splits (default: the dispatch's heuristic)")
    p.add_argument("--iters", type=int, help="timed runs per point (default GPU 20, CPU 1)")
    p.add_argument("--warmup", type=int, help="untimed runs per point (default GPU 3, CPU 0)")
    p.add_argument("--max-gib", type=float, default=40.0, help="skip points whose buffers exceed this")
    p.add_argument("--json", type=Path, help="also write the rows here")


def _resolve_defaults(a: argparse.Namespace) -> None:
    """Fill the device-dependent defaults in place."""
    gpu = a.device == "cuda"
    a.contexts = [int(x) for x in (a.contexts or (GPU_CONTEXTS if gpu else CPU_CONTEXTS)).split(",")]
    a.batches = [int(x) for x in (a.batches or (GPU_BATCHES if gpu else CPU_BATCHES)).split(",")]
    a.kv_heads = a.kv_heads or (8 if gpu else 2)
    a.head_dim = a.head_dim or (128 if gpu else 64)
    a.iters = a.iters or (20 if gpu else 1)
    a.warmup = a.warmup if a.warmup is not None else (3 if gpu else 0)
    a.dtype = getattr(torch, a.dtype)


def timer(device: str, warmup: int, iters: int) -> Measure:
    """Median milliseconds of ``fn()`` (CUDA events on GPU, wall clock on CPU)."""

    def once(fn: Callable[[], object]) -> float:
        if device != "cuda":
            t0 = time.perf_counter()
            fn()
            return (time.perf_counter() - t0) * 1e3
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)

    def run(fn: Callable[[], object]) -> float:
        for _ in range(warmup):
            fn()
        return statistics.median(once(fn) for _ in range(iters))

    return run


def copy_bandwidth(device: str, measure: Measure, gib: float) -> float:
    """GB/s of ``dst.copy_(src)`` on a ``gib``-GiB buffer (read + write counted)."""
    n = int(gib * 2**30)
    src = torch.empty(n, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    ms = measure(lambda: dst.copy_(src))
    return 2 * n / ms / 1e6


def bytes_decode(a: argparse.Namespace, n: int, batch: int) -> int:
    """KV read once, q read and out written once."""
    eb = a.dtype.itemsize
    kv = batch * a.kv_heads * n * 2 * a.head_dim * eb
    q_out = 2 * batch * a.kv_heads * a.group * a.head_dim * eb
    return kv + q_out


def point_gib(a: argparse.Namespace, n: int, batch: int) -> float:
    """Buffers of one point: the paged cache and SDPA's contiguous K/V of the same size."""
    cache = batch * a.kv_heads * n * 2 * a.head_dim * a.dtype.itemsize
    return 2 * cache / 2**30


def sdpa_baseline(q: torch.Tensor, n: int, kv_heads: int, measure: Measure, gen: torch.Generator) -> float:
    """Milliseconds of torch SDPA for q [B, H_q, D] over contiguous K/V [B, H_kv, n, D] (freed on return)."""
    batch, _, d = q.shape
    k = torch.randn(batch, kv_heads, n, d, generator=gen, device=q.device).to(q.dtype)
    v = torch.randn_like(k)
    q4 = q.unsqueeze(2)  # [B, H_q, 1, D]
    sdpa = torch.nn.functional.scaled_dot_product_attention
    return measure(functools.partial(sdpa, q4, k, v, enable_gqa=True))


def bench_point(
    a: argparse.Namespace, n: int, batch: int, backends: list[str], measure: Measure, copy_gbps: float
) -> list[Row]:
    """SDPA and every backend of decode attention at context ``n``, batch ``batch``."""
    from vllm_kvcomp import kernels
    from vllm_kvcomp.kernels.fixtures import make_paged

    dev, hk, d, hq = a.device, a.kv_heads, a.head_dim, a.kv_heads * a.group
    paged = make_paged([n] * batch, hk, d, a.block_size, a.dtype, dev, spare_blocks=0, poison=False)
    gen = torch.Generator(device=dev).manual_seed(1)
    q = torch.randn(batch, hq, d, generator=gen, device=dev).to(a.dtype)
    comp = (
        torch.randn(batch, hk, d, device=dev),
        torch.randn(batch, hk, d, device=dev),
        torch.full((batch, hk), 8.0, device=dev),
    )
    sdpa_ms = sdpa_baseline(q, n, hk, measure, gen)
    nbytes = bytes_decode(a, n, batch)

    def row(backend: str, ms: float) -> Row:
        gbps = nbytes / ms / 1e6
        return Row("decode", backend, n, batch, ms, gbps, 100 * gbps / copy_gbps, sdpa_ms / ms)

    rows = [row("sdpa", sdpa_ms)]
    args = (q, paged.cache, paged.block_table, paged.seq_lens, 0, comp)
    for be in backends:
        call = functools.partial(kernels.decode_attention, *args, num_splits=a.num_splits, backend=be)
        rows.append(row(be, measure(call)))
    return rows


def markdown_table(rows: list[Row], copy_gbps: float, device: str) -> str:
    """The copy bandwidth, then one table row per (backend, N, B)."""
    lines = [
        f"copy bandwidth ({device}): {copy_gbps:.1f} GB/s (read + write)",
        "",
        "| kernel | backend | N | B | ms | GB/s | % copy | sdpa / ours |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        vs = "" if r.vs_sdpa is None else f"{r.vs_sdpa:.2f}x"
        lines.append(
            f"| {r.kernel} | {r.backend} | {r.context} | {r.batch} | {r.ms:.3f} | {r.gbps:.4g} "
            f"| {r.pct_copy:.1f}% | {vs} |"
        )
    return "\n".join(lines)


def run(a: argparse.Namespace) -> int:
    _resolve_defaults(a)
    if a.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before any Triton kernel is imported
    elif not torch.cuda.is_available():
        raise SystemExit("--device cuda needs a GPU; use --device cpu for the smoke run")
    from vllm_kvcomp import kernels

    backends = ["torch", "triton"] if a.device == "cpu" else ["triton"]
    if a.device == "cuda" and kernels.cuda_extension_available():
        backends.append("cuda")
    measure = timer(a.device, a.warmup, a.iters)
    copy_gbps = copy_bandwidth(a.device, measure, 2.0 if a.device == "cuda" else 0.25)
    rows: list[Row] = []
    for n in a.contexts:
        for batch in a.batches:
            if point_gib(a, n, batch) > a.max_gib:
                print(f"skip N={n} B={batch}: {point_gib(a, n, batch):.1f} GiB > --max-gib {a.max_gib}")
                continue
            rows += bench_point(a, n, batch, backends, measure, copy_gbps)
            if a.device == "cuda":
                torch.cuda.empty_cache()
    device = torch.cuda.get_device_name() if a.device == "cuda" else "cpu"
    table = markdown_table(rows, copy_gbps, device)
    print(table)
    write_report(a.out, a.command, table)
    if a.json:
        a.json.write_text(json.dumps({"copy_gbps": copy_gbps, "rows": [asdict(r) for r in rows]}, indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    return module_main(sys.modules[__name__], "kernels", argv)


if __name__ == "__main__":
    sys.exit(main())
