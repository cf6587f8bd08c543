"""``@triton.jit`` bodies of paged decode attention with per-(request, KV head) valid ranges.

Stage 1 (flash-decoding): program (b, h_kv, split) attends the G query heads of KV head h_kv
to one split of the head's valid slots ``[start, seq_len)`` and stores a normalised partial
output and its log-sum-exp. Stage 2 merges the splits, the compensation token and the sinks.
Soft-capping (``SOFTCAP``) caps every logit, the compensation token's too. With ``OBSERVE``
stage 1 also stores the logits of the observed heads, and stage 3 (``_decode_observe_kernel``)
turns them into each cell's softmax weight among its head's cells alone, once every split's
log-sum-exp is known, and adds it to the head's observed row (what H2O accumulates).
The prefill kernel shares the per-tile steps: ``tile_logits``, ``online_softmax_step`` and
``normalised_output``.
"""

import triton
import triton.language as tl

from vllm_kvcomp.kernels.triton_jit._paged import pv_dot, qk_dot, soft_cap, token_offsets


@triton.jit
def _split_range(SeqLens, Start, b, hk, split, num_splits, stride_st_b, stride_st_h):
    """Slots ``[lo, hi)`` of key split ``split`` of the valid slots ``[start, seq_len)`` of
    request b, KV head hk: ``num_splits`` equal parts (the last ones may be short or empty)."""
    seq_len = tl.load(SeqLens + b)
    start = tl.load(Start + b * stride_st_b + hk * stride_st_h)
    per_split = tl.cdiv(tl.maximum(seq_len - start, 0), num_splits)
    lo = start + split * per_split
    hi = tl.minimum(lo + per_split, seq_len)
    return lo, hi


@triton.jit
def tile_logits(
    q, KV, off, d, kv_mask, scale, softcap, DOT_F32: tl.constexpr, SOFTCAP: tl.constexpr
):
    """Logits [M, N] of queries q [M, D] against the keys of the cells at element offsets
    ``off`` [N] of KV (each cell: key then value): scaled, and soft-capped if ``SOFTCAP``."""
    k = tl.load(KV + off[:, None] + d[None, :], mask=kv_mask, other=0.0)
    s = qk_dot(q, k, DOT_F32) * scale
    if SOFTCAP:
        s = soft_cap(s, softcap)
    return s


@triton.jit
def online_softmax_step(
    m, l_sum, acc, s, KV, off, d, kv_mask, HEAD_DIM: tl.constexpr, DOT_F32: tl.constexpr
):
    """Folds a tile of logits s [M, N] (-inf where hidden) and the values of its cells (at
    offsets ``off`` [N], after the keys) into the running max m [M], normaliser l_sum [M] and
    unnormalised output acc [M, D]; returns the new (m, l_sum, acc)."""
    m_new = tl.maximum(m, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m - m_safe)
    p = tl.exp(s - m_safe[:, None])
    v = tl.load(KV + off[:, None] + HEAD_DIM + d[None, :], mask=kv_mask, other=0.0)
    acc = acc * alpha[:, None] + pv_dot(p, v, DOT_F32)
    l_sum = l_sum * alpha + tl.sum(p, 1)
    return m_new, l_sum, acc


@triton.jit
def normalised_output(acc, l_sum, m):
    """(out [M, D], lse [M]) of an online softmax: 0 and -inf for rows that attended nothing."""
    empty = l_sum == 0.0
    out = acc / tl.where(empty, 1.0, l_sum)[:, None]
    lse = tl.where(empty, float("-inf"), m + tl.log(tl.where(empty, 1.0, l_sum)))
    return out, lse


