"""Launcher of per-head compaction: write each head's kept tokens right-aligned, in place."""

from __future__ import annotations

import torch
import triton

from ._compaction import _compact_kernel
from .utils import CacheView, check_int_table


def compact_heads(
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    kept: torch.Tensor,
    counts: torch.Tensor,
    workspace: torch.Tensor | None = None,
) -> None:
    """Move head h's kept slots ``kept[b, h, :counts[b, h]]`` to slots ``[N_b - count, N_b)``.

    kv_cache [num_blocks, block_size, H_kv, 2D] (any dtype, strided), block_table [B, max_blocks]
    int32, seq_lens [B] int32 (N_b), kept [B, H_kv, K_max] int32 sorted ascending per head,
    counts [B, H_kv] int32. Kept tokens only move right, so the copy goes through ``workspace``
    [B, H_kv, K_max, 2D] (gather every moving cell, then scatter), which is overlap-safe.
    """
    view = CacheView.of(kv_cache)
    for name, t, dims in (
        ("block_table", block_table, 2),
        ("seq_lens", seq_lens, 1),
        ("kept", kept, 3),
        ("counts", counts, 2),
    ):
        check_int_table(name, t, dims)
    batch, heads, k_max = kept.shape
    if (
        heads != view.num_heads
        or tuple(counts.shape) != (batch, heads)
        or seq_lens.shape[0] != batch
    ):
        raise ValueError(
            "kept [B, H_kv, K_max], counts [B, H_kv] and seq_lens [B] disagree with the cache"
        )
    if k_max == 0 or batch == 0:
        return
    kept = kept.contiguous()
    cell = kv_cache.shape[-1]
    shape = (batch, heads, k_max, cell)
    if workspace is None:
        workspace = torch.empty(shape, dtype=kv_cache.dtype, device=kv_cache.device)
    elif (
        workspace.dtype != kv_cache.dtype
        or workspace.numel() < batch * heads * k_max * cell
        or not workspace.is_contiguous()
    ):
        raise ValueError(
            f"workspace must be a contiguous {kv_cache.dtype} tensor of >= {shape} elements"
        )
    block_t = max(1, min(64, 4096 // triton.next_power_of_2(cell)))
    grid = (triton.cdiv(k_max, block_t), heads, batch)
    for gather in (True, False):
        _compact_kernel[grid](
            kv_cache,
            block_table,
            seq_lens,
            kept,
            counts,
            workspace,
            view.stride_blk,
            view.stride_tok,
            view.stride_head,
            block_table.stride(0),
            kept.stride(0),
            kept.stride(1),
            counts.stride(0),
            counts.stride(1),
            k_max,
            CELL=cell,
            BLOCK_C=triton.next_power_of_2(cell),
            BLOCK_T=block_t,
            BLOCK_SIZE=view.block_size,
            GATHER=gather,
        )
