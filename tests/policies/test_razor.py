"""RazorAttention policy: what each head keeps, the compensation token, spec and profile binding."""

from __future__ import annotations

import math

import pytest
import torch

from vllm_kvcomp.calibration.profiles import ModelIdentity, RetrievalHeadsProfile, bind_profile
from vllm_kvcomp.params import SpecError
from vllm_kvcomp.policies.base import LayerKV, RequestState
from vllm_kvcomp.policies.compensation import attention_with_lse, compensated_attention
from vllm_kvcomp.policies.razor import Razor
from vllm_kvcomp.spec import CompressionSpec


def _kv(n: int = 64, heads: int = 3, dim: int = 8, layer: int = 0, seed: int = 0, dtype=torch.float32, **kw) -> LayerKV:
    g = torch.Generator().manual_seed(seed)
    return LayerKV(
        torch.randn(heads, n, dim, generator=g, dtype=dtype),
        torch.randn(heads, n, dim, generator=g, dtype=dtype),
        layer=layer,
        num_layers=4,
        **kw,
    )


def test_non_retrieval_head_keeps_sink_recent_and_mean_compensation():
    kv = _kv(n=100)
    policy = Razor(retrieval_heads=frozenset(), ratio=0.25, sink=4, buffer=10)
    sel = policy.select_layer(kv, RequestState())
    recent = max(10, math.ceil(0.25 * 100))  # L_h = max(S0, N/C) = 25
    expected = torch.cat([torch.arange(4), torch.arange(100 - recent, 100)])
    for h in range(3):
        assert torch.equal(sel.indices[h], expected)
        dropped = slice(4, 100 - recent)
        torch.testing.assert_close(sel.compensation.keys[h], kv.keys[h, dropped].mean(0))
        torch.testing.assert_close(sel.compensation.values[h], kv.values[h, dropped].mean(0))
    assert sel.compensation.counts.tolist() == [100 - 4 - recent] * 3


def test_buffer_floor_dominates_for_short_inputs():
    kv = _kv(n=100)
    sel = Razor(retrieval_heads=frozenset(), ratio=0.1, sink=2, buffer=40).select_layer(kv, RequestState())
    assert sel.counts().tolist() == [42, 42, 42]
    assert torch.equal(sel.indices[0][2:], torch.arange(60, 100))
    assert sel.compensation.counts.tolist() == [58.0] * 3


def test_budget_replaces_ratio():
    kv = _kv(n=100)
    policy = CompressionSpec.from_mapping({"policy": "razor", "budget": 30, "buffer": 0, "sink": 4}).build_policy()
    sel = policy.select_layer(kv, RequestState())
    assert sel.counts().tolist() == [34, 34, 34]


def test_retrieval_heads_keep_everything_without_compensation():
    kv = _kv(n=80, layer=2)
    policy = Razor(retrieval_heads=frozenset({(2, 1), (3, 0)}), ratio=0.2, sink=4, buffer=8)
    sel = policy.select_layer(kv, RequestState())
    assert torch.equal(sel.indices[1], torch.arange(80))
    assert sel.compensation.counts[1] == 0
    assert sel.counts().tolist() == [4 + 16, 80, 4 + 16]  # (3, 0) is another layer's head
    assert sel.compensation.counts[0] == 80 - 20


def test_ragged_lengths_are_right_aligned():
    kv = _kv(n=50, lengths=torch.tensor([50, 30, 10]))
    sel = Razor(retrieval_heads=frozenset(), ratio=0.2, sink=2, buffer=6).select_layer(kv, RequestState())
    assert torch.equal(sel.indices[1], torch.cat([torch.arange(20, 22), torch.arange(44, 50)]))
    torch.testing.assert_close(sel.compensation.keys[1], kv.keys[1, 22:44].mean(0))
    assert sel.compensation.counts.tolist() == [50 - 2 - 10, 30 - 8, 10 - 8]
    assert torch.equal(sel.indices[2][:2], torch.tensor([40, 41]))


def test_nothing_to_drop_means_no_compensation():
    kv = _kv(n=20)
    sel = Razor(retrieval_heads=frozenset(), sink=4, buffer=16).select_layer(kv, RequestState())
    assert all(torch.equal(i, torch.arange(20)) for i in sel.indices)
    assert sel.compensation.counts.tolist() == [0.0, 0.0, 0.0]


def test_identical_dropped_tokens_make_compensation_exact():
    """If every dropped token is the same (k, v), eq. 5 with one compensation token is exact."""
    kv = _kv(n=40, heads=2, dim=4, dtype=torch.float64)
    kv.keys[:, 4:30] = kv.keys[:, 4:5]
    kv.values[:, 4:30] = kv.values[:, 4:5]
    sel = Razor(retrieval_heads=frozenset(), ratio=0.25, sink=4, buffer=0).select_layer(kv, RequestState())
    q = torch.randn(3, 2, 4, dtype=torch.float64)  # decode queries attend to everything
    full, _ = attention_with_lse(q, kv.keys.transpose(0, 1), kv.values.transpose(0, 1), 0.5)
    idx = sel.indices[0]
    assert torch.equal(idx, sel.indices[1])
    comp = sel.compensation
    out = compensated_attention(
        q, kv.keys[:, idx].transpose(0, 1), kv.values[:, idx].transpose(0, 1),
        comp.keys, comp.values, comp.counts, 0.5,
    )
    torch.testing.assert_close(out, full, rtol=1e-12, atol=1e-12)
    without, _ = attention_with_lse(q, kv.keys[:, idx].transpose(0, 1), kv.values[:, idx].transpose(0, 1), 0.5)
    assert not torch.allclose(without, full, atol=1e-3)


def test_spec_parsing_defaults_and_errors():
    policy = CompressionSpec.from_header("razor").build_policy()
    assert isinstance(policy, Razor)
    assert (policy.ratio, policy.sink, policy.buffer, policy.profile) == (0.2, 4, 512, "default")
    assert policy.queries_needed() == 0 and not Razor.RECOMPRESSES and Razor.PROFILE == "razor"
    policy = CompressionSpec.from_header("policy=razor; ratio=0.3; buffer=100; profile=alt-2").build_policy()
    assert (policy.ratio, policy.buffer, policy.profile) == (0.3, 100, "alt-2")
    with pytest.raises(SpecError) as err:
        CompressionSpec.from_header("razor; profile=../etc")
    assert err.value.field == "profile"
    with pytest.raises(SpecError) as err:
        CompressionSpec.from_header("razor; buffer=-1")
    assert err.value.field == "buffer"
    with pytest.raises(SpecError) as err:
        CompressionSpec.from_header("razor; window=4")
    assert err.value.field == "window"
    with pytest.raises(SpecError):
        CompressionSpec.from_mapping({"policy": "razor", "retrieval_heads": "x"})


def test_with_profile_and_bind_profile():
    ident = ModelIdentity("llama", 4, 6, 3, 8, "abc")
    profile = RetrievalHeadsProfile(model=ident, kv_heads=frozenset({(0, 1), (3, 2)}))
    policy = CompressionSpec.from_header("razor; ratio=0.5").build_policy()
    bound = policy.with_profile(profile)
    assert bound.retrieval_heads == frozenset({(0, 1), (3, 2)}) and bound.ratio == 0.5
    assert policy.retrieval_heads is None
    assert bind_profile(policy, profile) == bound


def test_unbound_policy_compresses_every_head():
    sel = Razor(ratio=0.25, buffer=0).select_layer(_kv(n=64), RequestState())
    assert sel.counts().tolist() == [4 + 16] * 3
