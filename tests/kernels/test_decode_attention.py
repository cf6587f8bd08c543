"""The Triton paged decode attention (per-head valid ranges, compensation, observed weights) vs
the package's plain-PyTorch reference run in float64, in Triton's interpreter on CPU."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.kernel_refs import assert_close_to_ref, assert_decode_close
from tests.kernels.cases import DEVICE, Case, cases
from vllm_kvcomp import kernels
from vllm_kvcomp.kernels.fixtures import Paged, make_paged, random_starts
from vllm_kvcomp.kernels.reference import observed_weights_reference
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


# --------------------------------------------------------------------------- observed attention
OBSERVED = torch.tensor([[True, True], [False, True], [True, False]])  # (request, KV head) rows observed
ROW_PAD = 5  # row floats past the longest request: never written


def _observed_rows(device: str = DEVICE, seed: int = 7) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows [B, H_kv, N_max + ROW_PAD] float32 of random earlier sums on ``device``, and their
    addresses [B, H_kv] int64 (0 where not OBSERVED)."""
    gen = torch.Generator().manual_seed(seed)
    rows = torch.rand(len(SEQ_LENS), KV_HEADS, max(SEQ_LENS) + ROW_PAD, generator=gen).to(device)
    ids = torch.arange(len(SEQ_LENS) * KV_HEADS, dtype=torch.int64).view(len(SEQ_LENS), KV_HEADS)
    addresses = rows.data_ptr() + ids * rows.shape[2] * rows.element_size()
    return rows, torch.where(OBSERVED, addresses, 0).to(device)


def _assert_observed(rows, before, q, paged, starts, softcap: float = 0.0, what: str = "") -> None:
    """``rows`` = ``before`` + the reference's weights on the observed rows; every other float
    (unobserved rows, slots outside a head's range, the padding) bit-for-bit ``before``."""
    cpu = paged.cpu()
    args = (cpu.block_table, cpu.seq_lens, starts, None, softcap)
    w64 = observed_weights_reference(q.cpu().double(), cpu.cache.double(), *args)
    w_lp = observed_weights_reference(q.cpu(), cpu.cache, *args)
    n = w64.shape[2]
    mask = OBSERVED.unsqueeze(-1)
    rows, before = rows.cpu(), before.cpu()
    assert_close_to_ref(rows[..., :n], before[..., :n].double() + w64 * mask,
                        before[..., :n] + w_lp.float() * mask, what=f"observed {what}")
    slots = torch.arange(rows.shape[2])
    lo = torch.zeros(len(SEQ_LENS), KV_HEADS, dtype=torch.long) if starts is None else starts.long()
    inside = OBSERVED.unsqueeze(-1) & (slots >= lo.unsqueeze(-1)) & (slots < cpu.seq_lens.long().view(-1, 1, 1))
    assert torch.equal(rows[~inside], before[~inside])


OBSERVE_CASES = [
    Case(torch.float32, 64, 16, 1, "NHC", True, True),
    Case(torch.float16, 64, 32, 3, "HNC", True, True),
]


@pytest.mark.parametrize("case", [pytest.param(c, id=str(c)) for c in OBSERVE_CASES])
def test_observe_adds_each_cells_weight_among_the_cells(case: Case) -> None:
    """Observed rows get each cell's weight among its head's cells (the compensation token left
    out), the mean over the G query heads, added to what they held; out and lse unchanged."""
    paged, q, starts, comp = _inputs(case)
    rows, addresses = _observed_rows()
    before = rows.clone()
    out, lse = decode_attention(q, paged.cache, paged.block_table, paged.seq_lens, _dev(starts),
                                *(_dev(t) for t in comp), num_splits=3, observe=addresses)
    _check(case, paged, q, starts, comp, out, lse)
    _assert_observed(rows, before, q, paged, starts, what=str(case))


def test_observe_with_softcap_and_sinks_weighs_capped_cells_only() -> None:
    """Soft-capped logits are observed as the layer attends; sinks stay out of the weights."""
    case = Case(torch.float32, 64, 16, 2, "NHC", False, False)
    paged, q, _, _ = _inputs(case, seed=5)
    q = q * 8  # logits past the cap
    sinks = torch.randn(KV_HEADS * case.group, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    rows, addresses = _observed_rows()
    before = rows.clone()
    decode_attention(q, paged.cache, paged.block_table, paged.seq_lens, num_splits=2, softcap=5.0, sinks=sinks,
                     observe=addresses)
    _assert_observed(rows, before, q, paged, None, softcap=5.0, what="softcap")


def test_reference_weights_match_a_softmax_per_head() -> None:
    """The reference's weights, against a softmax over each head's cells read token by token."""
    case = Case(torch.float64, 64, 16, 3, "NHC", True, False)
    paged = make_paged(SEQ_LENS, KV_HEADS, case.head_dim, case.block_size, torch.float64, seed=2)
    q = torch.randn(len(SEQ_LENS), KV_HEADS * case.group, case.head_dim, dtype=torch.float64,
                    generator=torch.Generator().manual_seed(3))
    starts = random_starts(SEQ_LENS, KV_HEADS, seed=2, min_len=0)
    weights = observed_weights_reference(q, paged.cache, paged.block_table, paged.seq_lens, starts)
    for b in range(len(SEQ_LENS)):
        keys, _ = paged.kv(b)
        for h in range(KV_HEADS):
            lo = int(starts[b, h])
            logits = q[b, h * case.group : (h + 1) * case.group] @ keys[h, lo:].T * case.head_dim**-0.5
            want = torch.zeros(weights.shape[2], dtype=torch.float64)
            want[lo : SEQ_LENS[b]] = torch.softmax(logits, dim=-1).mean(dim=0)
            torch.testing.assert_close(weights[b, h], want, rtol=1e-12, atol=1e-15)


def test_dispatch_torch_path_observes_cpu_rows() -> None:
    """``kernels.decode_attention`` on CPU tensors (the torch reference) adds the same weights."""
    case = Case(torch.float32, 64, 16, 3, "NHC", True, True)
    paged, q, starts, comp = _inputs(case, seed=1)
    rows, addresses = _observed_rows("cpu")
    before = rows.clone()
    kernels.decode_attention(q.cpu(), paged.cache.cpu(), paged.block_table.cpu(), paged.seq_lens.cpu(), starts,
                             comp, backend="torch", observe=addresses)
    _assert_observed(rows, before, q, paged, starts, what="torch")


def test_observe_rejects_rows_of_the_wrong_shape() -> None:
    case = Case(torch.float32, 64, 16, 1, "NHC", False, False)
    paged, q, _, _ = _inputs(case)
    _, addresses = _observed_rows()
    with pytest.raises(ValueError, match="observe must be int64"):
        decode_attention(q, paged.cache, paged.block_table, paged.seq_lens, observe=addresses[:, 0])
