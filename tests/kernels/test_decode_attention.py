"""The Triton paged decode attention (per-head valid ranges, compensation) vs the package's
plain-PyTorch reference run in float64, in Triton's interpreter on CPU."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.kernel_refs import assert_decode_close
from tests.kernels.cases import DEVICE, Case, cases
from vllm_kvcomp.kernels.fixtures import Paged, random_starts
from vllm_kvcomp.kernels.triton_jit.decode import decode_attention

SEQ_LENS = [150, 1, 77]
KV_HEADS = 2


def _inputs(case: Case, seed: int = 0):
    paged = case.paged(SEQ_LENS, KV_HEADS, seed)
    gen = torch.Generator().manual_seed(seed + 10)
    batch, d = len(SEQ_LENS), case.head_dim
    q = torch.randn(batch, KV_HEADS * case.group, d, generator=gen).to(case.dtype).to(DEVICE)
    starts = random_starts(SEQ_LENS, KV_HEADS, seed=seed, min_len=0) if case.ragged else None
    comp = None
    if case.comp:
        counts = torch.randint(0, 50, (batch, KV_HEADS), generator=gen).float()
        counts[0, 0] = 0.0  # one head with the token switched off
        comp = (
            torch.randn(batch, KV_HEADS, d, generator=gen),
            torch.randn(batch, KV_HEADS, d, generator=gen),
            counts,
        )
    return paged, q, starts, comp


def _check(case: Case, paged: Paged, q, starts, comp, out, lse) -> None:
    assert out.dtype == case.dtype
    assert_decode_close(q, paged, starts, comp, case.head_dim**-0.5, out, lse, what=str(case))


def _dev(t):
    return None if t is None else t.to(DEVICE)


@pytest.mark.parametrize("case", cases())
def test_decode_matches_reference(case: Case) -> None:
    paged, q, starts, comp = _inputs(case)
    k_hat, v_hat, counts = comp if comp is not None else (None, None, None)
    out, lse = decode_attention(
        q,
        paged.cache,
        paged.block_table,
        paged.seq_lens,
        _dev(starts),
        _dev(k_hat),
        _dev(v_hat),
        _dev(counts),
        num_splits=3,
    )
    _check(case, paged, q, starts, comp, out, lse)


@pytest.mark.parametrize("num_splits", [1, 7])
def test_decode_split_count_does_not_change_result(num_splits: int) -> None:
    case = Case(torch.float32, 64, 16, 4, "NHC", True, True)
    paged, q, starts, comp = _inputs(case, seed=3)
    out, lse = decode_attention(
        q,
        paged.cache,
        paged.block_table,
        paged.seq_lens,
        _dev(starts),
        *(_dev(t) for t in comp),
        num_splits=num_splits,
    )
    _check(case, paged, q, starts, comp, out, lse)


def test_empty_range_gives_zero_output_and_minus_inf_lse() -> None:
    case = Case(torch.float32, 64, 16, 2, "NHC", True, False)
    paged, q, _, _ = _inputs(case)
    starts = paged.seq_lens.view(-1, 1).expand(-1, KV_HEADS).contiguous()  # every head empty
    out, lse = decode_attention(q, paged.cache, paged.block_table, paged.seq_lens, starts)
    assert torch.equal(out.cpu(), torch.zeros_like(out.cpu()))
    assert torch.isneginf(lse).all()


def test_compensation_only_returns_v_hat() -> None:
    """With no live slot, the compensation token alone is attended: out = v̂, lse = scale·q·k̂ + ln N_d."""
    case = Case(torch.float32, 64, 16, 2, "NHC", True, True)
    paged, q, _, comp = _inputs(case)
    k_hat, v_hat, _ = comp
    counts = torch.full((len(SEQ_LENS), KV_HEADS), 5.0)
    starts = paged.seq_lens.view(-1, 1).expand(-1, KV_HEADS).contiguous()
    out, lse = decode_attention(
        q,
        paged.cache,
        paged.block_table,
        paged.seq_lens,
        starts,
        _dev(k_hat),
        _dev(v_hat),
        _dev(counts),
    )
    want = v_hat.repeat_interleave(case.group, dim=1)
    torch.testing.assert_close(out.cpu(), want)
    logit = (
        torch.einsum("bhd,bhd->bh", q.cpu(), k_hat.repeat_interleave(case.group, dim=1))
        * case.head_dim**-0.5
    )
    torch.testing.assert_close(lse.cpu(), logit + torch.log(torch.tensor(5.0)))


def test_rejects_mismatched_heads() -> None:
    case = Case(torch.float32, 64, 16, 1, "NHC", False, False)
    paged, _, _, _ = _inputs(case)
    q = torch.randn(len(SEQ_LENS), 3, 64, device=DEVICE)  # 3 query heads over 2 KV heads
    with pytest.raises(ValueError, match="does not match"):
        decode_attention(q, paged.cache, paged.block_table, paged.seq_lens)
