"""KeyDiff: score = -cos(key, mean unit key of the head), against a plain float64 implementation."""

from __future__ import annotations

import math

import pytest
import torch

from tests.policies.conftest import make_policy
from vllm_kvcomp.params import SpecError
from vllm_kvcomp.policies.base import LayerKV, RequestState
from vllm_kvcomp.policies.keydiff import KeyDiff
from vllm_kvcomp.spec import CompressionSpec


def _plain_scores(keys: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """Per head: a = mean of k/||k|| over the live (right-aligned) keys; score = -k·a/(||k|| ||a||)."""
    heads, n, _ = keys.shape
    out = torch.zeros(heads, n, dtype=torch.float64)
    for h in range(heads):
        live = range(n - lengths[h], n)
        anchor = sum(keys[h, i] / math.sqrt(float(keys[h, i] @ keys[h, i])) for i in live) / lengths[h]
        for i in live:
            norms = math.sqrt(float(keys[h, i] @ keys[h, i]) * float(anchor @ anchor))
            out[h, i] = -float(keys[h, i] @ anchor) / norms
    return out


def test_score_is_negative_cosine_to_the_mean_unit_key_of_the_live_keys():
    gen = torch.Generator().manual_seed(3)
    keys = torch.randn(3, 11, 5, generator=gen, dtype=torch.float64) + 0.7  # a shared direction
    lengths = [11, 6, 1]
    kv = LayerKV(keys, torch.randn(3, 11, 5, generator=gen, dtype=torch.float64), lengths=torch.tensor(lengths))
    scores = KeyDiff().score(kv, RequestState())
    expected = _plain_scores(keys, lengths)  # padding slots hold random keys: the anchor must skip them
    for h, length in enumerate(lengths):
        assert torch.allclose(scores[h, 11 - length:], expected[h, 11 - length:], rtol=0, atol=1e-12)


def test_keeps_the_keys_least_like_the_others_whatever_their_norm():
    """Nine keys near e0 (one of them 100x longer), one along e1, one against e0: the two odd
    directions are kept; the long key is not (KNorm would rank it by its norm)."""
    keys = torch.zeros(1, 11, 3, dtype=torch.float64)
    keys[0, :9, 0] = 1.0
    keys[0, :9, 2] = torch.linspace(-0.1, 0.1, 9, dtype=torch.float64)
    keys[0, 4] *= 100.0
    keys[0, 9] = torch.tensor([0.0, 1.0, 0.0])
    keys[0, 10] = torch.tensor([-1.0, 0.0, 0.0])
    kv = LayerKV(keys, torch.ones(1, 11, 3, dtype=torch.float64))
    (selection,) = KeyDiff(budget=2).decide([kv], RequestState())
    assert selection.indices[0].tolist() == [9, 10]
    scaled = KeyDiff().score(kv, RequestState())
    keys[0, 4] /= 100.0
    assert float(scaled[0, 4]) == pytest.approx(float(KeyDiff().score(kv, RequestState())[0, 4]), abs=1e-12)


def test_sink_and_window_are_kept(fake_request):
    policy = make_policy("keydiff", ratio=0.25, sink=3, window=5)
    request = fake_request(40, 2, 1, seed=4)
    for sel in policy.decide(request.layers(0), RequestState(prompt_len=40)):
        for idx in sel.indices:
            assert {0, 1, 2, 35, 36, 37, 38, 39} <= set(idx.tolist()) and len(idx) == 10


def test_prefill_stream_is_refused_the_anchor_depends_on_the_whole_cache():
    with pytest.raises(SpecError) as err:
        CompressionSpec.from_mapping({"policy": "keydiff", "prefill": "stream"})
    assert err.value.field == "prefill"
