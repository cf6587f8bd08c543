"""``kvzap``: the trained scorer's formula, its RoPE-free features, its profile and its refusals."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from tests.policies.conftest import TEST_PROFILES, make_policy
from vllm_kvcomp.calibration.profiles import bind_profile
from vllm_kvcomp.policies.base import LayerKV, Ranks, RequestState
from vllm_kvcomp.policies.kvzap import KVzap, cache_features, feature_count
from vllm_kvcomp.spec import CompressionSpec


def _neox_rope(keys: torch.Tensor, positions: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """Rotate [H, N, D] keys at ``positions`` [N] in the NeoX layout (dims j and j + D/2), as HF's
    ``rotate_half`` and vLLM's ``is_neox_style`` do."""
    d = keys.shape[-1]
    freqs = base ** (-torch.arange(0, d // 2, dtype=torch.float64) * 2 / d)
    angles = positions.double().unsqueeze(-1) * freqs  # [N, D/2]
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    half = torch.cat([-keys[..., d // 2:], keys[..., : d // 2]], -1)
    return keys * cos + half * sin


def test_the_score_is_the_linear_model_of_value_and_key_pair_norms():
    gen = torch.Generator().manual_seed(0)
    keys, values = torch.randn(4, 10, 8, generator=gen, dtype=torch.float64), torch.randn(4, 10, 8, generator=gen,
                                                                                           dtype=torch.float64)
    policy = make_policy("kvzap")
    weights = torch.tensor(TEST_PROFILES["kvzap"].weights[1], dtype=torch.float64)
    bias = torch.tensor(TEST_PROFILES["kvzap"].bias[1], dtype=torch.float64)
    got = policy.score(LayerKV(keys, values, layer=1, num_layers=2), RequestState(prompt_len=10))
    for h in range(4):
        for i in range(10):
            # the pair norms rounded to bfloat16 (cache_features: equal tokens tie exactly)
            pairs = [float((keys[h, i, j] ** 2 + keys[h, i, j + 4] ** 2).sqrt().bfloat16()) for j in range(4)]
            x = torch.tensor([*values[h, i].tolist(), *pairs], dtype=torch.float64)
            assert float(got[h, i]) == pytest.approx(float(x @ weights[h] + bias[h]), rel=1e-9)


def test_the_features_do_not_depend_on_the_position_rope_put_the_key_at():
    """Also in the last bits: float32 keys rotated in float32 at two positions (as a cache holds
    them) give bit-equal features, so copies of one token tie exactly."""
    gen = torch.Generator().manual_seed(1)
    keys, values = torch.randn(2, 6, 16, generator=gen, dtype=torch.float64), torch.randn(2, 6, 16, generator=gen,
                                                                                           dtype=torch.float64)
    near, far = _neox_rope(keys, torch.arange(6)), _neox_rope(keys, torch.arange(6) + 12345)
    assert not torch.allclose(near, far)
    torch.testing.assert_close(cache_features(near, values), cache_features(far, values))
    assert cache_features(near, values).shape == (2, 6, feature_count(16)) == (2, 6, 24)
    near32, far32 = _neox_rope(keys, torch.arange(6)).float(), _neox_rope(keys, torch.arange(6) + 12345).float()
    raw = lambda k: (k[..., :8].square() + k[..., 8:].square()).sqrt()  # noqa: E731
    assert not torch.equal(raw(near32), raw(far32))  # the rounding noise the features remove
    assert torch.equal(cache_features(near32, values.float()), cache_features(far32, values.float()))


def test_a_rank_scores_its_own_heads_with_the_profile_s_weights_for_them():
    """Under tensor parallelism rank r holds KV heads r·H..: its scores are the whole model's rows."""
    gen = torch.Generator().manual_seed(2)
    keys, values = torch.randn(4, 5, 8, generator=gen), torch.randn(4, 5, 8, generator=gen)
    policy = make_policy("kvzap")
    whole = policy.score(LayerKV(keys, values, layer=0, num_layers=2), RequestState(prompt_len=5))

    @dataclass
    class Second(Ranks):
        size: int = 2
        rank: int = 1

    state = RequestState(prompt_len=5, ranks=Second())
    half = policy.score(LayerKV(keys[2:], values[2:], layer=0, num_layers=2), state)
    torch.testing.assert_close(half, whole[2:])


def test_without_a_scorer_or_with_another_model_s_it_refuses_to_score():
    kv = LayerKV(torch.randn(2, 5, 8), torch.randn(2, 5, 8))
    unbound = CompressionSpec.from_mapping({"policy": "kvzap", "ratio": 0.5}).build_policy()
    with pytest.raises(ValueError, match="calibrate --kind kvzap"):
        unbound.score(kv, RequestState(prompt_len=5))
    with pytest.raises(ValueError, match="does not fit"):
        make_policy("kvzap").score(LayerKV(torch.randn(2, 5, 16), torch.randn(2, 5, 16)), RequestState(prompt_len=5))


def test_binding_fills_the_weights_and_adaptive_heads_leave_the_streaming_bound_open():
    policy = bind_profile(KVzap(ratio=0.5), TEST_PROFILES["kvzap"])
    assert policy.weights == TEST_PROFILES["kvzap"].weights and policy.bias == TEST_PROFILES["kvzap"].bias
    assert policy.heads == "adaptive" and policy.streaming_bound(100) is None
    assert KVzap(ratio=0.5, heads="uniform").streaming_bound(100) == 50
