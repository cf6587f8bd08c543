"""The one dispatch point of vllm-kvcomp's kernels: paged decode attention on CUDA, Triton or
torch, multi-row (prefill chunk, draft rows) attention over packed pages on Triton or torch, and
CriticalKV's projected-value norms on Triton or torch.

Dispatch rule (``backend=None``):

1. tensors on CUDA -> **triton** (``vllm_kvcomp.kernels.triton_jit``; float64 norms: torch);
2. else (CPU tensors) -> **torch**, the plain reference of :mod:`vllm_kvcomp.kernels.reference`.

``backend="cuda" | "triton" | "torch"`` forces one; ``cuda`` is the optional ``vllm_kvcomp._C``
extension (float32/16, bf16, head_dim 64/128/256, ≤ 16 query heads per KV head, aligned cells).
It is never chosen by default: on an H100 it reached 34% of the copy bandwidth where Triton
reached 96-99% (docs/results/gpu_kernels.md). Forcing ``triton`` on CPU tensors needs
``TRITON_INTERPRET=1`` (tests, ``vllm-kvcomp bench kernels --device cpu``).

Conventions. One layer's cache is ``kv_cache [num_blocks, block_size, H_kv, 2D]`` (K in
``[0, D)``, V in ``[D, 2D)`` of a cell; any strides with a contiguous last dim: pass an LBHNC
cache as ``cache.transpose(1, 2)``); ``block_table [B, max_blocks]``: logical slot i of request b
is ``kv_cache[block_table[b, i // bs], i % bs]``; ``seq_lens [B]`` = N_b slots; per-head valid
ranges are right-aligned: head h of request b holds slots ``[start[b, h], N_b)``. Index tensors
may be any integer dtype (converted to int32). The GPU paths keep CUDA graphs' fixed shapes.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from vllm_kvcomp.kernels.reference import (
    Compensation,
    decode_reference,
    head_starts,
    prefill_reference,
    projected_l1_norms_reference,
)
from vllm_kvcomp.kernels.triton_jit.utils import interpreting

BACKENDS: tuple[str, ...] = ("cuda", "triton", "torch")
OPS: tuple[str, ...] = ("decode_attention", "prefill_attention", "projected_l1_norms")
CUDA_HEAD_DIMS = (64, 128, 256)
CUDA_MAX_GROUP = 16


@functools.cache
def cuda_extension_available() -> bool:
    """Whether the optional ``vllm_kvcomp._C`` extension is built and registered its ops."""
    try:
        import vllm_kvcomp._C  # noqa: F401  (registers torch.ops.kvcomp)
    except ImportError:
        return False
    return hasattr(torch.ops, "kvcomp") and hasattr(torch.ops.kvcomp, "decode_attention")


def resolve_backend(
    op: str, device: torch.device, backend: str | None = None, cuda_ok: bool = True
) -> str:
    """The backend that runs ``op`` on ``device`` (see the module docstring for the rule).

    ``cuda_ok=False`` says the CUDA kernel does not cover this call's case (dtype, head dim…).
    """
    if op not in OPS:
        raise ValueError(f"unknown kernel op {op!r}; the ops are {OPS}")
    choice = backend or "auto"
    if choice == "auto":
        return "triton" if device.type == "cuda" else "torch"
    if choice not in BACKENDS:
        raise ValueError(f"unknown kernel backend {choice!r}; pick one of {BACKENDS} or auto")
    if choice == "cuda" and (
        device.type != "cuda" or not cuda_extension_available() or not cuda_ok
    ):
        raise RuntimeError(
            f"{op}: the CUDA extension cannot run this case (built: {cuda_extension_available()})"
        )
    if choice == "triton" and device.type != "cuda" and not interpreting():
        raise RuntimeError(f"{op}: Triton on {device.type} tensors needs TRITON_INTERPRET=1")
    return choice


def _i32(t: Tensor) -> Tensor:
    return t if t.dtype == torch.int32 else t.to(torch.int32)


def decode_attention(
    q: Tensor,
    kv_cache: Tensor,
    block_table: Tensor,
    seq_lens: Tensor,
    start: Tensor | int | None = None,
    compensation: Compensation | None = None,
    scale: float | None = None,
    num_splits: int | None = None,
    backend: str | None = None,
    softcap: float = 0.0,
    sinks: Tensor | None = None,
    observe: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Decode attention of q [B, H_q, D] (one token per request, GQA: query head i reads KV head
    i // (H_q / H_kv)) over each head's slots ``[start[b, h], N_b)`` (start [B], [B, H_kv] or
    None = 0), plus an optional compensation token ``(k_hat [B, H_kv, D], v_hat [B, H_kv, D],
    counts [B, H_kv])`` of weight N_d·exp(scale·q·k̂) (counts 0 = off). Returns out [B, H_q, D]
    (q's dtype) and lse [B, H_q] float32, natural log (-inf when nothing is attended), ready for
    ``merge_attn_states`` (transpose to [H, T]). ``num_splits`` fixes the GPU key split count.
    The layer's variant as vLLM's kernels take it: ``softcap`` caps every logit (0 = off),
    ``sinks`` [H_q] or [B, H_q] are learned sink logits with a zero value (in the LSE). The CUDA
    extension supports neither. ``observe`` [B, H_kv] int64: addresses of float32 rows (0 = none)
    that get each cell's softmax weight among its head's cells, the mean over its query heads (H2O's
    observed attention; not the CUDA extension; the torch path: CPU rows only).
    """
    batch, _, d = q.shape
    hk = kv_cache.shape[2]
    scale = d**-0.5 if scale is None else scale
    start_bh = head_starts(start, batch, hk, q.device)
    bt, sl = _i32(block_table), _i32(seq_lens)
    plain = not softcap and sinks is None and observe is None
    # the extension's case check only where it is asked for (host time of every decode call)
    which = resolve_backend("decode_attention", q.device, backend,
                            backend != "cuda" or (plain and _cuda_supports(q, kv_cache)))
    if which == "torch":
        out, lse = decode_reference(q, kv_cache, bt, sl, start_bh, compensation, scale, softcap, sinks, observe)
        return out, lse.float()
    if num_splits is None:
        num_splits = _default_splits(q.device, batch * hk)
    k_hat, v_hat, counts = compensation if compensation is not None else (None, None, None)
    if counts is not None:
        counts = counts.to(torch.float32)
    if which == "triton":
        from vllm_kvcomp.kernels.triton_jit.decode import decode_attention as triton_decode

        return triton_decode(q, kv_cache, bt, sl, start_bh, k_hat, v_hat, counts, scale, num_splits,
                             softcap=softcap, sinks=sinks, observe=observe)
    return _cuda_decode(q, kv_cache, bt, sl, start_bh, (k_hat, v_hat, counts), scale, num_splits)


