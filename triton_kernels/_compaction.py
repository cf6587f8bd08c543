"""``@triton.jit`` body of per-head compaction (gather kept cells, or scatter them right-aligned)."""

import triton
import triton.language as tl

from ._paged import token_offsets


@triton.jit
def _compact_kernel(
    KV,  # [num_blocks, block_size, H_kv, CELL] cache (strided)
    BlockTable,  # [B, max_blocks] int32
    SeqLens,  # [B] int32, N per request
    Kept,  # [B, H_kv, K_max] int32, sorted kept slots per head
    Counts,  # [B, H_kv] int32, kept count per head
    Work,  # [B, H_kv, K_max, CELL] temporary, contiguous
    stride_blk,
    stride_tok,
    stride_head,
    stride_bt,
    stride_kept_b,
    stride_kept_h,
    stride_cnt_b,
    stride_cnt_h,
    k_max,
    CELL: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    GATHER: tl.constexpr,
):
    """Program (tile, h, b): kept entries j of head h. GATHER: cache[kept[j]] -> work[j];
    else work[j] -> cache[N - count + j]. Cells already in place are skipped by both passes."""
    tile = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    n = tl.load(SeqLens + b)
    count = tl.load(Counts + b * stride_cnt_b + h * stride_cnt_h)
    j = tile * BLOCK_T + tl.arange(0, BLOCK_T)
    in_range = j < count
    src = tl.load(Kept + b * stride_kept_b + h * stride_kept_h + j, mask=in_range, other=0)
    dst = n - count + j
    move = in_range & (src != dst)

    c = tl.arange(0, BLOCK_C)
    cmask = move[:, None] & (c[None, :] < CELL)
    work = (
        Work + ((b * tl.num_programs(1) + h) * k_max + j[:, None]).to(tl.int64) * CELL + c[None, :]
    )
    bt_row = BlockTable + b * stride_bt
    if GATHER:
        off = token_offsets(bt_row, src, move, BLOCK_SIZE, stride_blk, stride_tok) + h * stride_head
        tl.store(work, tl.load(KV + off[:, None] + c[None, :], mask=cmask), mask=cmask)
    else:
        off = token_offsets(bt_row, dst, move, BLOCK_SIZE, stride_blk, stride_tok) + h * stride_head
        tl.store(KV + off[:, None] + c[None, :], tl.load(work, mask=cmask), mask=cmask)
