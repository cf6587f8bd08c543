"""LagKV partition scoring over paged KV vs the policy's ``lagkv_scores``."""

from __future__ import annotations

import pytest
import torch
from vllm_kvcomp.triton_kernels.lagkv import lagkv_scores

from tests.helpers.kernel_refs import assert_close_to_ref, lagkv_partition, make_paged, ref_lagkv
from tests.kernels.cases import DEVICE, Case, cases
from vllm_kvcomp.policies.lagkv import RANGE_EPS
from vllm_kvcomp.policies.lagkv import lagkv_scores as policy_lagkv_scores

KV_HEADS = 2


def _setup(case: Case, lag: int):
    """Requests with 3, 0 and 1 scored partitions; ragged per-head starts when the case says so."""
    parts = [3, 0, 1]
    starts = torch.tensor(
        [[16, 5], [0, 0], [3, 9]] if case.ragged else [[16, 16], [0, 0], [4, 4]], dtype=torch.int32
    )
    seq_lens = [int(starts[b].max()) + (p + 1) * lag + 3 for b, p in enumerate(parts)]
    paged = make_paged(
        seq_lens, KV_HEADS, case.head_dim, case.block_size, case.dtype, DEVICE, case.layout
    )
    return paged, starts, torch.tensor(parts, dtype=torch.int32)


@pytest.mark.parametrize("case", cases())
def test_lagkv_matches_policy(case: Case) -> None:
    lag = 16 if case.group < 4 else 32
    paged, starts, parts = _setup(case, lag)
    got = lagkv_scores(
        paged.cache,
        paged.block_table,
        paged.seq_lens,
        starts.to(DEVICE),
        parts.to(DEVICE),
        lag,
        3,
        RANGE_EPS,
    )
    cpu = paged.cpu()
    want64 = ref_lagkv(cpu, starts, parts, lag, torch.float64)
    policy = ref_lagkv(cpu, starts, parts, lag, None)  # the policy's own float32 function
    assert_close_to_ref(got, want64, policy, what=str(case))


def test_lagkv_channel_chunks_and_long_lag() -> None:
    """lag 128 with D = 128 splits the channels into chunks of 32 (merged variance)."""
    case = Case(torch.bfloat16, 128, 32, 1, "HNC", True, False)
    paged, starts, parts = _setup(case, 128)
    got = lagkv_scores(
        paged.cache,
        paged.block_table,
        paged.seq_lens,
        starts.to(DEVICE),
        parts.to(DEVICE),
        128,
        3,
        RANGE_EPS,
    )
    cpu = paged.cpu()
    assert_close_to_ref(
        got,
        ref_lagkv(cpu, starts, parts, 128, torch.float64),
        ref_lagkv(cpu, starts, parts, 128, None),
    )


def test_constant_reference_channel_uses_eps() -> None:
    """A reference channel with zero range is divided by RANGE_EPS, as in the policy (no NaN)."""
    case = Case(torch.float32, 64, 16, 1, "NHC", False, False)
    paged, starts, parts = _setup(case, 16)
    lo = int(starts[0, 0]) + 16
    for i in range(lo, lo + 16):  # request 0, partition 0's reference: channel 3 of K constant
        blk = int(paged.block_table[0, i // 16])
        paged.cache[blk, i % 16, :, 3] = 0.5
    got = lagkv_scores(
        paged.cache,
        paged.block_table,
        paged.seq_lens,
        starts.to(DEVICE),
        parts.to(DEVICE),
        16,
        3,
        RANGE_EPS,
    )
    want = ref_lagkv(paged.cpu(), starts, parts, 16, None)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-5)


def test_reference_formula_is_the_policy() -> None:
    """kernel_refs' dtype-generic formula equals policies.lagkv.lagkv_scores in float32."""
    gen = torch.Generator().manual_seed(0)
    k, v, kr, vr = (torch.randn(3, 2, 24, 64, generator=gen) for _ in range(4))
    torch.testing.assert_close(
        lagkv_partition(k, v, kr, vr, torch.float32), policy_lagkv_scores(k, v, kr, vr)
    )


def test_partitions_without_full_reference_are_not_scored() -> None:
    """num_parts beyond what N allows: those partitions stay 0 instead of reading past N."""
    case = Case(torch.float16, 64, 16, 1, "NHC", True, False)
    paged, starts, parts = _setup(case, 16)
    more = parts + 2  # 5, 2, 3 asked; 3, 0, 1 fit
    got = lagkv_scores(
        paged.cache,
        paged.block_table,
        paged.seq_lens,
        starts.to(DEVICE),
        more.to(DEVICE),
        16,
        5,
        RANGE_EPS,
    )
    cpu = paged.cpu()
    want64 = ref_lagkv(cpu, starts, parts, 16, torch.float64)
    assert torch.equal(got[:, :, 3:].cpu(), torch.zeros_like(got[:, :, 3:].cpu()))
    assert_close_to_ref(got[:, :, :3], want64, ref_lagkv(cpu, starts, parts, 16, None))
