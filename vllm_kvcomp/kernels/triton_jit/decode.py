"""Launcher of paged decode attention with per-(request, KV head) valid ranges and LSE output."""

from __future__ import annotations

import torch
import triton

from vllm_kvcomp.kernels.triton_jit._decode import _decode_merge_kernel, _decode_split_kernel
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
                float(softcap), sinks)
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
) -> None:
    """Stage 1 (one program per request, KV head and key split) then stage 2 (the merge)."""
    batch, hq, d = q.shape
    group = hq // view.num_heads
    mid_o = torch.empty(batch, hq, num_splits, d, dtype=torch.float32, device=q.device)
    mid_lse = torch.empty(batch, hq, num_splits, dtype=torch.float32, device=q.device)
    block_d = triton.next_power_of_2(d)
    _decode_split_kernel[(batch, view.num_heads, num_splits)](
        q, kv_cache, block_table, seq_lens, start, mid_o, mid_lse, scale, softcap or 1.0, num_splits,
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