def prefill_attention(q: Tensor, kv_cache: Tensor, tables: Tensor, lengths: Tensor, query_start: Tensor,
                      compensation: Compensation | None = None, scale: float | None = None, softcap: float = 0.0,
                      sinks: Tensor | None = None, max_rows: int | None = None,
                      backend: str | None = None) -> tuple[Tensor, Tensor]:
    """Causal attention of S sequences of one KV head (kv_cache [P, bs, 1, 2D]) and G query heads
    each: q [T_total, G, D], sequence s owns rows ``query_start[s]:query_start[s+1]``, the last T
    of its ``lengths[s]`` cells in pages ``tables[s]`` (a prefill chunk, draft rows); optional
    compensation ``(k_hat [S, D], v_hat [S, D], counts [S])`` and ``sinks`` [S, G]. One Triton
    launch for every sequence (no CUDA extension); ``max_rows`` (a host int, the most rows of a
    sequence) only sizes the tile. Returns out [T_total, G, D] (q's dtype) and lse [T_total, G]
    float32."""
    which = resolve_backend("prefill_attention", q.device, backend, cuda_ok=False)
    tables, lengths, query_start = _i32(tables), _i32(lengths), _i32(query_start)
    if which == "torch":
        out, lse = prefill_reference(q, kv_cache, tables, lengths, query_start, compensation, scale, softcap, sinks)
        return out, lse.float()
    from vllm_kvcomp.kernels.triton_jit.prefill import prefill_attention as triton_prefill

    k_hat, v_hat, counts = compensation if compensation is not None else (None, None, None)
    return triton_prefill(q, kv_cache, tables, lengths, query_start, k_hat, v_hat, counts, scale, softcap, sinks,
                          max_rows)


