"""Expected Attention: the Gaussian expected attention of the window queries' mean and covariance,
times the value norm, against a plain float64 implementation."""

from __future__ import annotations

import math

import pytest
import torch

from tests.policies.conftest import make_policy
from vllm_kvcomp.policies.base import LayerKV, RequestState, window_attention
from vllm_kvcomp.policies.expected_attention import ExpectedAttention

HEADS, GROUP, N, D, W = 2, 3, 12, 4, 5


def _plain_scores(kv: LayerKV, lengths: list[int], sink: int, epsilon: float) -> list[list[float]]:
    """Per KV head and live slot past the sink: (mean over the group of softmax_i(s·μᵀk_i +
    s²/2·k_iᵀΣk_i) + ε)·||v_i||, μ/Σ the mean and covariance (÷ count) of the head's queries."""
    s = kv.softmax_scale
    out = []
    for h in range(HEADS):
        slots = range(N - lengths[h] + sink, N)
        probs = [0.0] * len(slots)
        for q in range(h * GROUP, (h + 1) * GROUP):
            rows = kv.queries[q]
            mean = rows.mean(0)
            cov = sum(torch.outer(r - mean, r - mean) for r in rows) / len(rows)
            logits = [s * float(mean @ k) + s * s / 2 * float(k @ cov @ k)
                      for k in (kv.keys[h, i] for i in slots)]
            total = sum(math.exp(x - max(logits)) for x in logits)
            probs = [p + math.exp(x - max(logits)) / total / GROUP for p, x in zip(probs, logits)]
        norms = [math.sqrt(float(kv.values[h, i] @ kv.values[h, i])) for i in slots]
        out.append([(p + epsilon) * norm for p, norm in zip(probs, norms)])
    return out


def _layer(seed: int, lengths: list[int]) -> LayerKV:
    gen = torch.Generator().manual_seed(seed)
    return LayerKV(torch.randn(HEADS, N, D, generator=gen, dtype=torch.float64),
                   torch.randn(HEADS, N, D, generator=gen, dtype=torch.float64),
                   lengths=torch.tensor(lengths), scale=0.4,
                   queries=torch.randn(HEADS * GROUP, W, D, generator=gen, dtype=torch.float64))


@pytest.mark.parametrize(("sink", "epsilon"), [(0, 0.0), (2, 0.0), (3, 0.05)])
def test_score_is_the_written_formula(sink, epsilon):
    lengths = [12, 7]
    kv = _layer(sink, lengths)
    scores = ExpectedAttention(sink=sink, epsilon=epsilon).score(kv, RequestState())
    for h, expected in enumerate(_plain_scores(kv, lengths, sink, epsilon)):
        start = N - lengths[h]
        expected = torch.tensor(expected, dtype=torch.float64)
        assert torch.allclose(scores[h, start + sink:], expected, rtol=1e-12, atol=0)
        assert bool(torch.isinf(scores[h, start:start + sink]).all())


def test_identical_window_queries_give_that_querys_attention_times_the_value_norm():
    """Zero covariance: the expected attention is the attention of the one query (no causal mask:
    future queries see every key)."""
    kv = _layer(9, [N, N])
    kv.queries = kv.queries[:, -1:].expand(-1, W, -1).clone()
    plain = window_attention(LayerKV(kv.keys, kv.values, queries=kv.queries[:, -1:], scale=kv.scale,
                                     query_positions=torch.tensor([N - 1])))[:, 0]  # [H_q, N]
    expected = plain.reshape(HEADS, GROUP, N).mean(1) * kv.values.norm(dim=-1)
    scores = ExpectedAttention(sink=0).score(kv, RequestState())
    assert torch.allclose(scores, expected, rtol=1e-12, atol=0)


def test_the_covariance_term_favours_keys_along_the_queries_spread():
    """Queries with mean 0 spread along e0: a key along e0 expects exp(s²/2·σ²) > 1 = a key along
    e1's (equal value norms)."""
    queries = torch.zeros(1, 4, 2, dtype=torch.float64)
    queries[0, :, 0] = torch.tensor([-2.0, -1.0, 1.0, 2.0])
    keys = torch.tensor([[[1.0, 0.0], [0.0, 1.0]]], dtype=torch.float64)
    kv = LayerKV(keys, torch.ones(1, 2, 2, dtype=torch.float64), queries=queries, scale=1.0)
    scores = ExpectedAttention(sink=0).score(kv, RequestState())[0]
    ratio = math.exp(0.5 * 2.5)  # σ² along e0 = (4 + 1 + 1 + 4) / 4
    assert float(scores[0] / scores[1]) == pytest.approx(ratio, rel=1e-12)


def test_adaptive_heads_keep_the_layer_total(fake_request):
    policy = make_policy("expected_attention", heads="adaptive")
    request = fake_request(60, 3, 2, seed=6)
    state = RequestState(prompt_len=60)
    for sel in policy.decide(request.layers(policy.queries_needed()), state):
        assert int(sel.counts().sum()) == 3 * state.budget
