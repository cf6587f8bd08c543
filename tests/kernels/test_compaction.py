"""Per-head compaction (gather kept slots, write them right-aligned) vs the PyTorch reference."""

from __future__ import annotations

import pytest
import torch
from vllm_kvcomp.triton_kernels.compaction import compact_heads

from tests.helpers.kernel_refs import make_paged, random_selection, random_starts, ref_compact
from tests.kernels.cases import DEVICE, Case, cases

SEQ_LENS = [150, 1, 77, 40]
KV_HEADS = 3


def _assert_same(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual.cpu(), expected, atol=0, rtol=0, equal_nan=True)


@pytest.mark.parametrize("case", cases())
def test_compaction_matches_reference(case: Case) -> None:
    """Random sorted selections from ragged (or full) ranges: every kept cell moves right, and
    sources overlap other heads' and tokens' destinations."""
    paged = make_paged(
        SEQ_LENS, KV_HEADS, case.head_dim, case.block_size, case.dtype, DEVICE, case.layout
    )
    starts = (
        random_starts(SEQ_LENS, KV_HEADS, min_len=0)
        if case.ragged
        else torch.zeros(len(SEQ_LENS), KV_HEADS, dtype=torch.int32)
    )
    kept, counts = random_selection(SEQ_LENS, starts, keep=0.4)
    want = ref_compact(paged.cpu(), kept, counts)
    compact_heads(
        paged.cache, paged.block_table, paged.seq_lens, kept.to(DEVICE), counts.to(DEVICE)
    )
    _assert_same(paged.cache, want)


def test_overlapping_chain() -> None:
    """N=10, kept [0, 7, 9]: slot 7 is both a source (j=1 -> 8) and a destination (j=0 <- 0)."""
    paged = make_paged([10], 1, 64, 16, torch.float32, DEVICE)
    before = paged.cpu().cells(0)[0]
    kept = torch.tensor([[[0, 7, 9]]], dtype=torch.int32)
    counts = torch.tensor([[3]], dtype=torch.int32)
    compact_heads(
        paged.cache, paged.block_table, paged.seq_lens, kept.to(DEVICE), counts.to(DEVICE)
    )
    after = paged.cpu().cells(0)[0]
    _assert_same(after[7:], before[[0, 7, 9]])
    _assert_same(after[:7], before[:7])


@pytest.mark.parametrize("dtype", [torch.uint8, torch.float16])
def test_dense_shift_every_cell_overlaps(dtype: torch.dtype) -> None:
    """Drop only the last slot: every cell shifts right by one, so each destination is the next
    cell's source, across block boundaries. Byte caches (fp8 storage) move bit-exactly too."""
    n, heads = 70, 2
    paged = make_paged([n], heads, 64, 16, torch.float32, DEVICE, "HNC")
    if dtype == torch.uint8:
        paged.cache = torch.randint(0, 256, paged.cache.shape, dtype=torch.uint8).to(DEVICE)
    else:
        paged.cache = paged.cache.to(dtype)
    before = paged.cpu().cells(0)
    kept = torch.arange(0, n - 1, dtype=torch.int32).expand(1, heads, -1).contiguous()
    counts = torch.full((1, heads), n - 1, dtype=torch.int32)
    compact_heads(
        paged.cache, paged.block_table, paged.seq_lens, kept.to(DEVICE), counts.to(DEVICE)
    )
    after = paged.cpu().cells(0)
    _assert_same(after[:, 1:], before[:, :-1])
    _assert_same(after[:, 0], before[:, 0])  # left of the new range: stale, untouched


def test_noop_and_empty_heads_leave_cache_untouched() -> None:
    paged = make_paged([33, 20], 2, 64, 16, torch.bfloat16, DEVICE)
    before = paged.cache.clone()
    kept = torch.zeros(2, 2, 33, dtype=torch.int32)
    kept[0, 0] = torch.arange(33)  # keeps everything: already in place
    counts = torch.tensor([[33, 0], [0, 0]], dtype=torch.int32)
    compact_heads(
        paged.cache, paged.block_table, paged.seq_lens, kept.to(DEVICE), counts.to(DEVICE)
    )
    _assert_same(paged.cache, before.cpu())
