"""Achieved bandwidth of vllm-kvcomp's KV kernels against the device's copy bandwidth.

One run measures: a plain large tensor copy (the device's practical bandwidth), then for every
(context N, batch B) of the grid and every backend (Triton, the CUDA extension if built; on CPU
the torch path and the Triton interpreter) the four kernels of ``vllm_kvcomp.ops``:

* ``decode``   per-head paged decode attention (+ compensation token), and torch SDPA on
               contiguous K/V of the same total size as the baseline;
* ``window``   observation-window scores (w queries, GQA) with entropy;
* ``compact``  per-head compaction keeping ``--keep`` of the tokens (strided selection);
* ``lagkv``    LagKV scoring of every partition of every head.

Bandwidth = the bytes a kernel must move (each needed KV byte read once, outputs written once;
see ``bytes_*``) / median time. The table shows GB/s, % of the copy bandwidth and, for decode,
the time ratio SDPA / ours (> 1: ours is faster). Usage (from the repository root):

    python benchmarks/bench_kernels.py                      # GPU, default grid
    python benchmarks/bench_kernels.py --contexts 4096,131072 --batches 1,64 --json out.json
    python benchmarks/bench_kernels.py --device cpu         # tiny smoke grid, Triton interpreter
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.helpers, run as a script

GPU_CONTEXTS = "4096,16384,65536,131072"
GPU_BATCHES = "1,8,64"
CPU_CONTEXTS = "256,512"
CPU_BATCHES = "1,2"


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


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu"
    )
    p.add_argument(
        "--contexts", help=f"comma list of N (default GPU {GPU_CONTEXTS}, CPU {CPU_CONTEXTS})"
    )
    p.add_argument(
        "--batches", help=f"comma list of B (default GPU {GPU_BATCHES}, CPU {CPU_BATCHES})"
    )
    p.add_argument("--kernels", default="decode,window,compact,lagkv")
    p.add_argument("--kv-heads", type=int, help="H_kv (default GPU 8, CPU 2)")
    p.add_argument("--group", type=int, default=4, help="query heads per KV head")
    p.add_argument("--head-dim", type=int, help="D (default GPU 128, CPU 64)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    p.add_argument("--window", type=int, default=32, help="observation window w")
    p.add_argument("--keep", type=float, default=0.25, help="fraction kept by compaction")
    p.add_argument("--lag", type=int, default=128, help="LagKV partition size")
    p.add_argument("--num-splits", type=int, help="decode key splits (default: ops' heuristic)")
    p.add_argument("--iters", type=int, help="timed runs per point (default GPU 20, CPU 1)")
    p.add_argument("--warmup", type=int, help="untimed runs per point (default GPU 3, CPU 0)")
    p.add_argument(
        "--max-gib", type=float, default=40.0, help="skip points whose buffers exceed this"
    )
    p.add_argument("--json", type=Path, help="also write the rows here")
    a = p.parse_args()
    gpu = a.device == "cuda"
    a.contexts = [
        int(x) for x in (a.contexts or (GPU_CONTEXTS if gpu else CPU_CONTEXTS)).split(",")
    ]
    a.batches = [int(x) for x in (a.batches or (GPU_BATCHES if gpu else CPU_BATCHES)).split(",")]
    a.kernels = a.kernels.split(",")
    a.kv_heads = a.kv_heads or (8 if gpu else 2)
    a.head_dim = a.head_dim or (128 if gpu else 64)
    a.iters = a.iters or (20 if gpu else 1)
    a.warmup = a.warmup if a.warmup is not None else (3 if gpu else 0)
    a.dtype = getattr(torch, a.dtype)
    return a


def timer(device: str, warmup: int, iters: int) -> Callable[[Callable[[], object]], float]:
    """Median milliseconds of ``fn()`` (CUDA events on GPU, wall clock on CPU)."""

    def run(fn: Callable[[], object]) -> float:
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(iters):
            if device == "cuda":
                start, end = (
                    torch.cuda.Event(enable_timing=True),
                    torch.cuda.Event(enable_timing=True),
                )
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)

    return run


def copy_bandwidth(device: str, measure, gib: float) -> float:
    """GB/s of ``dst.copy_(src)`` on a ``gib``-GiB buffer (read + write counted)."""
    n = int(gib * 2**30)
    src = torch.empty(n, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    ms = measure(lambda: dst.copy_(src))
    return 2 * n / ms / 1e6


# ---------------------------------------------------------------------------- bytes moved


def bytes_decode(a, n: int, batch: int) -> int:
    eb = a.dtype.itemsize
    kv = batch * a.kv_heads * n * 2 * a.head_dim * eb
    q_out = 2 * batch * a.kv_heads * a.group * a.head_dim * eb
    return kv + q_out


def bytes_window(a, n: int, batch: int) -> int:
    eb = a.dtype.itemsize
    keys = batch * a.kv_heads * n * a.head_dim * eb
    q = batch * a.window * a.kv_heads * a.group * a.head_dim * eb
    return keys + q + batch * a.kv_heads * n * 4


def bytes_compact(a, kept: int, batch: int) -> int:
    return 2 * batch * a.kv_heads * kept * 2 * a.head_dim * a.dtype.itemsize


def bytes_lagkv(a, parts: int, batch: int) -> int:
    tokens = (parts + 1) * a.lag
    return batch * a.kv_heads * (tokens * 2 * a.head_dim * a.dtype.itemsize + parts * a.lag * 4)


# ---------------------------------------------------------------------------- one grid point


def bench_point(a, n: int, batch: int, backends: list[str], measure, copy_gbps: float) -> list[Row]:
    from tests.helpers.kernel_refs import make_paged
    from vllm_kvcomp import ops

    dev, hk, d, hq = a.device, a.kv_heads, a.head_dim, a.kv_heads * a.group
    paged = make_paged([n] * batch, hk, d, a.block_size, a.dtype, dev, spare_blocks=0, poison=False)
    gen = torch.Generator(device=dev).manual_seed(1)
    rows: list[Row] = []

    def add(kernel: str, backend: str, ms: float, nbytes: int, vs: float | None = None) -> None:
        gbps = nbytes / ms / 1e6
        rows.append(Row(kernel, backend, n, batch, ms, gbps, 100 * gbps / copy_gbps, vs))

    if "decode" in a.kernels:
        q = torch.randn(batch, hq, d, generator=gen, device=dev).to(a.dtype)
        comp = (
            torch.randn(batch, hk, d, device=dev),
            torch.randn(batch, hk, d, device=dev),
            torch.full((batch, hk), 8.0, device=dev),
        )
        k = torch.randn(batch, hk, n, d, generator=gen, device=dev).to(a.dtype)
        v = torch.randn_like(k)
        q4 = q.unsqueeze(2)  # [B, H_q, 1, D]
        sdpa_ms = measure(
            lambda: torch.nn.functional.scaled_dot_product_attention(q4, k, v, enable_gqa=True)
        )
        del k, v
        nbytes = bytes_decode(a, n, batch)
        add("decode", "sdpa", sdpa_ms, nbytes, 1.0)
        for be in backends:
            ms = measure(
                lambda be=be: ops.decode_attention(
                    q,
                    paged.cache,
                    paged.block_table,
                    paged.seq_lens,
                    0,
                    comp,
                    num_splits=a.num_splits,
                    backend=be,
                )
            )
            add("decode", be, ms, nbytes, sdpa_ms / ms)

    if "window" in a.kernels:
        qw = torch.randn(batch, a.window, hq, d, generator=gen, device=dev).to(a.dtype)
        for be in backends:
            if be == "cuda":
                continue  # no CUDA kernel: auto dispatch runs Triton
            ms = measure(
                lambda be=be: ops.window_scores(
                    qw,
                    paged.cache,
                    paged.block_table,
                    paged.seq_lens,
                    with_entropy=True,
                    n_max=n,
                    backend=be,
                )
            )
            add("window", be, ms, bytes_window(a, n, batch))

    if "compact" in a.kernels:
        kept_n = max(1, int(n * a.keep))
        idx = (
            (torch.arange(kept_n, device=dev) * (n / kept_n)).long().to(torch.int32)
        )  # sorted, strided
        kept = idx.expand(batch, hk, -1).contiguous()
        counts = torch.full((batch, hk), kept_n, dtype=torch.int32, device=dev)
        for be in backends:
            ms = measure(
                lambda be=be: ops.compact_heads(
                    paged.cache, paged.block_table, paged.seq_lens, kept, counts, backend=be
                )
            )
            add("compact", be, ms, bytes_compact(a, kept_n, batch))

    if "lagkv" in a.kernels and n >= 2 * a.lag:
        parts = n // a.lag - 1
        num_parts = torch.full((batch,), parts, dtype=torch.int32, device=dev)
        for be in backends:
            if be == "cuda":
                continue
            ms = measure(
                lambda be=be: ops.lagkv_scores(
                    paged.cache,
                    paged.block_table,
                    paged.seq_lens,
                    0,
                    num_parts,
                    a.lag,
                    max_parts=parts,
                    backend=be,
                )
            )
            add("lagkv", be, ms, bytes_lagkv(a, parts, batch))
    return rows


def point_gib(a, n: int, batch: int) -> float:
    """Buffers of one point: paged cache, SDPA's contiguous K/V, compaction workspace."""
    cache = batch * a.kv_heads * n * 2 * a.head_dim * a.dtype.itemsize
    return (2 * cache + a.keep * cache) / 2**30


