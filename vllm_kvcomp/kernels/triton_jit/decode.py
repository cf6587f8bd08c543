"""Launcher of paged decode attention with per-(request, KV head) valid ranges and LSE output."""

from __future__ import annotations

import torch
import triton

from vllm_kvcomp.kernels.triton_jit._decode import (
    _decode_merge_kernel,
    _decode_observe_kernel,
    _decode_split_kernel,
)
from vllm_kvcomp.kernels.triton_jit.utils import (
    CacheView,
    check_int_table,
    check_query,
    dot_f32,
    per_head,
)

Compensation = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def decode_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    start: torch.Tensor | None = None,
    k_hat: torch.Tensor | None = None,
    v_hat: torch.Tensor | None = None,
    comp_counts: torch.Tensor | None = None,
    scale: float | None = None,
    num_splits: int = 8,
    out: torch.Tensor | None = None,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
    observe: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One query per request over each KV head's slots ``[start[b, h], seq_lens[b])``.

    q [B, H_q, D] (H_q = G·H_kv, query head i reads KV head i // G); kv_cache
    [num_blocks, block_size, H_kv, 2D]; block_table [B, max_blocks] int32; seq_lens [B] int32;
    start [B] or [B, H_kv] int32 (None = 0). Compensation (RazorAttention eq. 5): k_hat/v_hat
    [B, H_kv, D], comp_counts [B, H_kv] float32 N_d (0 = off) add a token of weight
    N_d·exp(scale·q·k̂) and value v̂. ``softcap`` caps every logit (0 = off); ``sinks`` [H_q] or
    [B, H_q] are sink logits with a zero value. Returns out [B, H_q, D] (q's dtype, or ``out``) and
    lse [B, H_q] float32 (natural log, -inf where nothing is attended). ``num_splits`` is fixed
    per call (CUDA-graph safe): each head's range is cut into that many key splits.

    ``observe`` [B, H_kv] int64 on q's device: addresses (``Tensor.data_ptr()``) of float32 rows,
    0 = none, as kvcomp's CPU kernel takes them (``cpu_native.merged_attention``), so that the
    engine's per-request rows (:class:`~vllm_kvcomp.engine.state.ObservedAttention`, each its own
    growing buffer) need no shared pool. Row (b, h) gets added, at index i of each slot i in
    ``[start[b, h], seq_lens[b])``, the softmax weight of that cell among the head's cells alone
    (soft-capped logits where ``softcap``; no compensation token, no sink), the mean over the G
    query heads: rows hold at least ``seq_lens[b]`` floats and never overlap. Stage 1 then
    stores the observed heads' logits in a [B, H_q, max_blocks·block_size] float32 buffer and a
    third launch normalises them by the final LSE over the cells: 8·G bytes a cell more traffic
    (written, read back) against 2·D·itemsize for reading the keys again, and no paging in the
    extra pass.
    """
    view = CacheView.of(kv_cache)
    batch, hq, d = q.shape
    check_query(q, view, kv_cache)
    check_int_table("block_table", block_table, 2)
    check_int_table("seq_lens", seq_lens, 1)
    if start is None:
        start = torch.zeros(1, dtype=torch.int32, device=q.device).expand(batch)
    start = per_head(start, batch, view.num_heads, "start")
    comp = _check_compensation(k_hat, v_hat, comp_counts, (batch, view.num_heads, d))
    if observe is not None and (observe.dtype != torch.int64 or tuple(observe.shape) != (batch, view.num_heads)
                                or observe.device != q.device):
        raise ValueError(f"observe must be int64 [B, H_kv] = [{batch}, {view.num_heads}] on {q.device}, got "
                         f"{observe.dtype} {tuple(observe.shape)} on {observe.device}")
    if num_splits < 1:
        raise ValueError("num_splits must be >= 1")
    scale = d**-0.5 if scale is None else scale
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.dtype != q.dtype or out.stride(-1) != 1:
        raise ValueError(f"out must be {tuple(q.shape)} {q.dtype} with a contiguous last dim")
    lse = torch.empty(batch, hq, dtype=torch.float32, device=q.device)
    if sinks is not None:
        if sinks.shape[-1] != hq or sinks.dim() not in (1, 2) or (sinks.dim() == 2 and sinks.shape[0] != batch):
            raise ValueError(f"sinks must be [H_q] or [B, H_q] = [{batch}, {hq}], got {tuple(sinks.shape)}")
        sinks = sinks.to(torch.float32).expand(batch, hq).contiguous()
    if batch:
        _launch(q, kv_cache, view, block_table, seq_lens, start, comp, scale, num_splits, out, lse,
                float(softcap), sinks, None if observe is None else observe.contiguous())
    return out, lse


def _check_compensation(
    k_hat: torch.Tensor | None,
    v_hat: torch.Tensor | None,
    comp_counts: torch.Tensor | None,
    shape: tuple[int, int, int],
) -> Compensation | None:
    """(k_hat, v_hat [B, H_kv, D] contiguous, counts [B, H_kv] float32) or None when off."""
    if comp_counts is None:
        return None
    if k_hat is None or v_hat is None or tuple(k_hat.shape) != shape or tuple(v_hat.shape) != shape:
        raise ValueError(f"compensation needs k_hat and v_hat of shape {shape}")
    if tuple(comp_counts.shape) != shape[:2]:
        raise ValueError(f"comp_counts must be [B, H_kv] = {shape[:2]}")
    return k_hat.contiguous(), v_hat.contiguous(), comp_counts.to(torch.float32).contiguous()


def _launch(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    view: CacheView,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    start: torch.Tensor,
    comp: Compensation | None,
    scale: float,
    num_splits: int,
    out: torch.Tensor,
    lse: torch.Tensor,
    softcap: float,
    sinks: torch.Tensor | None,
    observe: torch.Tensor | None,
) -> None:
    """Stage 1 (one program per request, KV head and key split), stage 2 (the merge), and with
    ``observe`` stage 3 (the observed weights)."""
    batch, hq, d = q.shape
    group = hq // view.num_heads
    mid_o = torch.empty(batch, hq, num_splits, d, dtype=torch.float32, device=q.device)
    mid_lse = torch.empty(batch, hq, num_splits, dtype=torch.float32, device=q.device)
    block_d = triton.next_power_of_2(d)
    n_cap = block_table.shape[1] * view.block_size  # slots a table can name: no read of seq_lens
    # unread stand-ins when nothing is observed (pointer arguments must be tensors)
    logits = mid_lse if observe is None else torch.empty(batch, hq, n_cap, dtype=torch.float32, device=q.device)
    _decode_split_kernel[(batch, view.num_heads, num_splits)](
        q, kv_cache, block_table, seq_lens, start, mid_o, mid_lse, block_table if observe is None else observe,
        logits, scale, softcap or 1.0, num_splits, n_cap,
        q.stride(0), q.stride(1), view.stride_blk, view.stride_tok, view.stride_head,
        block_table.stride(0), start.stride(0), start.stride(1),
        GROUP=group,
        HEAD_DIM=d,
        BLOCK_D=block_d,
        BLOCK_H=max(16, triton.next_power_of_2(group)),
        BLOCK_N=32 if block_d <= 128 else 16,
        BLOCK_SIZE=view.block_size,
        DOT_F32=dot_f32(q.dtype),
        SOFTCAP=bool(softcap),
        OBSERVE=observe is not None,
    )
    # Pointer arguments must be tensors even when the token is off: q/lse stand in, unread.
    k_hat, v_hat, counts = comp if comp is not None else (q, q, lse)
    _decode_merge_kernel[(batch, hq)](
        q, mid_o, mid_lse, k_hat, v_hat, counts, lse if sinks is None else sinks, out, lse, scale, softcap or 1.0,
        num_splits,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        GROUP=group,
        HEAD_DIM=d,
        BLOCK_D=block_d,
        HAS_COMP=comp is not None,
        HAS_SINKS=sinks is not None,
        SOFTCAP=bool(softcap),
    )
    if observe is not None:
        _decode_observe_kernel[(batch, view.num_heads, num_splits)](
            observe, logits, mid_lse, seq_lens, start, num_splits, n_cap, start.stride(0), start.stride(1),
            GROUP=group,
            BLOCK_H=triton.next_power_of_2(group),
            BLOCK_N=64,
        )
