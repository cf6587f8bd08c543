"""``@triton.jit`` body of LagKV scoring (000_… eq. 5–9) over paged KV.

Program (p, h, b) scores partition p of head h: slots ``start + p·L + [0, L)`` against the
reference ``start + (p+1)·L + [0, L)``. Channels go in chunks of BLOCK_D: per chunk the
reference's per-channel min/max, then the partition's normalised values, merged into each
token's channel mean/M2 (Chan's parallel variance), so a whole partition stays in registers
as [BLOCK_L, BLOCK_D] tiles only.
"""

import triton
import triton.language as tl

from ._paged import token_offsets


@triton.jit
def _normalised_std(
    KV,
    part_off,
    ref_off,
    tmask,
    channel0,
    eps,
    LAG: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_D: tl.constexpr,
    UNBIASED: tl.constexpr,
):
    """Per-token std [BLOCK_L] over channels ``channel0 + [0, HEAD_DIM)`` of the normalised part."""
    mean = tl.zeros([BLOCK_L], tl.float32)
    m2 = tl.zeros([BLOCK_L], tl.float32)
    n_a = tl.zeros([], tl.float32)
    for c0 in range(0, HEAD_DIM, BLOCK_D):
        c = c0 + tl.arange(0, BLOCK_D)
        cmask = c < HEAD_DIM
        mask = tmask[:, None] & cmask[None, :]
        ref = tl.load(KV + ref_off[:, None] + channel0 + c[None, :], mask=mask, other=0.0).to(
            tl.float32
        )
        low = tl.min(tl.where(mask, ref, float("inf")), 0)
        high = tl.max(tl.where(mask, ref, float("-inf")), 0)
        span = tl.maximum(tl.where(cmask, high - low, 1.0), eps)
        x = tl.load(KV + part_off[:, None] + channel0 + c[None, :], mask=mask, other=0.0).to(
            tl.float32
        )
        x = tl.where(mask, (x - low[None, :]) / span[None, :], 0.0)
        n_c = tl.sum(cmask.to(tl.float32), 0)
        mean_c = tl.sum(x, 1) / n_c
        dev = tl.where(mask, x - mean_c[:, None], 0.0)
        m2_c = tl.sum(dev * dev, 1)
        delta = mean_c - mean
        mean = mean + delta * (n_c / (n_a + n_c))
        m2 = m2 + m2_c + delta * delta * (n_a * n_c / (n_a + n_c))
        n_a += n_c
    if UNBIASED:
        return tl.sqrt(m2 / (HEAD_DIM - 1))
    return tl.sqrt(m2 / HEAD_DIM)


@triton.jit
def _softmax(x, mask):
    x = tl.where(mask, x, float("-inf"))
    e = tl.exp(x - tl.max(x, 0))
    return e / tl.sum(e, 0)


@triton.jit
def _lagkv_kernel(
    KV,  # [num_blocks, block_size, H_kv, 2D] (strided)
    BlockTable,  # [B, max_blocks] int32
    SeqLens,  # [B] int32; a partition is scored only if its reference ends by N
    Start,  # [B, H_kv] int32, first slot of partition 0
    NumParts,  # [B] int32, scored partitions (each followed by a full reference)
    Scores,  # [B, H_kv, P_max, LAG] float32
    eps,
    stride_blk,
    stride_tok,
    stride_head,
    stride_bt,
    stride_st_b,
    stride_st_h,
    LAG: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    UNBIASED: tl.constexpr,
):
    p = tl.program_id(0)
    hk = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    first = tl.load(Start + b * stride_st_b + hk * stride_st_h) + p * LAG
    if (p < tl.load(NumParts + b)) & (first + 2 * LAG <= tl.load(SeqLens + b)):
        i = tl.arange(0, BLOCK_L)
        tmask = i < LAG
        tok = first + i
        bt_row = BlockTable + b * stride_bt
        head = hk * stride_head
        part_off = token_offsets(bt_row, tok, tmask, BLOCK_SIZE, stride_blk, stride_tok) + head
        ref_off = token_offsets(bt_row, tok + LAG, tmask, BLOCK_SIZE, stride_blk, stride_tok) + head
        std_k = _normalised_std(
            KV, part_off, ref_off, tmask, 0, eps, LAG, HEAD_DIM, BLOCK_L, BLOCK_D, UNBIASED
        )
        std_v = _normalised_std(
            KV, part_off, ref_off, tmask, HEAD_DIM, eps, LAG, HEAD_DIM, BLOCK_L, BLOCK_D, UNBIASED
        )
        score = _softmax(std_k, tmask) + _softmax(std_v, tmask)
        row = (b * tl.num_programs(1) + hk) * tl.num_programs(0) + p
        tl.store(Scores + row * LAG + i, score, mask=tmask)