@triton.jit
def _decode_split_kernel(
    Q,  # [B, H_q, D]
    KV,  # [num_blocks, block_size, H_kv, 2D] (strided)
    BlockTable,  # [B, max_blocks] int32
    SeqLens,  # [B] int32
    Start,  # [B, H_kv] int32 (may be a stride-0 view)
    MidO,  # [B, H_q, S, D] float32
    MidLse,  # [B, H_q, S] float32
    Observe,  # [B, H_kv] int64 observed-row addresses, 0 = none (read only if OBSERVE)
    Logits,  # [B, H_q, n_cap] float32, the observed heads' logits by slot (written only if OBSERVE)
    scale,
    softcap,
    num_splits,
    n_cap,
    stride_qb,
    stride_qh,
    stride_blk,
    stride_tok,
    stride_head,
    stride_bt,
    stride_st_b,
    stride_st_h,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    DOT_F32: tl.constexpr,
    SOFTCAP: tl.constexpr,
    OBSERVE: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    hk = tl.program_id(1)
    split = tl.program_id(2)
    g = tl.arange(0, BLOCK_H)
    hmask = g < GROUP
    heads = hk * GROUP + g
    d = tl.arange(0, BLOCK_D)
    dmask = d < HEAD_DIM
    q = tl.load(
        Q + b * stride_qb + heads[:, None] * stride_qh + d[None, :],
        mask=hmask[:, None] & dmask[None, :],
        other=0.0,
    )

    lo, hi = _split_range(SeqLens, Start, b, hk, split, num_splits, stride_st_b, stride_st_h)

    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_sum = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    bt_row = BlockTable + b * stride_bt
    if OBSERVE:
        observed = tl.load(Observe + b * tl.num_programs(1) + hk) != 0
        logit_rows = Logits + (b * tl.num_programs(1) * GROUP + heads) * n_cap
    for n0 in tl.range(lo, hi, BLOCK_N):
        tok = n0 + tl.arange(0, BLOCK_N)
        tmask = tok < hi
        off = (
            token_offsets(bt_row, tok, tmask, BLOCK_SIZE, stride_blk, stride_tok) + hk * stride_head
        )
        kv_mask = tmask[:, None] & dmask[None, :]
        s = tile_logits(q, KV, off, d, kv_mask, scale, softcap, DOT_F32, SOFTCAP)
        if OBSERVE:  # noqa: SIM102  (compile time: ``observed`` exists only when observing)
            if observed:
                tl.store(
                    logit_rows[:, None] + tok[None, :], s, mask=hmask[:, None] & tmask[None, :]
                )
        s = tl.where(hmask[:, None] & tmask[None, :], s, float("-inf"))
        m, l_sum, acc = online_softmax_step(
            m, l_sum, acc, s, KV, off, d, kv_mask, HEAD_DIM, DOT_F32
        )

    out, lse = normalised_output(acc, l_sum, m)
    row = (b * tl.num_programs(1) * GROUP + heads) * num_splits + split
    tl.store(MidO + row[:, None] * HEAD_DIM + d[None, :], out, mask=hmask[:, None] & dmask[None, :])
    tl.store(MidLse + row, lse, mask=hmask)


@triton.jit
def _decode_merge_kernel(
    Q,  # [B, H_q, D]
    MidO,  # [B, H_q, S, D] float32
    MidLse,  # [B, H_q, S] float32
    KHat,  # [B, H_kv, D] compensation key (read only if HAS_COMP)
    VHat,  # [B, H_kv, D] compensation value
    CompCounts,  # [B, H_kv] float32 N_d; 0 turns the token off
    Sinks,  # [B, H_q] float32 sink logits (read only if HAS_SINKS)
    Out,  # [B, H_q, D]
    Lse,  # [B, H_q] float32
    scale,
    softcap,
    num_splits,
    stride_qb,
    stride_qh,
    stride_ob,
    stride_oh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_COMP: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    hq = tl.program_id(1)
    num_q_heads = tl.num_programs(1)
    d = tl.arange(0, BLOCK_D)
    dmask = d < HEAD_DIM
    row = b * num_q_heads + hq

    m = tl.full([], float("-inf"), tl.float32)
    l_sum = tl.zeros([], tl.float32)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for s in range(0, num_splits):
        part_lse = tl.load(MidLse + row * num_splits + s)
        if part_lse > float("-inf"):
            part = tl.load(MidO + (row * num_splits + s) * HEAD_DIM + d, mask=dmask, other=0.0)
            m_new = tl.maximum(m, part_lse)
            alpha = tl.exp(m - m_new)
            w = tl.exp(part_lse - m_new)
            acc = acc * alpha + w * part
            l_sum = l_sum * alpha + w
            m = m_new
    if HAS_COMP:
        hk = hq // GROUP
        kv_row = b * (num_q_heads // GROUP) + hk
        count = tl.load(CompCounts + kv_row)
        if count > 0.0:
            q = tl.load(Q + b * stride_qb + hq * stride_qh + d, mask=dmask, other=0.0).to(
                tl.float32
            )
            k_hat = tl.load(KHat + kv_row * HEAD_DIM + d, mask=dmask, other=0.0).to(tl.float32)
            v_hat = tl.load(VHat + kv_row * HEAD_DIM + d, mask=dmask, other=0.0).to(tl.float32)
            comp_logit = tl.sum(q * k_hat, 0) * scale
            if SOFTCAP:
                comp_logit = soft_cap(comp_logit, softcap)
            comp_lse = comp_logit + tl.log(count)
            m_new = tl.maximum(m, comp_lse)
            alpha = tl.exp(m - m_new)
            w = tl.exp(comp_lse - m_new)
            acc = acc * alpha + w * v_hat
            l_sum = l_sum * alpha + w
            m = m_new
    if HAS_SINKS:  # a logit with a zero value: only the normaliser grows
        sink = tl.load(Sinks + row)
        m_new = tl.maximum(m, sink)
        alpha = tl.exp(m - m_new)
        acc = acc * alpha
        l_sum = l_sum * alpha + tl.exp(sink - m_new)
        m = m_new
    empty = l_sum == 0.0
    out = acc / tl.where(empty, 1.0, l_sum)
    lse = tl.where(empty, float("-inf"), m + tl.log(tl.where(empty, 1.0, l_sum)))
    tl.store(Out + b * stride_ob + hq * stride_oh + d, out.to(Out.dtype.element_ty), mask=dmask)
    tl.store(Lse + row, lse)


@triton.jit
def _decode_observe_kernel(
    Observe,  # [B, H_kv] int64 addresses of float32 rows, 0 = none
    Logits,  # [B, H_q, n_cap] float32 from stage 1
    MidLse,  # [B, H_q, S] float32 from stage 1: each split's LSE over its cells
    SeqLens,  # [B] int32
    Start,  # [B, H_kv] int32 (may be a stride-0 view)
    num_splits,
    n_cap,
    stride_st_b,
    stride_st_h,
    GROUP: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Program (b, h_kv, split) adds to row ``Observe[b, h_kv]`` at each slot of the split the mean
    over the G query heads of exp(logit - lse_cells), lse_cells the head's LSE over its cells."""
    b = tl.program_id(0).to(tl.int64)
    hk = tl.program_id(1)
    split = tl.program_id(2)
    address = tl.load(Observe + b * tl.num_programs(1) + hk)
    if address != 0:
        g = tl.arange(0, BLOCK_H)
        hmask = g < GROUP
        heads = b * tl.num_programs(1) * GROUP + hk * GROUP + g
        m = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l_sum = tl.zeros([BLOCK_H], tl.float32)
        for s in range(0, num_splits):  # the splits' LSEs merged: the cells' own normaliser
            part = tl.load(MidLse + heads * num_splits + s, mask=hmask, other=float("-inf"))
            m_new = tl.maximum(m, part)
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            l_sum = l_sum * tl.exp(m - m_safe) + tl.exp(part - m_safe)
            m = m_new
        # a head with no cell has no logit to normalise (any finite value does)
        lse = tl.where(l_sum > 0.0, m + tl.log(tl.where(l_sum > 0.0, l_sum, 1.0)), 0.0)

        lo, hi = _split_range(SeqLens, Start, b, hk, split, num_splits, stride_st_b, stride_st_h)
        row = address.to(tl.pointer_type(tl.float32), bitcast=True)
        for n0 in tl.range(lo, hi, BLOCK_N):
            tok = n0 + tl.arange(0, BLOCK_N)
            tmask = tok < hi
            logits = tl.load(
                Logits + heads[:, None] * n_cap + tok[None, :],
                mask=hmask[:, None] & tmask[None, :],
                other=float("-inf"),
            )
            weight = tl.sum(tl.exp(logits - lse[:, None]), 0) / GROUP
            tl.store(row + tok, tl.load(row + tok, mask=tmask, other=0.0) + weight, mask=tmask)
