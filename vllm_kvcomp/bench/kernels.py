"""The kernels the engine runs on a GPU, timed against the device's own ceilings, in one run.

Six phases (``--phases``; all but ``cpu`` and ``prefill`` by default):

``decode``
    ``kernels.decode_attention`` over a paged cache (per-head ranges + compensation token) on
    every backend (Triton, the CUDA extension if built; on CPU the torch path and the Triton
    interpreter) next to torch SDPA on contiguous K/V of the same size.
``pages``
    What a compressed decode step costs: the engine's own call (``CudaPagedCache.attend``) over
    packed per-(request, KV head) pages holding a fraction ``--kept`` of the context, next to the
    same call over every page (kept 1.0), our kernel on the uncompressed cache with its block
    table, and torch SDPA / FlashAttention on contiguous K/V. Each kept fraction's output is
    checked against the torch reference (relative error, bf16 tolerance) on small batches.
``compact``
    Packing the kept cells of one request (all layers and KV heads) into its pages
    (``CudaPagedCache.move`` of the move ``RequestPages.compact`` plans) against a device copy of
    the same bytes, and the generic read-then-write move it replaces.
``cpu``
    A compressed decode step's attention on vLLM's CPU backend (``--device cpu`` with vLLM
    installed): the engine's call (``CpuPagedCache.attend``, kvcomp's C kernel) over every layer's
    per-(request, KV head) pages of N cells each, in block order as packed pages are, next to
    vLLM's CPU kernel over the same pages (the engine's path without the C kernel); outputs
    compared. ns per cell = one step's time / (layers x sequences x N).
``prefill``
    A prefill chunk of a compressed request on vLLM's CPU backend (``--device cpu``): ``--chunk``
    query rows of each of ``B`` requests after N cells, the engine's call (``CpuPagedCache.attend``:
    one virtual sequence per (request, KV head) over its pages, one call per layer) next to vLLM's
    CPU kernel over the same tokens' full blocks (one sequence per request, every KV head), as an
    uncompressed request's chunk is attended; outputs compared.
``decide``
    The rest of a prompt-end compression, per policy (every registered policy and variant at
    ``--decide-ratio``), the two ways the worker can run it: **before** (the engine until
    2026-11-26) it read the request's pages to the host (all layers, ``read_pages`` then
    ``.cpu()``) and the policy decided there; **now** the policy is given the K/V and queries on
    the device (it scores there and selects on the host). Both times, the error the device way
    raises if any, and how many of the host's kept slots it keeps (the scores differ in rounding).
    ``--profile FILE`` also writes where each policy's decide spends its time (the device way on
    a GPU, the host way on CPU): Python functions by own time, torch operators by host and
    device time.

Bandwidth = the bytes a call must move (each KV byte it reads once, q read and out written once;
a move reads and writes every moved cell) / median time. GPU times come from
``triton.testing.do_bench`` (CUDA events, L2 flushed before every run); the copy bandwidth is
``dst.copy_(src)`` of 2 GiB, read + write counted. Usage::

    vllm-kvcomp bench kernels                                 # GPU, Llama-3.1-8B shapes
    vllm-kvcomp bench kernels --phases pages --kept 0.25 --json out.json
    python -m vllm_kvcomp.bench.kernels --device cpu          # tiny smoke grid, Triton interpreter
    vllm-kvcomp bench kernels --device cpu --phases cpu --layers 30 --kv-heads 3 --group 3 \
        --block-size 32 --dtype float32 --batches 4 --contexts 512,2000 --iters 20   # the bundled model's shapes
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
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from vllm_kvcomp.bench.common import module_main, write_report

PHASES = ("decode", "pages", "compact", "cpu", "prefill", "decide")
HOST_PHASES = ("cpu", "prefill")  # vLLM's CPU backend: only when asked for
GPU = dict(contexts="4096,16384,32768", batches="1,8,64", kv_heads=8, head_dim=128, layers=32,
           compact_context=32768, decide_contexts="8192,32768")
CPU = dict(contexts="256,512", batches="1,2", kv_heads=2, head_dim=64, layers=2, compact_context=512,
           decide_contexts="256")
CHECK_MAX_BATCH = 8  # the pages phase checks outputs against the reference up to this batch
EVICT_BYTES = 256 << 20  # the cpu phase writes this much between timed calls (8x a server CPU's L3)

Measure = Callable[[Callable[[], object]], float]


@dataclass
class Row:
    phase: str
    what: str
    context: int
    batch: int
    kept: float
    ms: float
    gbps: float
    pct_copy: float
    extra: dict = field(default_factory=dict)


def add_arguments(p: argparse.ArgumentParser) -> None:
    gpu = torch.cuda.is_available()
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if gpu else "cpu")
    p.add_argument("--phases", default=",".join(p for p in PHASES if p not in HOST_PHASES),
                   help=f"comma list of {', '.join(PHASES)} (default: all but {' and '.join(HOST_PHASES)})")
    p.add_argument("--chunk", type=int, default=2048, help="prefill phase: query rows of the chunk per request")
    p.add_argument("--contexts", help=f"comma list of N (default GPU {GPU['contexts']}, CPU {CPU['contexts']})")
    p.add_argument("--batches", help=f"comma list of B (default GPU {GPU['batches']}, CPU {CPU['batches']})")
    p.add_argument("--kept", default="0.5,0.25,0.125", help="kept fractions of the pages/compact phases")
    p.add_argument("--kv-heads", type=int, help="H_kv (default GPU 8, CPU 2)")
    p.add_argument("--group", type=int, default=4, help="query heads per KV head")
    p.add_argument("--head-dim", type=int, help="D (default GPU 128, CPU 64)")
    p.add_argument("--layers", type=int, help="layers of the compacted request (default GPU 32, CPU 2)")
    p.add_argument("--compact-context", type=int, help="tokens of the compacted request (default GPU 32768)")
    p.add_argument("--decide-contexts", help="comma list of prompt lengths of the decide phase "
                   f"(default GPU {GPU['decide_contexts']}, CPU {CPU['decide_contexts']})")
    p.add_argument("--decide-ratio", type=float, default=0.25, help="the policies' ratio in the decide phase")
    p.add_argument("--policies", help="decide phase: comma list of policy labels (default: every policy and variant)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--cpu-pages", default="block,scattered",
                   help="cpu phase: comma list of page orders, block (each sequence's pages in block order) "
                        "and/or scattered (drawn at random from a cache four times as large)")
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    p.add_argument("--num-splits", type=int, help="decode key splits (default: the dispatch's heuristic)")
    p.add_argument("--iters", type=int, help="CPU only: timed runs per point (default 1)")
    p.add_argument("--max-gib", type=float, default=40.0, help="skip points whose buffers exceed this")
    p.add_argument("--json", type=Path, help="also write the rows here")
    p.add_argument("--profile", type=Path,
                   help="decide phase: write each policy's profile here (Python functions, torch operators)")


def _resolve_defaults(a: argparse.Namespace) -> None:
    """Fill the device-dependent defaults in place."""
    d = GPU if a.device == "cuda" else CPU
    a.phases = [x for x in a.phases.split(",") if x]
    unknown = set(a.phases) - set(PHASES)
    if unknown:
        raise SystemExit(f"--phases: unknown {sorted(unknown)}; choose from {', '.join(PHASES)}")
    a.contexts = [int(x) for x in (a.contexts or d["contexts"]).split(",")]
    a.batches = [int(x) for x in (a.batches or d["batches"]).split(",")]
    a.kept = [float(x) for x in a.kept.split(",")]
    if any(not 0 < k < 1 for k in a.kept):
        raise SystemExit("--kept: fractions strictly between 0 and 1 (1.0 is always measured)")
    a.kv_heads = a.kv_heads or d["kv_heads"]
    a.head_dim = a.head_dim or d["head_dim"]
    a.layers = a.layers or d["layers"]
    a.compact_context = a.compact_context or d["compact_context"]
    a.decide_contexts = [int(x) for x in (a.decide_contexts or d["decide_contexts"]).split(",")]
    if not 0 < a.decide_ratio < 1:
        raise SystemExit("--decide-ratio: a fraction strictly between 0 and 1")
    a.iters = a.iters or 1
    a.cpu_pages = [x for x in a.cpu_pages.split(",") if x]
    if not a.cpu_pages or set(a.cpu_pages) - {"block", "scattered"}:
        raise SystemExit(f"--cpu-pages: a comma list of block, scattered (got {','.join(a.cpu_pages) or 'none'})")
    a.dtype = getattr(torch, a.dtype)


def timer(device: str, iters: int) -> Measure:
    """Median milliseconds of ``fn()``: ``triton.testing.do_bench`` on CUDA, wall clock on CPU."""
    if device == "cuda":
        from triton.testing import do_bench

        return functools.partial(do_bench, warmup=25, rep=100, return_mode="median")

    def run(fn: Callable[[], object]) -> float:
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)

    return run


def host_us(fn: Callable[[], object], device: str, calls: int = 50) -> float:
    """Microseconds the host spends per call launching ``fn`` (the queue is drained before and
    after; on a GPU a call whose kernels are shorter than this is launch-bound)."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - t0
    sync()
    return elapsed / calls * 1e6