def print_table(rows: list[Row], copy_gbps: float, device: str) -> None:
    print(f"\ncopy bandwidth ({device}): {copy_gbps:.1f} GB/s (read + write)\n")
    print(
        f"{'kernel':<8} {'backend':<8} {'N':>7} {'B':>4} {'ms':>10} {'GB/s':>9} {'%copy':>7} {'sdpa/ours':>10}"
    )
    for r in rows:
        vs = "" if r.vs_sdpa is None else f"{r.vs_sdpa:.2f}x"
        print(
            f"{r.kernel:<8} {r.backend:<8} {r.context:>7} {r.batch:>4} {r.ms:>10.3f} {r.gbps:>9.4g} "
            f"{r.pct_copy:>6.1f}% {vs:>10}"
        )


def main() -> None:
    a = parse_args()
    if a.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before any Triton kernel is imported
    elif not torch.cuda.is_available():
        raise SystemExit("--device cuda needs a GPU; use --device cpu for the smoke run")
    from vllm_kvcomp import ops

    backends = ["torch", "triton"] if a.device == "cpu" else ["triton"]
    if a.device == "cuda" and ops.cuda_extension_available():
        backends.append("cuda")
    measure = timer(a.device, a.warmup, a.iters)
    copy_gbps = copy_bandwidth(a.device, measure, 2.0 if a.device == "cuda" else 0.25)
    rows: list[Row] = []
    for n in a.contexts:
        for batch in a.batches:
            if point_gib(a, n, batch) > a.max_gib:
                print(
                    f"skip N={n} B={batch}: {point_gib(a, n, batch):.1f} GiB > --max-gib {a.max_gib}"
                )
                continue
            rows += bench_point(a, n, batch, backends, measure, copy_gbps)
            if a.device == "cuda":
                torch.cuda.empty_cache()
    print_table(rows, copy_gbps, torch.cuda.get_device_name() if a.device == "cuda" else "cpu")
    if a.json:
        a.json.write_text(
            json.dumps({"copy_gbps": copy_gbps, "rows": [asdict(r) for r in rows]}, indent=2)
        )


if __name__ == "__main__":
    main()
