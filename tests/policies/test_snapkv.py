"""SnapKV pooling and voting; StreamingLLM and KNorm selections."""

from __future__ import annotations

import pytest
import torch

from vllm_kvcomp.policies.base import LayerKV, RequestState
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
    expected = pool_scores(_votes(kv), 3)
    assert torch.allclose(policy.score(kv, RequestState()), expected, atol=1e-5)


def test_planted_token_and_window_are_kept():
    gen = torch.Generator().manual_seed(1)
    keys = torch.randn(1, 80, 8, generator=gen) * 0.1
    queries = keys[:, [17]].expand(1, 8, 8) * 400  # every window query looks at slot 17
    kv = LayerKV(keys, torch.randn(1, 80, 8, generator=gen), queries=queries.contiguous())
    sel = SnapKV(budget=10, window=8, kernel=1).select_layer(kv, RequestState())
    kept = sel.indices[0].tolist()
    assert 17 in kept and kept[-8:] == list(range(72, 80)) and len(kept) == 10


def test_even_kernel_rejected():
    from vllm_kvcomp.params import SpecError
    from vllm_kvcomp.spec import CompressionSpec

    with pytest.raises(SpecError, match="kernel"):
        CompressionSpec.from_mapping({"policy": "snapkv", "kernel": 6})


def test_streamingllm_keeps_sink_and_most_recent():
    kv = LayerKV(torch.randn(2, 50, 4), torch.randn(2, 50, 4), lengths=torch.tensor([50, 30]))
    sel = StreamingLLM(budget=12, sink=4).select_layer(kv, RequestState())
    assert sel.indices[0].tolist() == [0, 1, 2, 3, *range(42, 50)]
    assert sel.indices[1].tolist() == [20, 21, 22, 23, *range(42, 50)]


def test_knorm_keeps_lowest_norms():
    keys = torch.randn(1, 30, 4)
    norms = keys[0].norm(dim=-1)
    sel = KNorm(budget=7).select_layer(LayerKV(keys, torch.randn(1, 30, 4)), RequestState())
    assert sel.indices[0].tolist() == sorted(torch.argsort(norms)[:7].tolist())
    sel = KNorm(budget=7, sink=2, window=2).select_layer(LayerKV(keys, torch.randn(1, 30, 4)), RequestState())
    middle = torch.argsort(norms[2:28])[:3] + 2
    assert sel.indices[0].tolist() == [0, 1, *sorted(middle.tolist()), 28, 29]
