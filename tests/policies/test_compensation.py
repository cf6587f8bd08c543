"""RazorAttention eq. 5 as LSE merging (vllm_kvcomp.policies.compensation), checked in float64."""

from __future__ import annotations

import pytest
import torch

from vllm_kvcomp.policies.compensation import (
    attention_with_lse,
    compensated_attention,
    compensation_lse,
    merge_partials,
)

T, S, H, D = 5, 12, 3, 8
SCALE = D**-0.5


@pytest.fixture
def qkv():
    g = torch.Generator().manual_seed(1)
    return tuple(torch.randn(*shape, generator=g, dtype=torch.float64) for shape in ((T, H, D), (S, H, D), (S, H, D)))


def _reference(q, k, v, mask=None):
    """Softmax attention written out directly: [T, H, D]."""
    logits = torch.einsum("thd,shd->hts", q, k) * SCALE
    if mask is not None:
        logits = logits.masked_fill(~mask, float("-inf"))
    return torch.einsum("hts,shd->thd", torch.softmax(logits, -1), v)


def test_attention_with_lse_matches_softmax_and_lse(qkv):
    q, k, v = qkv
    mask = torch.ones(T, S, dtype=torch.bool).tril(S - T)
    out, lse = attention_with_lse(q, k, v, SCALE, mask)
    torch.testing.assert_close(out, _reference(q, k, v, mask), rtol=1e-12, atol=1e-12)
    logits = torch.einsum("thd,shd->ths", q, k) * SCALE
    torch.testing.assert_close(lse, logits.masked_fill(~mask.unsqueeze(1), float("-inf")).logsumexp(-1))


def test_merging_disjoint_partials_is_full_attention(qkv):
    q, k, v = qkv
    a, b = slice(0, 7), slice(7, S)
    out_a, lse_a = attention_with_lse(q, k[a], v[a], SCALE)
    out_b, lse_b = attention_with_lse(q, k[b], v[b], SCALE)
    out, lse = merge_partials(out_a, lse_a, out_b, lse_b)
    full, full_lse = attention_with_lse(q, k, v, SCALE)
    torch.testing.assert_close(out, full, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, full_lse, rtol=1e-12, atol=1e-12)


def test_merging_with_an_empty_partial_returns_the_other(qkv):
    q, k, v = qkv
    out_a, lse_a = attention_with_lse(q, k, v, SCALE)
    empty = torch.full_like(lse_a, float("-inf"))
    out, lse = merge_partials(out_a, lse_a, torch.zeros_like(out_a), empty)
    torch.testing.assert_close(out, out_a, rtol=0, atol=0)
    assert torch.equal(lse, lse_a)


def test_compensated_attention_is_eq5(qkv):
    q, k, v = qkv
    g = torch.Generator().manual_seed(2)
    k_hat, v_hat = torch.randn(H, D, generator=g, dtype=torch.float64), torch.randn(H, D, generator=g, dtype=torch.float64)
    counts = torch.tensor([3.0, 0.0, 17.0])
    out = compensated_attention(q, k, v, k_hat, v_hat, counts, SCALE)
    # eq. 5 written out: N_d exp(q k̂) v̂ + Σ exp(q k_n) v_n over N_d exp(q k̂) + Σ exp(q k_n)
    w = torch.exp(torch.einsum("thd,shd->ths", q, k) * SCALE)
    w_hat = counts.double() * torch.exp(torch.einsum("thd,hd->th", q, k_hat) * SCALE)
    num = torch.einsum("ths,shd->thd", w, v) + w_hat.unsqueeze(-1) * v_hat
    expected = num / (w.sum(-1) + w_hat).unsqueeze(-1)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out[:, 1], _reference(q, k, v)[:, 1], rtol=1e-12, atol=1e-12)


def test_compensation_equals_the_dropped_tokens_when_they_are_identical(qkv):
    q, k, v = qkv
    k_rep = torch.cat([k, k[:1].expand(6, -1, -1)])
    v_rep = torch.cat([v, v[:1].expand(6, -1, -1)])
    full = _reference(q, k_rep, v_rep)
    out = compensated_attention(q, k, v, k[0], v[0], torch.full((H,), 6.0), SCALE)
    torch.testing.assert_close(out, full, rtol=1e-12, atol=1e-12)


def test_compensation_lse_adds_log_count(qkv):
    q, k, _ = qkv
    lse = compensation_lse(q, k[0], torch.tensor([1.0, 2.0, 0.0]), SCALE)
    base = torch.einsum("thd,hd->th", q, k[0]) * SCALE
    torch.testing.assert_close(lse[:, 0], base[:, 0])
    torch.testing.assert_close(lse[:, 1], base[:, 1] + torch.log(torch.tensor(2.0, dtype=torch.float64)))
    assert torch.isneginf(lse[:, 2]).all()


def test_low_precision_inputs_accumulate_in_float32(qkv):
    q, k, v = (x.to(torch.bfloat16) for x in qkv)
    out = compensated_attention(q, k, v, k[0], v[0], torch.full((H,), 4.0), SCALE)
    assert out.dtype == torch.bfloat16
    ref = compensated_attention(*(x.double() for x in (q, k, v, k[0], v[0])), torch.full((H,), 4.0), SCALE)
    torch.testing.assert_close(out.double(), ref, rtol=2e-2, atol=2e-2)
