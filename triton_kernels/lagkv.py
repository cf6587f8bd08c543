"""Launcher of LagKV partition scoring over paged KV."""

from __future__ import annotations

import torch
import triton

from ._lagkv import _lagkv_kernel
from .utils import CacheView, check_int_table, per_head


def lagkv_scores(
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    start: torch.Tensor,
    num_parts: torch.Tensor,
    lag: int,
    max_parts: int,
    eps: float,
    unbiased: bool = True,
) -> torch.Tensor:
    """LagKV score of every token of partitions ``p < num_parts[b]`` of each head.

    kv_cache [num_blocks, block_size, H_kv, 2D] (float32/16, bf16); start [B] or [B, H_kv] int32:
    partition p of head h spans slots ``start + p·lag + [0, lag)`` and is normalised by the next
    ``lag`` slots; num_parts [B] int32 (≤ ``max_parts``); seq_lens [B] int32: a partition whose
    reference would pass N_b is not scored. The reference range
    per channel is clamped to ``eps``; std over channels is unbiased unless ``unbiased=False``.
    Returns scores [B, H_kv, max_parts, lag] float32 = softmax(std K̄) + softmax(std V̄) per
    partition; rows of missing partitions are 0.
    """
    view = CacheView.of(kv_cache)
    if kv_cache.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"LagKV scoring reads float caches, got {kv_cache.dtype}")
    check_int_table("block_table", block_table, 2)
    check_int_table("num_parts", num_parts, 1)
    check_int_table("seq_lens", seq_lens, 1)
    if lag < 2 or view.head_dim < 2:
        raise ValueError("lag and head_dim must be >= 2 for a channel std and a softmax")
    batch = num_parts.shape[0]
    start = per_head(start, batch, view.num_heads, "start")
    scores = torch.zeros(
        batch, view.num_heads, max_parts, lag, dtype=torch.float32, device=kv_cache.device
    )
    if batch == 0 or max_parts == 0:
        return scores
    block_l = triton.next_power_of_2(lag)
    block_d = max(
        1, min(triton.next_power_of_2(view.head_dim), 4096 // block_l)
    )  # tile ≤ 4096 values
    _lagkv_kernel[(max_parts, view.num_heads, batch)](
        kv_cache,
        block_table,
        seq_lens,
        start,
        num_parts,
        scores,
        eps,
        view.stride_blk,
        view.stride_tok,
        view.stride_head,
        block_table.stride(0),
        start.stride(0),
        start.stride(1),
        LAG=lag,
        HEAD_DIM=view.head_dim,
        BLOCK_L=block_l,
        BLOCK_D=block_d,
        BLOCK_SIZE=view.block_size,
        UNBIASED=unbiased,
        num_warps=8 if block_l >= 256 else 4,
    )
    return scores
