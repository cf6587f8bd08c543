"""SnapKV pooling and voting; StreamingLLM and KNorm selections."""

from __future__ import annotations

import math

import pytest
import torch

from vllm_kvcomp.policies.base import LayerKV, RequestState, window_attention
from vllm_kvcomp.policies.knorm import KNorm
from vllm_kvcomp.policies.snapkv import SnapKV, pool_scores
from vllm_kvcomp.policies.streamingllm import StreamingLLM


@pytest.mark.parametrize("kernel", [1, 3, 5, 7])
def test_pooling_is_a_zero_padded_centred_mean(kernel):
    scores = torch.randn(2, 11)
    pooled = pool_scores(scores, kernel)
    half = kernel // 2
    for h in range(2):
        for i in range(11):
            window = [float(scores[h, j]) for j in range(i - half, i + half + 1) if 0 <= j < 11]
            assert float(pooled[h, i]) == pytest.approx(sum(window) / kernel, abs=1e-6)


def _votes(kv: LayerKV) -> torch.Tensor:
    """[H_kv, N] attention of the window queries (last w positions, causal), summed, group mean."""
    hq, w, dim = kv.queries.shape
    group = hq // kv.num_kv_heads
    n = kv.num_slots
    out = torch.zeros(kv.num_kv_heads, n)
    for q in range(hq):
        keys = kv.keys[q // group]
        for t in range(w):
            visible = n - w + t + 1
            out[q // group, :visible] += (keys[:visible] @ kv.queries[q, t] * dim**-0.5).softmax(0) / group
    return out


def test_score_is_pooled_group_mean_of_window_votes():
    gen = torch.Generator().manual_seed(0)
    kv = LayerKV(torch.randn(2, 25, 8, generator=gen), torch.randn(2, 25, 8, generator=gen),
                 queries=torch.randn(6, 5, 8, generator=gen))
    policy = SnapKV(window=5, kernel=3)
    prefix = _votes(kv)[:, :20]  # the reference pools attn[..., -w:, :-w]: the prefix only
    scores = policy.score(kv, RequestState())
    assert torch.allclose(scores[:, :20], pool_scores(prefix, 3), atol=1e-5)
    assert torch.allclose(scores[:, 20:], scores.amax(-1, keepdim=True).expand(2, 5))


def _one_hot_layer(probs: list[list[float]]) -> LayerKV:
    """One KV head whose key j is e_j and window queries whose softmax over the visible keys is
    ``probs`` (scale 1): logit_j = log p_j, so the attention is exactly what is written."""
    n = len(probs[-1])
    queries = torch.tensor([[math.log(p) if p > 0 else -60.0 for p in row] + [-60.0] * (n - len(row))
                            for row in probs]).unsqueeze(0)
    return LayerKV(torch.eye(n).unsqueeze(0), torch.zeros(1, n, n), queries=queries, scale=1.0)


def test_pooling_stops_at_the_window_boundary_as_in_the_reference():
    """Deviation pinned (issue #17): SnapKV's reference pools the prefix's votes only.

    10 tokens, window 2 (slots 8, 9), kernel 3, budget 3 = the window + 1 prefix token. The two
    window queries give slots 2, 3, 4 votes 0.15, 0.6, 0.15 and the window's slot 8 a vote 1.1.
    Prefix-only pooling: slot 3 = 0.9/3 = 0.30, slot 7 = (0 + 0 + 0)/3 = 0 -> keeps 3. Pooling
    across the boundary gave slot 7 = 1.1/3 = 0.37 > 0.30 and kept 7, a token nobody attends to.
    """
    kv = _one_hot_layer([
        [0, 0, 0.1, 0.3, 0.1, 0, 0, 0, 0.5],         # query 8 (sees 0..8)
        [0, 0, 0.05, 0.3, 0.05, 0, 0, 0, 0.6, 0],   # query 9
    ])
    policy = SnapKV(budget=3, window=2, kernel=3)
    scores = policy.score(kv, RequestState())[0]
    assert scores[3].item() == pytest.approx(0.3, abs=1e-6)
    assert scores[7].item() == pytest.approx(0.0, abs=1e-6)
    assert policy.decide([kv], RequestState())[0].indices[0].tolist() == [3, 8, 9]
    votes = window_attention(kv).sum(dim=1)
    assert votes[0].tolist() == pytest.approx([0, 0, 0.15, 0.6, 0.15, 0, 0, 0, 1.1, 0], abs=1e-6)
    crossing = pool_scores(votes, 3)[0, :8]  # the old rule: pool across the boundary
    assert int(crossing.argmax()) == 7 and crossing[7].item() == pytest.approx(1.1 / 3, abs=1e-6)


def test_planted_token_and_window_are_kept():
    gen = torch.Generator().manual_seed(1)
    keys = torch.randn(1, 80, 8, generator=gen) * 0.1
    queries = keys[:, [17]].expand(1, 8, 8) * 400  # every window query looks at slot 17
    kv = LayerKV(keys, torch.randn(1, 80, 8, generator=gen), queries=queries.contiguous())
    sel = SnapKV(budget=10, window=8, kernel=1).decide([kv], RequestState())[0]
    kept = sel.indices[0].tolist()
    assert 17 in kept and kept[-8:] == list(range(72, 80)) and len(kept) == 10


def test_even_kernel_rejected():
    from vllm_kvcomp.params import SpecError
    from vllm_kvcomp.spec import CompressionSpec

    with pytest.raises(SpecError, match="kernel"):
        CompressionSpec.from_mapping({"policy": "snapkv", "kernel": 6})


def test_streamingllm_keeps_sink_and_most_recent():
    kv = LayerKV(torch.randn(2, 50, 4), torch.randn(2, 50, 4), lengths=torch.tensor([50, 30]))
    sel = StreamingLLM(budget=12, sink=4).decide([kv], RequestState())[0]
    assert sel.indices[0].tolist() == [0, 1, 2, 3, *range(42, 50)]
    assert sel.indices[1].tolist() == [20, 21, 22, 23, *range(42, 50)]


def test_knorm_keeps_lowest_norms():
    keys = torch.randn(1, 30, 4)
    norms = keys[0].norm(dim=-1)
    sel = KNorm(budget=7).decide([LayerKV(keys, torch.randn(1, 30, 4))], RequestState())[0]
    assert sel.indices[0].tolist() == sorted(torch.argsort(norms)[:7].tolist())
    sel = KNorm(budget=7, sink=2, window=2).decide([LayerKV(keys, torch.randn(1, 30, 4))], RequestState())[0]
    middle = torch.argsort(norms[2:28])[:3] + 2
    assert sel.indices[0].tolist() == [0, 1, *sorted(middle.tolist()), 28, 29]