def projected_l1_norms(values: Tensor, weight: Tensor, dtype: torch.dtype | None = None,
                       backend: str | None = None) -> Tensor:
    """[H_kv, N] ``mean_{q ∈ G(h)} ||v_i W_o^q||₁`` (CriticalKV's second-stage factor) of values
    [H_kv, N, D] and weight [H_q, D, hidden] (query head q's rows of the output projection, any
    strides), on the weight's device. The product runs in ``dtype`` (default: the weight's), the
    norms are summed in float32 (float64 for float64). Triton fuses product, |·| and sum (the
    torch path materialises [G, rows, hidden] blocks); it has no float64 (torch then)."""
    dtype = dtype or weight.dtype
    values, weight = values.to(weight.device, dtype), weight.to(dtype)
    if backend is None and dtype == torch.float64:
        backend = "torch"
    which = resolve_backend("projected_l1_norms", weight.device, backend, cuda_ok=False)
    if which == "torch":
        return projected_l1_norms_reference(values, weight)
    if dtype == torch.float64:
        raise RuntimeError("projected_l1_norms: Triton has no float64 product; use backend='torch'")
    from vllm_kvcomp.kernels.triton_jit.projected import projected_l1_norms as triton_norms

    return triton_norms(values, weight)


def _cuda_decode(
    q: Tensor,
    kv_cache: Tensor,
    block_table: Tensor,
    seq_lens: Tensor,
    start: Tensor,
    comp: tuple[Tensor | None, Tensor | None, Tensor | None],
    scale: float,
    num_splits: int,
) -> tuple[Tensor, Tensor]:
    """The extension's two-stage kernel; workspace and outputs are allocated here."""
    batch, hq, d = q.shape
    out = torch.empty_like(q)
    lse = torch.empty(batch, hq, dtype=torch.float32, device=q.device)
    mid_o = torch.empty(batch, hq, num_splits, d, dtype=torch.float32, device=q.device)
    mid_lse = torch.empty(batch, hq, num_splits, dtype=torch.float32, device=q.device)
    k_hat, v_hat, counts = comp
    tokens = (
        [None, None, None]
        if counts is None
        else [k_hat.float().contiguous(), v_hat.float().contiguous(), counts.contiguous()]
    )
    # The binding includes no CUDA header, so the stream travels as an integer handle.
    stream = torch.cuda.current_stream(q.device).cuda_stream
    with torch.cuda.device(q.device):
        torch.ops.kvcomp.decode_attention(
            q, kv_cache, block_table, seq_lens, start, *tokens, scale, num_splits,
            mid_o, mid_lse, out, lse, stream,
        )
    return out, lse


def _cuda_supports(q: Tensor, kv_cache: Tensor) -> bool:
    """dtype, head dim, group size and vector alignment (D/32 elements per lane) of the CUDA kernel."""
    batch, hq, d = q.shape
    hk = kv_cache.shape[2]
    if q.dtype not in (torch.float32, torch.float16, torch.bfloat16) or q.dtype != kv_cache.dtype:
        return False
    if d not in CUDA_HEAD_DIMS or hq % hk or hq // hk > CUDA_MAX_GROUP or batch > 65535:
        return False
    lane = d // 32
    return kv_cache.data_ptr() % (lane * kv_cache.element_size()) == 0 and all(
        st % lane == 0 for st in kv_cache.stride()[:3]
    )


def _default_splits(device: torch.device, programs: int) -> int:
    """Key splits so that about two waves of programs cover the GPU (fixed per batch shape)."""
    if device.type != "cuda":
        return 4
    return max(1, min(64, -(-2 * _multiprocessors(device) // max(programs, 1))))


@functools.lru_cache(maxsize=16)
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


__all__ = ["BACKENDS", "cuda_extension_available", "decode_attention", "prefill_attention", "projected_l1_norms",
           "resolve_backend"]
