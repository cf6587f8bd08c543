"""``@triton.jit`` body of causal varlen attention over packed pages (prefill chunks, draft rows).

Sequence s owns query rows ``query_start[s]:query_start[s + 1]``, the last T of its ``lengths[s]``
cells, one KV head and G query heads. A program attends ROWS = BLOCK_M // G consecutive rows of
one sequence with all G heads, flattened into the M dimension (lane m is row m // G, head m % G),
so the heads share every key and value load. Programs are numbered as in vLLM's unified attention:
sequence s owns ``query_start[s] // ROWS + s`` onwards, so the grid is ``T_total // ROWS + S``
(host ints) and a binary search over ``query_start`` finds a program's sequence. Keys stream in
BLOCK_N tiles with an online softmax up to the causal limit of the program's last row; the
compensation token and the sinks merge at the end, as in the decode kernel, whose per-tile steps
(logits, online-softmax update, normalisation) this kernel shares.
"""

import triton
import triton.language as tl

from vllm_kvcomp.kernels.triton_jit._decode import (
    normalised_output,
    online_softmax_step,
    tile_logits,
)
from vllm_kvcomp.kernels.triton_jit._paged import soft_cap, token_offsets


@triton.jit
def _sequence_of(QueryStart, program, num_seqs, ROWS: tl.constexpr):
    """The last sequence s whose first program ``query_start[s] // ROWS + s`` is <= ``program``."""
    lo = tl.zeros([], tl.int32)
    hi = tl.zeros([], tl.int32) + num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first = tl.load(QueryStart + mid) // ROWS + mid
        if first <= program:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _program_rows(QueryStart, program, num_seqs, ROWS: tl.constexpr):
    """(seq, first_row, num_rows, row0): the program's sequence, the sequence's first query row
    in Q and its number of rows, and the program's first row within the sequence."""
    seq = _sequence_of(QueryStart, program, num_seqs, ROWS)
    first_row = tl.load(QueryStart + seq)
    num_rows = tl.load(QueryStart + seq + 1) - first_row
    row0 = (program - (first_row // ROWS + seq)) * ROWS
    return seq, first_row, num_rows, row0


@triton.jit
def _attend_visible_cells(
    q, KV, table_row, hi, live, row_limit, d, dmask, scale, softcap, stride_blk, stride_tok,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr, DOT_F32: tl.constexpr, SOFTCAP: tl.constexpr,
):
    """Online softmax of the lanes' queries q [M, D] over the sequence's cells ``[0, hi)`` (pages
    in ``table_row``), each lane seeing cells ``< row_limit``: returns (m, l_sum, acc)."""
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for n0 in tl.range(0, hi, BLOCK_N):
        tok = n0 + tl.arange(0, BLOCK_N)
        tmask = tok < hi
        off = token_offsets(table_row, tok, tmask, BLOCK_SIZE, stride_blk, stride_tok)
        kv_mask = tmask[:, None] & dmask[None, :]
        s = tile_logits(q, KV, off, d, kv_mask, scale, softcap, DOT_F32, SOFTCAP)
        visible = live[:, None] & tmask[None, :] & (tok[None, :] < row_limit[:, None])
        s = tl.where(visible, s, float("-inf"))
        m, l_sum, acc = online_softmax_step(
            m, l_sum, acc, s, KV, off, d, kv_mask, HEAD_DIM, DOT_F32
        )
    return m, l_sum, acc


@triton.jit
def _merge_compensation(
    m, l_sum, acc, q, KHat, VHat, CompCounts, seq, d, dmask, scale, softcap,
    HEAD_DIM: tl.constexpr, SOFTCAP: tl.constexpr,
):
    """Folds sequence seq's compensation token (weight N_d·exp(logit of k̂), value v̂; off when
    N_d is 0) into the running (m, l_sum, acc) of every lane; returns the new triple."""
    count = tl.load(CompCounts + seq)
    if count > 0.0:
        k_hat = tl.load(KHat + seq * HEAD_DIM + d, mask=dmask, other=0.0).to(tl.float32)
        v_hat = tl.load(VHat + seq * HEAD_DIM + d, mask=dmask, other=0.0).to(tl.float32)
        comp_logit = tl.sum(q.to(tl.float32) * k_hat[None, :], 1) * scale
        if SOFTCAP:
            comp_logit = soft_cap(comp_logit, softcap)
        comp_lse = comp_logit + tl.log(count)
        m_new = tl.maximum(m, comp_lse)
        alpha = tl.exp(m - m_new)
        w = tl.exp(comp_lse - m_new)
        acc = acc * alpha[:, None] + w[:, None] * v_hat[None, :]
        l_sum = l_sum * alpha + w
        m = m_new
    return m, l_sum, acc


@triton.jit
def _merge_sinks(m, l_sum, acc, Sinks, seq, head, live, GROUP: tl.constexpr):
    """Folds each lane's sink logit, a logit with a zero value (only the normaliser grows), into
    the running (m, l_sum, acc); returns the new triple."""
    sink = tl.load(Sinks + seq * GROUP + head, mask=live, other=0.0)
    m_new = tl.maximum(m, sink)
    alpha = tl.exp(m - m_new)
    acc = acc * alpha[:, None]
    l_sum = l_sum * alpha + tl.exp(sink - m_new)
    return m_new, l_sum, acc


@triton.jit
def _prefill_kernel(
    Q,  # [T_total, G, D]
    KV,  # [num_pages, block_size, 1, 2D] (strided)
    Tables,  # [S, W] int32
    Lengths,  # [S] int32
    QueryStart,  # [S + 1] int32
    KHat,  # [S, D] compensation key (read only if HAS_COMP)
    VHat,  # [S, D] compensation value
    CompCounts,  # [S] float32 N_d; 0 turns the token off
    Sinks,  # [S, G] float32 sink logits (read only if HAS_SINKS)
    Out,  # [T_total, G, D]
    Lse,  # [T_total, G] float32
    scale,
    softcap,
    num_seqs,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_blk,
    stride_tok,
    stride_table,
    GROUP: tl.constexpr,
    ROWS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    DOT_F32: tl.constexpr,
    HAS_COMP: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    program = tl.program_id(0)
    seq, first_row, num_rows, row0 = _program_rows(QueryStart, program, num_seqs, ROWS)
    if row0 >= num_rows:
        return
    length = tl.load(Lengths + seq)

    lane = tl.arange(0, BLOCK_M)
    row = row0 + lane // GROUP
    head = lane % GROUP
    live = (lane < ROWS * GROUP) & (row < num_rows)
    row_limit = length - num_rows + 1 + row  # bottom-right causal: cells [0, row_limit) are visible
    d = tl.arange(0, BLOCK_D)
    dmask = d < HEAD_DIM
    q_rows = (first_row + row).to(tl.int64)
    q = tl.load(
        Q + q_rows[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
        mask=live[:, None] & dmask[None, :],
        other=0.0,
    )

    # the last live row of the tile sees the most cells: key tiles past it are never loaded
    hi = length - num_rows + tl.minimum(row0 + ROWS, num_rows)
    table_row = Tables + seq.to(tl.int64) * stride_table
    m, l_sum, acc = _attend_visible_cells(
        q, KV, table_row, hi, live, row_limit, d, dmask, scale, softcap, stride_blk, stride_tok,
        BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_SIZE, HEAD_DIM, DOT_F32, SOFTCAP,
    )
    if HAS_COMP:
        m, l_sum, acc = _merge_compensation(
            m, l_sum, acc, q, KHat, VHat, CompCounts, seq, d, dmask, scale, softcap,
            HEAD_DIM, SOFTCAP,
        )
    if HAS_SINKS:
        m, l_sum, acc = _merge_sinks(m, l_sum, acc, Sinks, seq, head, live, GROUP)
    out, lse = normalised_output(acc, l_sum, m)
    tl.store(
        Out + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
        out.to(Out.dtype.element_ty),
        mask=live[:, None] & dmask[None, :],
    )
    tl.store(Lse + q_rows * GROUP + head, lse, mask=live)
