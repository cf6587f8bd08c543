"""``@triton.jit`` bodies of observation-window attention scores over paged KV (GQA).

Rows: the G·w queries of one KV head (row r = g·w + j: query head h_kv·G + g, window query j
at slot N - w + j). Pass 1 (per key chunk) keeps the online softmax state (max m, sum l and
t = Σ e^(s-m)·s); the combine step turns the chunks into each row's log-sum-exp and entropy
(H = lse - Σ p·s); pass 2 recomputes the logits per chunk and sums p = e^(s - lse) over rows.
"""

import triton
import triton.language as tl

from ._paged import qk_dot, token_offsets


@triton.jit
def _load_rows(
    Q,
    b,
    hk,
    stride_qb,
    stride_qw,
    stride_qh,
    W: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """The window queries of KV head hk as rows [BLOCK_M, BLOCK_D], their window index and mask."""
    r = tl.arange(0, BLOCK_M)
    rmask = r < GROUP * W
    j = r % W
    head = hk * GROUP + r // W
    d = tl.arange(0, BLOCK_D)
    q = tl.load(
        Q + b * stride_qb + j[:, None] * stride_qw + head[:, None] * stride_qh + d[None, :],
        mask=rmask[:, None] & (d[None, :] < HEAD_DIM),
        other=0.0,
    )
    return q, j, rmask


@triton.jit
def _chunk_logits(
    q,
    KV,
    bt_row,
    tok,
    tmask,
    hk,
    scale,
    stride_blk,
    stride_tok,
    stride_head,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    """Scaled logits [BLOCK_M, BLOCK_N] of the rows against tokens ``tok`` of head hk."""
    off = token_offsets(bt_row, tok, tmask, BLOCK_SIZE, stride_blk, stride_tok) + hk * stride_head
    d = tl.arange(0, BLOCK_D)
    k = tl.load(
        KV + off[:, None] + d[None, :], mask=tmask[:, None] & (d[None, :] < HEAD_DIM), other=0.0
    )
    return qk_dot(q, k, DOT_F32) * scale


@triton.jit
def _window_partial_kernel(
    Q,  # [B, w, H_q, D]
    KV,  # [num_blocks, block_size, H_kv, 2D] (strided)
    BlockTable,  # [B, max_blocks] int32
    SeqLens,  # [B] int32
    Start,  # [B, H_kv] int32
    Part,  # [3, B, H_kv, num_chunks, BLOCK_M] float32: m, l, t per chunk
    scale,
    stride_qb,
    stride_qw,
    stride_qh,
    stride_blk,
    stride_tok,
    stride_head,
    stride_bt,
    stride_st_b,
    stride_st_h,
    W: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    chunk = tl.program_id(0)
    hk = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    q, j, rmask = _load_rows(
        Q, b, hk, stride_qb, stride_qw, stride_qh, W, GROUP, HEAD_DIM, BLOCK_M, BLOCK_D
    )
    n = tl.load(SeqLens + b)
    qpos = n - W + j
    lo = tl.maximum(chunk * CHUNK, tl.load(Start + b * stride_st_b + hk * stride_st_h))
    hi = tl.minimum((chunk + 1) * CHUNK, n)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_sum = tl.zeros([BLOCK_M], tl.float32)
    t_sum = tl.zeros([BLOCK_M], tl.float32)
    bt_row = BlockTable + b * stride_bt
    for n0 in tl.range(lo, hi, BLOCK_N):
        tok = n0 + tl.arange(0, BLOCK_N)
        tmask = tok < hi
        s = _chunk_logits(
            q,
            KV,
            bt_row,
            tok,
            tmask,
            hk,
            scale,
            stride_blk,
            stride_tok,
            stride_head,
            HEAD_DIM,
            BLOCK_D,
            BLOCK_SIZE,
            DOT_F32,
        )
        visible = rmask[:, None] & tmask[None, :] & (tok[None, :] <= qpos[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_sum = l_sum * alpha + tl.sum(p, 1)
        t_sum = t_sum * alpha + tl.sum(p * tl.where(visible, s, 0.0), 1)
        m = m_new
    num_chunks = tl.num_programs(0)
    base = ((b * tl.num_programs(1) + hk) * num_chunks + chunk) * BLOCK_M + tl.arange(0, BLOCK_M)
    plane = tl.num_programs(2) * tl.num_programs(1) * num_chunks * BLOCK_M
    tl.store(Part + base, m)
    tl.store(Part + plane + base, l_sum)
    tl.store(Part + 2 * plane + base, t_sum)


@triton.jit
def _window_combine_kernel(
    Part,  # [3, B, H_kv, num_chunks, BLOCK_M] float32
    Lse,  # [B, H_kv, BLOCK_M] float32
    Entropy,  # [B, H_q, w] float32 == [B, H_kv, G·w]
    num_chunks,
    ROWS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    HAS_ENTROPY: tl.constexpr,
):
    hk = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    r = tl.arange(0, BLOCK_M)
    head_row = b * tl.num_programs(0) + hk
    plane = tl.num_programs(1) * tl.num_programs(0) * num_chunks * BLOCK_M
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_sum = tl.zeros([BLOCK_M], tl.float32)
    t_sum = tl.zeros([BLOCK_M], tl.float32)
    for c in range(0, num_chunks):
        base = (head_row * num_chunks + c) * BLOCK_M + r
        m_c = tl.load(Part + base)
        m_new = tl.maximum(m, m_c)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - m_safe)
        beta = tl.exp(m_c - m_safe)
        l_sum = l_sum * alpha + tl.load(Part + plane + base) * beta
        t_sum = t_sum * alpha + tl.load(Part + 2 * plane + base) * beta
        m = m_new
    empty = l_sum == 0.0
    safe_l = tl.where(empty, 1.0, l_sum)
    lse = tl.where(empty, float("-inf"), m + tl.log(safe_l))
    tl.store(Lse + head_row * BLOCK_M + r, lse)
    if HAS_ENTROPY:
        ent = tl.where(empty, 0.0, lse - t_sum / safe_l)
        tl.store(Entropy + head_row * ROWS + r, ent, mask=r < ROWS)


@triton.jit
def _window_scores_kernel(
    Q,  # [B, w, H_q, D]
    KV,  # [num_blocks, block_size, H_kv, 2D] (strided)
    BlockTable,  # [B, max_blocks] int32
    SeqLens,  # [B] int32
    Start,  # [B, H_kv] int32
    Lse,  # [B, H_kv, BLOCK_M] float32
    Scores,  # [B, H_kv, N_max] float32
    scale,
    n_max,
    stride_qb,
    stride_qw,
    stride_qh,
    stride_blk,
    stride_tok,
    stride_head,
    stride_bt,
    stride_st_b,
    stride_st_h,
    W: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    chunk = tl.program_id(0)
    hk = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    q, j, rmask = _load_rows(
        Q, b, hk, stride_qb, stride_qw, stride_qh, W, GROUP, HEAD_DIM, BLOCK_M, BLOCK_D
    )
    n = tl.load(SeqLens + b)
    start = tl.load(Start + b * stride_st_b + hk * stride_st_h)
    qpos = n - W + j
    head_row = b * tl.num_programs(1) + hk
    lse = tl.load(Lse + head_row * BLOCK_M + tl.arange(0, BLOCK_M))
    live = rmask & (lse > float("-inf"))
    bt_row = BlockTable + b * stride_bt
    hi = tl.minimum((chunk + 1) * CHUNK, n)
    for n0 in tl.range(chunk * CHUNK, hi, BLOCK_N):
        tok = n0 + tl.arange(0, BLOCK_N)
        valid = (tok < hi) & (tok >= start)
        s = _chunk_logits(
            q,
            KV,
            bt_row,
            tok,
            valid,
            hk,
            scale,
            stride_blk,
            stride_tok,
            stride_head,
            HEAD_DIM,
            BLOCK_D,
            BLOCK_SIZE,
            DOT_F32,
        )
        visible = live[:, None] & valid[None, :] & (tok[None, :] <= qpos[:, None])
        p = tl.where(visible, tl.exp(s - tl.where(live, lse, 0.0)[:, None]), 0.0)
        tl.store(Scores + head_row * n_max + tok, tl.sum(p, 0), mask=tok < hi)
