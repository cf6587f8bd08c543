"""Launcher of observation-window attention scores (SnapKV/H2O/SAGE-KV style) over paged KV."""

from __future__ import annotations

import torch
import triton

from ._window import _window_combine_kernel, _window_partial_kernel, _window_scores_kernel
from .utils import CacheView, check_int_table, check_query, dot_f32, per_head


def window_scores(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    n_max: int,
    start: torch.Tensor | None = None,
    scale: float | None = None,
    with_entropy: bool = False,
    chunk: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Softmax attention of each request's last w queries over its keys, reduced per KV head.

    q [B, w, H_q, D] post-RoPE queries of slots ``[N_b - w, N_b)``; kv_cache
    [num_blocks, block_size, H_kv, 2D]; seq_lens [B] int32 (N_b ≤ ``n_max``); start [B] or
    [B, H_kv] int32 first live slot per head (None = 0). Query j sees slots
    ``[start, N_b - w + j]`` (causal). Returns scores [B, H_kv, n_max] float32: probabilities
    summed over the w queries and the G query heads of each KV head (0 outside the live range),
    and with ``with_entropy`` the entropy [B, H_q, w] float32 (nats) of every query's row.
    ``chunk`` (a multiple of 64) is the key range of one program.
    """
    view = CacheView.of(kv_cache)
    batch, w, hq, d = q.shape
    check_query(q, view, kv_cache)
    check_int_table("block_table", block_table, 2)
    check_int_table("seq_lens", seq_lens, 1)
    if chunk < 64 or chunk % 64:
        raise ValueError("chunk must be a positive multiple of 64")
    if start is None:
        start = torch.zeros(1, dtype=torch.int32, device=q.device).expand(batch)
    start = per_head(start, batch, view.num_heads, "start")
    scale = d**-0.5 if scale is None else scale
    hk = view.num_heads
    group = hq // hk
    block_m = max(16, triton.next_power_of_2(group * w))
    block_d = triton.next_power_of_2(d)
    block_n = max(16, min(64, 1 << (8192 // (block_m + block_d)).bit_length() - 1))
    num_chunks = max(1, triton.cdiv(n_max, chunk))
    dev = q.device
    scores = torch.zeros(batch, hk, n_max, dtype=torch.float32, device=dev)
    entropy = torch.empty(batch, hq, w, dtype=torch.float32, device=dev) if with_entropy else None
    if batch == 0 or w == 0:
        return scores, entropy
    part = torch.empty(3, batch, hk, num_chunks, block_m, dtype=torch.float32, device=dev)
    lse = torch.empty(batch, hk, block_m, dtype=torch.float32, device=dev)
    common = dict(
        W=w,
        GROUP=group,
        HEAD_DIM=d,
        CHUNK=chunk,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        BLOCK_SIZE=view.block_size,
        DOT_F32=dot_f32(q.dtype),
        num_warps=8 if block_m >= 128 else 4,
    )
    strides = (
        q.stride(0),
        q.stride(1),
        q.stride(2),
        view.stride_blk,
        view.stride_tok,
        view.stride_head,
        block_table.stride(0),
        start.stride(0),
        start.stride(1),
    )
    grid = (num_chunks, hk, batch)
    _window_partial_kernel[grid](
        q, kv_cache, block_table, seq_lens, start, part, scale, *strides, **common
    )
    _window_combine_kernel[(hk, batch)](
        part,
        lse,
        entropy if with_entropy else lse,
        num_chunks,
        ROWS=group * w,
        BLOCK_M=block_m,
        HAS_ENTROPY=with_entropy,
    )
    _window_scores_kernel[grid](
        q, kv_cache, block_table, seq_lens, start, lse, scores, scale, n_max, *strides, **common
    )
    return scores, entropy