def copy_bandwidth(device: str, measure: Measure, gib: float) -> float:
    """GB/s of ``dst.copy_(src)`` on a ``gib``-GiB buffer (read + write counted)."""
    n = int(gib * 2**30)
    src = torch.empty(n, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    ms = measure(lambda: dst.copy_(src))
    return 2 * n / ms / 1e6


def copy_time(device: str, measure: Measure, nbytes: int) -> float:
    """Milliseconds of a device copy of ``nbytes`` (buffers freed on return)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    return measure(functools.partial(dst.copy_, src))


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


def _row(a, phase: str, what: str, n: int, batch: int, kept: float, ms: float, nbytes: int, copy_gbps: float,
         **extra) -> Row:
    gbps = nbytes / ms / 1e6
    return Row(phase, what, n, batch, kept, ms, gbps, 100 * gbps / copy_gbps, extra)


# ---------------------------------------------------------------------------- vLLM's CPU backend
def bench_cpu(a: argparse.Namespace, n: int, batch: int) -> list[Row]:
    """One decode step's attention over every layer: ``batch`` requests x ``a.kv_heads`` KV heads,
    each a virtual sequence of ``n`` cells in its own pages, by the C kernel and by vLLM's kernel,
    for each page order of ``a.cpu_pages``."""
    from vllm_kvcomp.kernels import cpu_native

    if not cpu_native.covers(a.dtype, a.group, a.head_dim, a.block_size):
        raise SystemExit("--phases cpu: kvcomp's C kernel takes float32 (--dtype float32) with at most "
                         "32 query heads per KV head, head dims up to 256, and needs a C compiler")
    evict = torch.zeros(EVICT_BYTES // 4)
    return [row for order in a.cpu_pages for row in _cpu_pages(a, n, batch, order, evict)]


def _cpu_pages(a: argparse.Namespace, n: int, batch: int, order: str, evict: torch.Tensor) -> list[Row]:
    """The C kernel's row and vLLM's over pages in ``order``: ``block`` (in block order) or
    ``scattered`` (drawn at random from a cache four times as large, as a serving cache's free
    pages are). The two kernels alternate, each call after ``evict`` was written (as a model
    step's weights evict the caches)."""
    from vllm_kvcomp.engine.cache import AttentionVariant, CpuPagedCache

    bs, d, heads, seqs = a.block_size, a.head_dim, a.kv_heads, batch * a.kv_heads
    width = -(-n // bs)
    gen = torch.Generator().manual_seed(n + batch)
    blocks = (-(-seqs * width // heads) + 1) * (4 if order == "scattered" else 1)
    storage = torch.randn(a.layers, blocks, heads, bs, 2 * d, generator=gen).to(a.dtype)
    cache = CpuPagedCache([storage[layer] for layer in range(a.layers)])
    drawn = [torch.arange(seqs * width) if order == "block"
             else torch.randperm(blocks * heads - 1, generator=gen)[:seqs * width] for _ in range(a.layers)]
    tables = [(start + pages).view(seqs, width).to(torch.int32)
              for start, pages in zip(cache.geometry.first_page.tolist(), drawn)]
    queries = [torch.randn(seqs, a.group, d, generator=gen).to(a.dtype) for _ in range(a.layers)]
    lengths, starts = torch.full((seqs,), n, dtype=torch.int32), torch.arange(seqs + 1, dtype=torch.int32)
    variant = AttentionVariant(d ** -0.5)

    def step(native_rows: int) -> Callable[[], list[torch.Tensor]]:
        own = starts.clone()  # the cache plans its kernel once per query-row tensor: one each

        def call() -> list[torch.Tensor]:
            previous, CpuPagedCache.NATIVE_ROWS = CpuPagedCache.NATIVE_ROWS, native_rows
            try:
                return [cache.attend(q, t, lengths, own, variant, None, {}) for q, t in zip(queries, tables)]
            finally:
                CpuPagedCache.NATIVE_ROWS = previous
        return call

    calls = {"kvcomp C kernel": step(CpuPagedCache.NATIVE_ROWS), "vLLM CPU kernel": step(0)}  # 0 rows: vLLM's
    err = max(float((x - y).abs().max()) for x, y in zip(*(fn() for fn in calls.values())))
    times: dict[str, list[float]] = {what: [] for what in calls}
    for _ in range(a.iters):
        for what, fn in calls.items():
            evict.add_(1.0)
            t0 = time.perf_counter()
            fn()
            times[what].append((time.perf_counter() - t0) * 1e3)
    cells = a.layers * seqs * n
    medians = {what: statistics.median(ms) for what, ms in times.items()}
    rows = [_row(a, "cpu", what, n, batch, 1.0, ms, cells * 2 * d * a.dtype.itemsize, 1.0,
                 ns_per_cell=ms * 1e6 / cells, max_diff=err, pages=order) for what, ms in medians.items()]
    rows[0].extra["vs_vllm"] = rows[1].ms / rows[0].ms
    return rows


def bench_cpu_prefill(a: argparse.Namespace, n: int, batch: int) -> list[Row]:
    """A ``a.chunk``-row prefill chunk after ``n`` cells, ``batch`` requests, every layer: the
    engine's call over per-(request, KV head) sequences and vLLM's CPU kernel over the requests'
    full blocks (both over the same pages, in block order), alternating after ``evict``."""
    from vllm_kvcomp import vllm_compat
    from vllm_kvcomp.engine.cache import AttentionVariant, CpuPagedCache

    bs, d, heads, t = a.block_size, a.head_dim, a.kv_heads, a.chunk
    total, gen = n + t, torch.Generator().manual_seed(n + batch + t)
    width = -(-total // bs)
    storage = torch.randn(a.layers, batch * width + 1, heads, bs, 2 * d, generator=gen).to(a.dtype)
    cache = CpuPagedCache([storage[layer] for layer in range(a.layers)])
    blocks = torch.arange(batch * width).view(batch, width)  # request r's blocks, in block order
    tables = [cache.geometry.page_ids(blocks.flatten())[layer].view(heads, batch, width).transpose(0, 1)
              .reshape(batch * heads, width).to(torch.int32) for layer in range(a.layers)]  # sequence (r, h)
    queries = [torch.randn(batch, t, heads, a.group, d, generator=gen).to(a.dtype) for _ in range(a.layers)]
    variant = AttentionVariant(d ** -0.5)
    per_head = [q.transpose(1, 2).reshape(batch * heads * t, a.group, d).contiguous() for q in queries]
    lengths = torch.full((batch * heads,), total, dtype=torch.int32)
    starts = torch.arange(batch * heads + 1, dtype=torch.int32) * t
    natural = [storage[layer].view(-1, heads, 2 * bs, d).chunk(2, dim=2) for layer in range(a.layers)]
    flat = [q.reshape(batch * t, heads * a.group, d).contiguous() for q in queries]
    seq_lens = torch.full((batch,), total, dtype=torch.int32)
    req_starts = torch.arange(batch + 1, dtype=torch.int32) * t
    block_table = blocks.to(torch.int32)
    schedule = vllm_compat.cpu_attention_schedule(
        num_reqs=batch, num_heads=heads * a.group, num_kv_heads=heads, head_dim=d, seq_lens=seq_lens,
        dtype=a.dtype, query_start_loc=req_starts, causal=True, sliding_window_size=-1, isa="vec",
        dynamic_causal=None, kv_cache_dtype="auto")

    def engine() -> list[torch.Tensor]:
        memo: dict[str, object] = {}  # the step's layers share one schedule (their lengths are equal)
        return [cache.attend(q, table, lengths, starts, variant, None, memo) for q, table in zip(per_head, tables)]

    def vllm() -> list[torch.Tensor]:
        outs = []
        for q, (keys, values) in zip(flat, natural):
            out = torch.empty_like(q)
            vllm_compat.cpu_paged_attention(
                query=q, key_cache=keys, value_cache=values, output=out, query_start_loc=req_starts,
                seq_lens=seq_lens, scale=variant.scale, causal=True, alibi_slopes=None, sliding_window=-1,
                block_table=block_table, softcap=0.0, scheduler_metadata=schedule, s_aux=None)
            outs.append(out)
        return outs

    ours = torch.stack(engine()).view(a.layers, batch, heads, t, a.group, d).transpose(2, 3)
    err = float((ours.reshape(a.layers, batch * t, heads * a.group, d) - torch.stack(vllm())).abs().max())
    evict = torch.zeros(EVICT_BYTES // 4)
    times: dict[str, list[float]] = {"kvcomp over per-head pages": [], "vLLM CPU kernel, full blocks": []}
    for _ in range(a.iters):
        for what, fn in zip(times, (engine, vllm)):
            evict.add_(1.0)
            t0 = time.perf_counter()
            fn()
            times[what].append((time.perf_counter() - t0) * 1e3)
    medians = [statistics.median(ms) for ms in times.values()]
    rows = [_row(a, "prefill", what, n, batch, 1.0, ms, a.layers * batch * heads * total * 2 * d * a.dtype.itemsize,
                 1.0, chunk=t, max_diff=err) for what, ms in zip(times, medians)]
    rows[0].extra["vs_vllm"] = medians[0] / medians[1]
    return rows


# ---------------------------------------------------------------------------- uncompressed baselines
def contiguous_kv(batch: int, kv_heads: int, n: int, d: int, dtype: torch.dtype, device: str,
                  gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random K, V [B, H_kv, n, D] (the layout of torch SDPA and FlashAttention)."""
    k = torch.randn(batch, kv_heads, n, d, generator=gen, device=device).to(dtype)
    return k, torch.randn_like(k)


def sdpa_call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Callable[[], object]:
    """torch SDPA, its own choice of kernel: q [B, H_q, D] -> [B, H_q, 1, D] with GQA."""
    return functools.partial(torch.nn.functional.scaled_dot_product_attention, q.unsqueeze(2), k, v,
                             enable_gqa=True)


def flash_call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Callable[[], object] | None:
    """FlashAttention through SDPA: the G query heads of a KV head as G query rows (GQA without
    repeating K/V, non-causal). None where this torch build has no flash kernel for the case."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    batch, hk, _, d = k.shape
    rows = q.view(batch, hk, -1, d)

    def call():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(rows, k, v)

    try:
        call()
    except RuntimeError:
        return None
    return call


# ---------------------------------------------------------------------------- phase: decode
def bench_decode(a: argparse.Namespace, n: int, batch: int, backends: list[str], measure: Measure,
                 copy_gbps: float) -> list[Row]:
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
    nbytes = bytes_decode(a, n, batch)
    k, v = contiguous_kv(batch, hk, n, d, a.dtype, dev, gen)
    sdpa_ms = measure(sdpa_call(q, k, v))
    del k, v
    rows = [_row(a, "decode", "sdpa", n, batch, 1.0, sdpa_ms, nbytes, copy_gbps, vs_sdpa=1.0)]
    args = (q, paged.cache, paged.block_table, paged.seq_lens, 0, comp)
    for be in backends:
        ms = measure(functools.partial(kernels.decode_attention, *args, num_splits=a.num_splits, backend=be))
        rows.append(_row(a, "decode", be, n, batch, 1.0, ms, nbytes, copy_gbps, vs_sdpa=sdpa_ms / ms))
    return rows


# ---------------------------------------------------------------------------- phase: pages
@dataclass
class PagedRequests:
    """``batch`` requests of ``n`` tokens in one LBHNC buffer seen as the engine's pages."""

    cache: object  # CudaPagedCache
    storage: torch.Tensor  # [num_blocks, H_kv, bs, 2D]
    block_table: torch.Tensor  # [B, n / bs] int32
    pages: torch.Tensor  # [B, H_kv, n / bs] page ids of every request's heads, in logical order


def paged_requests(a: argparse.Namespace, n: int, batch: int, gen: torch.Generator) -> PagedRequests:
    """Random K/V, every request's blocks a random permutation of the buffer (block 0 unused)."""
    from vllm_kvcomp.engine.cache import CudaPagedCache

    bs, hk, d, dev = a.block_size, a.kv_heads, a.head_dim, a.device
    per = -(-n // bs)
    storage = torch.randn(1 + batch * per, hk, bs, 2 * d, generator=gen, device=dev).to(a.dtype)
    cache = CudaPagedCache([storage])
    blocks = (torch.randperm(batch * per, generator=gen, device=dev) + 1).view(batch, per)
    pages = blocks.unsqueeze(1) * hk + torch.arange(hk, device=dev).view(1, hk, 1)
    return PagedRequests(cache, storage, blocks.to(torch.int32), pages)


def kept_tables(reqs: PagedRequests, kept: float, n: int, bs: int, gen: torch.Generator) -> tuple[torch.Tensor, int]:
    """[B * H_kv, m] int32 page tables (as the engine builds them) of every head's
    ``m = ceil(kept * n / bs)`` packed pages (a random subset of its own pages, in random order:
    packed pages sit anywhere) and the kept length m * bs."""
    b, hk, per = reqs.pages.shape
    m = max(1, -(-round(kept * n) // bs))
    order = torch.rand(b, hk, per, generator=gen, device=reqs.pages.device).argsort(-1)[..., :m]
    return reqs.pages.gather(-1, order).view(b * hk, m).to(torch.int32), m * bs


def bench_pages(a: argparse.Namespace, n: int, batch: int, measure: Measure, copy_gbps: float) -> list[Row]:
    """The engine's compressed decode call at every kept fraction vs its uncompressed references."""
    from vllm_kvcomp import kernels
    from vllm_kvcomp.engine.cache import AttentionVariant
    from vllm_kvcomp.kernels.reference import decode_reference

    dev, hk, d, g, bs = a.device, a.kv_heads, a.head_dim, a.group, a.block_size
    gen = torch.Generator(device=dev).manual_seed(2)
    reqs = paged_requests(a, n, batch, gen)
    seqs = batch * hk
    q = torch.randn(batch, hk * g, d, generator=gen, device=dev).to(a.dtype)
    q_seq = q.view(seqs, g, d)  # one virtual sequence per (request, KV head), its G query heads
    query_start = torch.arange(seqs + 1, device=dev, dtype=torch.int32)
    scale = d**-0.5
    variant = AttentionVariant(scale)
    rows = []

    full_bytes = bytes_decode(a, n, batch)
    seq_lens = torch.full((batch,), n, dtype=torch.int32, device=dev)
    kernel_full = functools.partial(kernels.decode_attention, q, reqs.storage.transpose(1, 2), reqs.block_table,
                                    seq_lens, scale=scale, num_splits=a.num_splits)
    ms_kernel_full = measure(kernel_full)
    rows.append(_row(a, "pages", "kernel, block table (uncompressed)", n, batch, 1.0, ms_kernel_full, full_bytes,
                     copy_gbps))
    k, v = contiguous_kv(batch, hk, n, d, a.dtype, dev, gen)
    rows.append(_row(a, "pages", "torch sdpa (uncompressed)", n, batch, 1.0, measure(sdpa_call(q, k, v)),
                     full_bytes, copy_gbps))
    flash = flash_call(q, k, v)
    if flash is not None:
        rows.append(_row(a, "pages", "flash-attn via sdpa (uncompressed)", n, batch, 1.0, measure(flash), full_bytes,
                         copy_gbps))
    del k, v

    base_ms = None
    for kept in (1.0, *a.kept):
        tables, length = kept_tables(reqs, kept, n, bs, gen)
        lengths = torch.full((seqs,), length, dtype=torch.int32, device=dev)
        nbytes = bytes_decode(a, length, batch)
        attend = functools.partial(reqs.cache.attend, q_seq, tables, lengths, query_start, variant, None)
        ms = measure(attend)
        base_ms = base_ms or ms
        extra = {"vs_kept_1": ms / base_ms, "target": 1.2 * kept, "vs_kernel_full": ms / ms_kernel_full,
                 "host_us": host_us(attend, dev)}
        if batch <= CHECK_MAX_BATCH:
            out = attend().float()
            ref, _ = decode_reference(q_seq, reqs.cache.cells, tables, lengths, None, None, scale)
            extra["rel_err"] = float((out - ref).norm() / ref.norm())
        rows.append(_row(a, "pages", "engine attend (packed pages)", n, batch, kept, ms, nbytes, copy_gbps, **extra))
        raw = functools.partial(kernels.decode_attention, q_seq, reqs.cache.cells, tables, lengths, scale=scale,
                                num_splits=a.num_splits)
        rows.append(_row(a, "pages", "kernel only (packed pages)", n, batch, kept, measure(raw), nbytes, copy_gbps))
    capped = AttentionVariant(scale, 50.0, torch.randn(hk * g, generator=gen, device=dev))
    tables, length = kept_tables(reqs, a.kept[-1], n, bs, gen)
    lengths = torch.full((seqs,), length, dtype=torch.int32, device=dev)
    variant_call = functools.partial(reqs.cache.attend, q_seq, tables, lengths, query_start, capped, None)
    rows.append(_row(a, "pages", "engine attend, soft-cap + sinks", n, batch, a.kept[-1], measure(variant_call),
                     bytes_decode(a, length, batch), copy_gbps, host_us=host_us(variant_call, dev)))
    return rows


# ---------------------------------------------------------------------------- phase: compact
def bench_compact(a: argparse.Namespace, measure: Measure, copy_gbps: float) -> list[Row]:
    """One request of ``--compact-context`` tokens in ``--layers`` layers keeps ``kept`` of every
    head (a random page-rounded subset): the engine's move vs a copy of the same bytes."""
    from vllm_kvcomp.engine.cache import CudaPagedCache, PagedCache
    from vllm_kvcomp.engine.pages import RequestPages

    dev, hk, d, bs, n, nl = a.device, a.kv_heads, a.head_dim, a.block_size, a.compact_context, a.layers
    per = -(-n // bs) + 1
    gen = torch.Generator(device=dev).manual_seed(3)
    storage = torch.randn(nl, per, hk, bs, 2 * d, generator=gen, device=dev).to(a.dtype)
    cache = CudaPagedCache([storage[layer] for layer in range(nl)])
    block_ids = torch.arange(per)
    cpu_gen = torch.Generator().manual_seed(3)
    rows = []
    for kept in a.kept:
        k = max(bs, round(kept * n / bs) * bs) + n % bs
        chosen = [[torch.randperm(n, generator=cpu_gen)[:k].sort().values for _ in range(hk)] for _ in range(nl)]
        move, _ = RequestPages(cache.geometry).compact(chosen, block_ids, n)
        move.src_pages, move.src_offsets, move.dst_pages, move.dst_offsets = (
            t.to(dev) for t in (move.src_pages, move.src_offsets, move.dst_pages, move.dst_offsets))
        cells = len(move)
        nbytes = 2 * cells * 2 * d * a.dtype.itemsize  # every moved cell read once and written once
        copy_ms = copy_time(dev, measure, nbytes // 2)
        ours = measure(functools.partial(cache.move, move))
        generic = measure(functools.partial(PagedCache.move, cache, move))
        extra = {"cells": cells, "copy_ms": copy_ms, "vs_copy": copy_ms / ours}
        rows.append(_row(a, "compact", "CudaPagedCache.move", n, nl, kept, ours, nbytes, copy_gbps, **extra))
        rows.append(_row(a, "compact", "generic read + write", n, nl, kept, generic, nbytes, copy_gbps,
                         cells=cells, copy_ms=copy_ms, vs_copy=copy_ms / generic))
        rows.append(_row(a, "compact", "device copy, same bytes", n, nl, kept, copy_ms, nbytes, copy_gbps))
    return rows


# ---------------------------------------------------------------------------- phase: decide
def bench_profiles(layers: int, kv_heads: int, group: int, head_dim: int, seed: int = 4) -> dict:
    """Calibration data of every profile kind for the benchmark's model shape (the real model is
    not here): a quarter of the KV heads retrieval heads, layers paired into groups, random gates, a
    random kvzap scorer."""
    from vllm_kvcomp.calibration.profiles import (
        HeadGatesProfile,
        LayerGroupsProfile,
        ModelIdentity,
        RetrievalHeadsProfile,
        ScorerProfile,
    )

    model = ModelIdentity.from_config({"model_type": "llama", "num_hidden_layers": layers,
                                       "num_attention_heads": kv_heads * group, "num_key_value_heads": kv_heads,
                                       "hidden_size": kv_heads * group * head_dim})
    gen = torch.Generator().manual_seed(seed)
    pairs = [(layer, head) for layer in range(layers) for head in range(kv_heads)]
    retrieval = torch.randperm(len(pairs), generator=gen)[: max(1, len(pairs) // 4)].tolist()
    gates = torch.rand(layers, kv_heads, generator=gen)
    weights = torch.randn(layers, kv_heads, head_dim * 3 // 2, generator=gen)
    bias = torch.randn(layers, kv_heads, generator=gen)
    return {
        "razor": RetrievalHeadsProfile(model=model, kv_heads=frozenset(pairs[i] for i in retrieval)),
        "pod": LayerGroupsProfile(model=model, groups=tuple(tuple(range(i, min(i + 2, layers)))
                                                            for i in range(0, layers, 2))),
        "duoattention": HeadGatesProfile(model=model, gates=tuple(tuple(row) for row in gates.tolist())),
        "kvzap": ScorerProfile.from_arrays(model, weights, bias),
    }


def decide_policies(a: argparse.Namespace) -> list[tuple[str, object]]:
    """(label, policy) of every registered policy and variant (or ``--policies``) at ``--decide-ratio``."""
    from vllm_kvcomp.calibration.profiles import bind_profile
    from vllm_kvcomp.policies.registry import get_policy_class, policy_variants
    from vllm_kvcomp.spec import CompressionSpec

    profiles = bench_profiles(a.layers, a.kv_heads, a.group, a.head_dim)
    wanted = None if not a.policies else [x.strip() for x in a.policies.split(",") if x.strip()]
    out = []
    for label, name, settings in policy_variants():
        if wanted is not None and label not in wanted:
            continue
        cls = get_policy_class(name)
        ratio = {} if name == "full" else {"ratio": a.decide_ratio}
        policy = CompressionSpec.from_mapping({"policy": name, **ratio, **settings}).build_policy()
        out.append((label, policy if cls.PROFILE is None else bind_profile(policy, profiles[cls.PROFILE])))
    missing = set(wanted or ()) - {label for label, _ in out}
    if missing:
        raise SystemExit(f"--policies: unknown {sorted(missing)}")
    return out


def _timed(fn: Callable[[], object], device: str) -> tuple[object, float]:
    """``fn()`` and its wall-clock milliseconds (the device drained before and after)."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    out = fn()
    sync()
    return out, (time.perf_counter() - t0) * 1e3


def profile_call(path: Path, title: str, fn: Callable[[], object], device: str) -> None:
    """Append to ``path`` where one call of ``fn`` spends its time: Python functions by own time
    (``cProfile``), torch operators by host time and, on a GPU, by device time (``torch.profiler``)."""
    import cProfile
    import io
    import pstats

    from torch.profiler import ProfilerActivity, profile

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    functions = cProfile.Profile()
    sync()
    functions.enable()
    fn()
    sync()
    functions.disable()
    text = io.StringIO()
    pstats.Stats(functions, stream=text).sort_stats("tottime").print_stats(20)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as ops:
        fn()
        sync()
    tables = [ops.key_averages().table(sort_by=key, row_limit=15, max_name_column_width=50)
              for key in ["self_cpu_time_total"] + (["self_cuda_time_total"] if device == "cuda" else [])]
    with path.open("a") as out:
        out.write("\n".join([f"######## {title}", text.getvalue(), *tables, ""]))


def kept_overlap(host: list, device: list) -> float:
    """Fraction of the host selections' kept slots the device selections keep too (1.0 = the same)."""
    same = total = 0
    for h_sel, d_sel in zip(host, device):
        for h_idx, d_idx in zip(h_sel.indices, d_sel.indices):
            h_idx, d_idx = h_idx.cpu(), d_idx.cpu()
            same += int(torch.isin(h_idx, d_idx).sum())
            total += h_idx.numel()
    return same / max(total, 1)


def bench_decide(a: argparse.Namespace, n: int) -> list[Row]:
    """One request of ``n`` prompt tokens in ``--layers`` layers: the worker's read to the host,
    then each policy's prompt-end ``decide`` on the host and on the device (wall clock; on the
    device one call after a warm-up)."""
    from vllm_kvcomp.engine.cache import CudaPagedCache
    from vllm_kvcomp.engine.pages import RequestPages
    from vllm_kvcomp.policies.base import LayerKV, RequestState

    dev, hk, g, d, bs, nl = a.device, a.kv_heads, a.group, a.head_dim, a.block_size, a.layers
    gen = torch.Generator(device=dev).manual_seed(5)
    per = -(-n // bs)
    storage = torch.randn(nl, per, hk, bs, 2 * d, generator=gen, device=dev).to(a.dtype)
    cache = CudaPagedCache([storage[layer] for layer in range(nl)])
    pages = RequestPages(cache.geometry)
    tables, lengths = pages.tables(torch.arange(per), n), pages.lengths(n)  # [L, H, W], [L, H]
    policies = decide_policies(a)
    window = max(p.queries_needed() for _, p in policies)
    queries = [torch.randn(hk * g, window, d, generator=gen, device=dev).to(a.dtype) for _ in range(nl)]
    out_proj = [torch.randn(hk * g, d, hk * g * d, generator=gen, device=dev).to(a.dtype) * d**-0.5
                for _ in range(nl)] if any(p.NEEDS_OUT_PROJ for _, p in policies) else None

    def read_to_host() -> list[tuple[torch.Tensor, torch.Tensor]]:
        keys, values = cache.read_pages(tables.to(dev))  # [L, H, W * bs, D]
        return [(keys[layer, :, :n].cpu(), values[layer, :, :n].cpu()) for layer in range(nl)]

    read_to_host()
    host_kv, read_ms = _timed(read_to_host, dev)
    keys, values = cache.read_pages(tables.to(dev))
    device_kv = [(keys[layer, :, :n].clone(), values[layer, :, :n].clone()) for layer in range(nl)]
    kv_bytes = 2 * nl * hk * n * d * a.dtype.itemsize

    def layers(kv: list, on: str, policy) -> list[LayerKV]:
        w = policy.queries_needed()
        return [LayerKV(keys=k, values=v, layer=layer, num_layers=nl, lengths=lengths[layer],
                        queries=queries[layer][:, window - w:].to(on) if w else None,
                        query_positions=torch.arange(n - w, n) if w else None,
                        out_proj=out_proj[layer] if policy.NEEDS_OUT_PROJ else None)  # the model's, on the device
                for layer, (k, v) in enumerate(kv)]

    def decide(policy, inputs: list[LayerKV]):
        state = RequestState(prompt_len=n, page_quantum=(bs, n % bs))
        return policy.decide(inputs, state)

    rows = [Row("decide", "read pages to the host", n, nl, 1.0, read_ms, kv_bytes / read_ms / 1e6, 0.0,
                {"host_threads": torch.get_num_threads()})]
    for label, policy in policies:
        host_inputs = layers(host_kv, "cpu", policy)
        host, host_ms = _timed(functools.partial(decide, policy, host_inputs), "cpu")
        extra: dict = {"read_ms": read_ms}
        if dev == "cuda":
            device_inputs = layers(device_kv, dev, policy)
            try:
                decide(policy, device_inputs)  # warm-up: kernels, cuBLAS handles
                on_device, extra["device_ms"] = _timed(functools.partial(decide, policy, device_inputs), dev)
                extra["overlap"] = kept_overlap(host, on_device)
            except (RuntimeError, TypeError, ValueError) as err:  # measured: what this policy does on a device
                extra["device_error"] = str(err).splitlines()[0][:120]
        if a.profile and "device_error" not in extra:
            inputs = device_inputs if dev == "cuda" else host_inputs
            profile_call(a.profile, f"{label} N={n}", functools.partial(decide, policy, inputs), dev)
        kept = sum(len(idx) for sel in host for idx in sel.indices) / (nl * hk * n)
        rows.append(Row("decide", label, n, nl, kept, host_ms, 0.0, 0.0, extra))
        print(f"decide N={n} {label}: host {host_ms:.0f} ms, {extra}", flush=True)
    return rows


# ---------------------------------------------------------------------------- report
def _fmt(extra: dict, key: str, fmt: str) -> str:
    return format(extra[key], fmt) if key in extra else ""


def markdown(rows: list[Row], copy_gbps: float, device: str) -> str:
    """The copy bandwidth, then one table per phase."""
    out = [f"copy bandwidth ({device}): {copy_gbps:.1f} GB/s (read + write)"]
    decode = [r for r in rows if r.phase == "decode"]
    if decode:
        out += ["", "## decode: paged decode attention vs torch SDPA", "",
                "| backend | N | B | ms | GB/s | % copy | sdpa / ours |", "|---|---:|---:|---:|---:|---:|---:|"]
        out += [f"| {r.what} | {r.context} | {r.batch} | {r.ms:.3f} | {r.gbps:.4g} | {r.pct_copy:.1f}% "
                f"| {r.extra['vs_sdpa']:.2f}x |" for r in decode]
    pages = [r for r in rows if r.phase == "pages"]
    if pages:
        out += ["", "## pages: compressed decode over packed per-head pages vs uncompressed", "",
                "time vs kept 1.0 = this call / the same call over every page (target <= 1.2 x kept); "
                "rel err = ||out - ref|| / ||ref|| against the torch reference (float32 accumulation)", "",
                "| call | N | B | kept | ms | GB/s | % copy | vs kept 1.0 | target | vs kernel uncompressed "
                "| rel err | host µs |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in pages:
            cells = [_fmt(r.extra, key, f) for key, f in
                     (("vs_kept_1", ".3f"), ("target", ".3f"), ("vs_kernel_full", ".3f"), ("rel_err", ".1e"),
                      ("host_us", ".0f"))]
            out.append(f"| {r.what} | {r.context} | {r.batch} | {r.kept:g} | {r.ms:.3f} | {r.gbps:.4g} "
                       f"| {r.pct_copy:.1f}% | {' | '.join(cells)} |")
    compact = [r for r in rows if r.phase == "compact"]
    if compact:
        out += ["", "## compact: packing one request's kept cells (all layers, all KV heads)", "",
                "| move | N | layers | kept | cells moved | ms | GB/s (read + write) | % copy | copy time / this |",
                "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in compact:
            vs = f"{r.extra['vs_copy']:.2f}x" if "vs_copy" in r.extra else ""
            cells = r.extra.get("cells", "")
            out.append(f"| {r.what} | {r.context} | {r.batch} | {r.kept:g} | {cells} | {r.ms:.3f} | {r.gbps:.4g} "
                       f"| {r.pct_copy:.1f}% | {vs} |")
    cpu = [r for r in rows if r.phase == "cpu"]
    if cpu:
        out += ["", "## cpu: a compressed decode step's attention on vLLM's CPU backend (every layer)", "",
                "| call | pages | N | requests | ms | ns per cell | GB/s | vLLM's / ours | max abs diff |",
                "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
        out += [f"| {r.what} | {r.extra['pages']} | {r.context} | {r.batch} | {r.ms:.3f} | {r.extra['ns_per_cell']:.1f} | {r.gbps:.4g} "
                f"| {_fmt(r.extra, 'vs_vllm', '.2f')} | {r.extra['max_diff']:.1e} |" for r in cpu]
    prefill = [r for r in rows if r.phase == "prefill"]
    if prefill:
        out += ["", "## prefill: a compressed request's prefill chunk on vLLM's CPU backend (every layer)", "",
                "| call | N before the chunk | chunk | requests | ms | ours / vLLM's (target <= 1.2) | max abs diff |",
                "|---|---:|---:|---:|---:|---:|---:|"]
        out += [f"| {r.what} | {r.context} | {r.extra['chunk']} | {r.batch} | {r.ms:.1f} "
                f"| {_fmt(r.extra, 'vs_vllm', '.2f')} | {r.extra['max_diff']:.1e} |" for r in prefill]
    decide = [r for r in rows if r.phase == "decide"]
    if decide:
        out += ["", "## decide: the rest of a prompt-end compression, per policy", "",
                "before = the worker's read of the request's pages to the host (all layers) + the policy's decide "
                "on those host tensors (the engine until 2026-11-26); now = the same decide given the K/V and "
                "queries on the device; same kept = the share of the host's kept slots the device way keeps", ""]
        out += [f"- N = {r.context}: read {r.ms:.1f} ms ({r.gbps:.1f} GB/s), host decide on "
                f"{r.extra['host_threads']} torch threads" for r in decide if "host_threads" in r.extra]
        out += ["", "| policy | N | layers | kept | read ms | host decide ms | before ms | now ms | now / before "
                "| same kept | device error |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
        for r in decide:
            if "read_ms" not in r.extra:
                continue
            before = r.extra["read_ms"] + r.ms
            now = r.extra.get("device_ms")
            ratio = f"{now / before:.3f}x" if now is not None else ""
            out.append(f"| {r.what} | {r.context} | {r.batch} | {r.kept:.3f} | {r.extra['read_ms']:.1f} | {r.ms:.1f} "
                       f"| {before:.1f} | {_fmt(r.extra, 'device_ms', '.1f')} | {ratio} "
                       f"| {_fmt(r.extra, 'overlap', '.4f')} | {r.extra.get('device_error', '')} |")
    return "\n".join(out)


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
    measure = timer(a.device, a.iters)
    copy_gbps = copy_bandwidth(a.device, measure, 2.0 if a.device == "cuda" else 0.25)
    rows: list[Row] = []
    for n in a.contexts:
        for batch in a.batches:
            if point_gib(a, n, batch) > a.max_gib:
                print(f"skip N={n} B={batch}: {point_gib(a, n, batch):.1f} GiB > --max-gib {a.max_gib}")
                continue
            if "decode" in a.phases:
                rows += bench_decode(a, n, batch, backends, measure, copy_gbps)
            if "pages" in a.phases:
                rows += bench_pages(a, n, batch, measure, copy_gbps)
            if "cpu" in a.phases and a.device == "cpu":
                rows += bench_cpu(a, n, batch)
            if "prefill" in a.phases and a.device == "cpu":
                rows += bench_cpu_prefill(a, n, batch)
            if a.device == "cuda":
                torch.cuda.empty_cache()
    if "compact" in a.phases:
        rows += bench_compact(a, measure, copy_gbps)
    if "decide" in a.phases:
        if a.profile:
            a.profile.write_text("")
        for n in a.decide_contexts:
            rows += bench_decide(a, n)
            if a.device == "cuda":
                torch.cuda.empty_cache()
    device = torch.cuda.get_device_name() if a.device == "cuda" else "cpu"
    table = markdown(rows, copy_gbps, device)
    print(table)
    write_report(a.out, a.command, table)
    if a.json:
        a.json.write_text(json.dumps({"device": device, "copy_gbps": copy_gbps, "rows": [asdict(r) for r in rows]},
                                     indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    return module_main(sys.modules[__name__], "kernels", argv)


if __name__ == "__main__":
    sys.exit(main())
