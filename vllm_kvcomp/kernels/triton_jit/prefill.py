"""Launcher of causal varlen attention over packed pages: every query row of every sequence in
one launch (prefill chunks and draft rows of compressed requests)."""

from __future__ import annotations

import torch
import triton

from vllm_kvcomp.kernels.triton_jit._prefill import _prefill_kernel
from vllm_kvcomp.kernels.triton_jit.utils import CacheView, check_int_table, check_query, dot_f32


def prefill_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    tables: torch.Tensor,
    lengths: torch.Tensor,
    query_start: torch.Tensor,
    k_hat: torch.Tensor | None = None,
    v_hat: torch.Tensor | None = None,
    comp_counts: torch.Tensor | None = None,
    scale: float | None = None,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
    max_rows: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of S sequences of one KV head and G query heads each, one launch.

    q [T_total, G, D]: sequence s owns rows ``query_start[s]:query_start[s + 1]`` ([S + 1] int32),
    the last T of its ``lengths[s]`` ([S] int32) cells, whose pages are ``tables[s]`` ([S, W]
    int32) in kv_cache [num_pages, block_size, 1, 2D]; row t of T sees cells
    ``< lengths[s] - (T - 1 - t)``. Compensation: k_hat/v_hat [S, D], comp_counts [S] float32 N_d
    (0 = off) add a token of weight N_d·exp(scale·q·k̂) and value v̂. ``softcap`` caps every
    logit, the token's too (0 = off); ``sinks`` [S, G] are sink logits with a zero value.
    ``max_rows`` (a host int, default T_total): the most rows of one sequence; it sizes the tile
    only (any value gives the same result). Returns out [T_total, G, D] (q's dtype) and lse
    [T_total, G] float32 (natural log, -inf where nothing is attended). Reads nothing back to the
    host: the grid comes from shapes (CUDA-graph safe for fixed shapes and ``max_rows``).
    """
    view = CacheView.of(kv_cache)
    total, group, d = q.shape
    num_seqs = tables.shape[0]
    check_query(q, view, kv_cache)
    if view.num_heads != 1:
        raise ValueError(f"kv_cache must hold one KV head per sequence ([num_pages, bs, 1, 2D]), got {view.num_heads}")
    check_int_table("tables", tables, 2)
    check_int_table("lengths", lengths, 1)
    check_int_table("query_start", query_start, 1)
    if lengths.shape[0] != num_seqs or query_start.shape[0] != num_seqs + 1:
        raise ValueError(
            f"{num_seqs} sequences need lengths [{num_seqs}] and query_start [{num_seqs + 1}], "
            f"got {tuple(lengths.shape)} and {tuple(query_start.shape)}"
        )
    if tables.stride(1) != 1 or lengths.stride(0) != 1 or query_start.stride(0) != 1:
        raise ValueError("tables rows, lengths and query_start must be contiguous")
    comp = _check_compensation(k_hat, v_hat, comp_counts, num_seqs, d)
    if sinks is not None:
        if tuple(sinks.shape) != (num_seqs, group):
            raise ValueError(f"sinks must be [S, G] = [{num_seqs}, {group}], got {tuple(sinks.shape)}")
        sinks = sinks.to(torch.float32).contiguous()
    if max_rows is None:
        max_rows = total
    elif max_rows < 1:
        raise ValueError(f"max_rows must be >= 1 (the most query rows of one sequence), got {max_rows}")
    scale = d**-0.5 if scale is None else scale
    out = torch.empty(total, group, d, dtype=q.dtype, device=q.device)
    lse = torch.empty(total, group, dtype=torch.float32, device=q.device)
    if total and num_seqs:
        _launch(q, kv_cache, view, tables, lengths, query_start, comp, sinks, scale, float(softcap),
                max_rows, out, lse)
    return out, lse


def _check_compensation(
    k_hat: torch.Tensor | None, v_hat: torch.Tensor | None, counts: torch.Tensor | None, num_seqs: int, d: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(k_hat, v_hat [S, D] contiguous, counts [S] float32) or None when off."""
    if counts is None:
        return None
    if k_hat is None or v_hat is None or tuple(k_hat.shape) != (num_seqs, d) or tuple(v_hat.shape) != (num_seqs, d):
        raise ValueError(f"compensation needs k_hat and v_hat of shape [S, D] = [{num_seqs}, {d}]")
    if tuple(counts.shape) != (num_seqs,):
        raise ValueError(f"comp_counts must be [S] = [{num_seqs}], got {tuple(counts.shape)}")
    return k_hat.contiguous(), v_hat.contiguous(), counts.to(torch.float32).contiguous()


def _launch(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    view: CacheView,
    tables: torch.Tensor,
    lengths: torch.Tensor,
    query_start: torch.Tensor,
    comp: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
    sinks: torch.Tensor | None,
    scale: float,
    softcap: float,
    max_rows: int,
    out: torch.Tensor,
    lse: torch.Tensor,
) -> None:
    """One program per ROWS query rows (x G heads) of a sequence: ``T_total // ROWS + S`` programs."""
    total, group, d = q.shape
    num_seqs = tables.shape[0]
    # lanes = rows x heads: up to 64, fewer when no sequence has that many rows (draft rows, T = 1)
    block_m = max(16, triton.next_power_of_2(group), min(64, triton.next_power_of_2(max_rows * group)))
    rows = block_m // group
    block_d = triton.next_power_of_2(d)
    # Pointer arguments must be tensors even when the token or the sinks are off: q/lse stand in, unread.
    k_hat, v_hat, counts = comp if comp is not None else (q, q, lse)
    _prefill_kernel[(total // rows + num_seqs,)](
        q, kv_cache, tables, lengths, query_start, k_hat, v_hat, counts, lse if sinks is None else sinks,
        out, lse, scale, softcap or 1.0, num_seqs,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), view.stride_blk, view.stride_tok, tables.stride(0),
        GROUP=group,
        ROWS=rows,
        HEAD_DIM=d,
        BLOCK_M=block_m,
        BLOCK_N=32 if block_d <= 128 else 16,
        BLOCK_D=block_d,
        BLOCK_SIZE=view.block_size,
        DOT_F32=dot_f32(q.dtype),
        HAS_COMP=comp is not None,
        HAS_SINKS=sinks is not None,
        SOFTCAP=bool(softcap),
    )
