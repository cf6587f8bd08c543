"""POD layer grouping: JS similarity, Algorithm 1, planted groups recovered."""

from __future__ import annotations

import pytest
import torch

from vllm_kvcomp.calibration import layer_groups as lg
from vllm_kvcomp.calibration.profiles import ModelIdentity

PLANTED = ((0, 1, 2), (3, 4), (5,), (6, 7))
L, HQ = 8, 4


def test_js_divergence_bounds_and_symmetry():
    p = torch.tensor([[0.5, 0.5, 0.0], [1.0, 0.0, 0.0]], dtype=torch.float64)
    q = torch.tensor([[0.5, 0.5, 0.0], [0.0, 0.0, 1.0]], dtype=torch.float64)
    js = lg.js_divergence(p, q)
    torch.testing.assert_close(js, torch.tensor([0.0, 1.0], dtype=torch.float64))
    r = torch.softmax(torch.randn(5, 7, dtype=torch.float64), -1)
    s = torch.softmax(torch.randn(5, 7, dtype=torch.float64), -1)
    torch.testing.assert_close(lg.js_divergence(r, s), lg.js_divergence(s, r))
    assert ((lg.js_divergence(r, s) > 0) & (lg.js_divergence(r, s) < 1)).all()


def test_greedy_groups_is_algorithm_1():
    sim = torch.tensor(
        [
            [1.0, 0.9, 0.6, 0.1],
            [0.9, 1.0, 0.8, 0.2],
            [0.6, 0.8, 1.0, 0.9],
            [0.1, 0.2, 0.9, 1.0],
        ]
    )
    assert lg.greedy_groups(sim, 0.5) == ((0, 1, 2), (3,))  # 3 is close to 2 but not to 0
    assert lg.greedy_groups(sim, 0.7) == ((0, 1), (2, 3))
    assert lg.greedy_groups(sim, 0.0) == ((0, 1, 2, 3),)
    assert lg.greedy_groups(sim, 1.0) == ((0,), (1,), (2,), (3,))
    with pytest.raises(ValueError, match="delta"):
        lg.greedy_groups(sim, 1.5)


def test_pseudo_text_is_deterministic_and_seeded():
    a, b, c = lg.pseudo_text(200, 1), lg.pseudo_text(200, 1), lg.pseudo_text(200, 2)
    assert a == b and a != c
    assert 200 <= len(a.split()) < 230 and a[0].isupper() and a.endswith(".")


def _group_provider(noise: float):
    """Layers of a planted group share a peaky attention pattern (per head) up to small noise."""
    g = torch.Generator().manual_seed(0)

    def provider(ids: torch.Tensor, on_layer) -> None:
        t = len(ids)
        causal = torch.ones(t, t, dtype=torch.bool).tril()
        for group in PLANTED:
            base = torch.randn(HQ, t, t, generator=g) * 4
            for layer in group:
                logits = base + noise * torch.randn(HQ, t, t, generator=g)
                on_layer(layer, torch.softmax(logits.masked_fill(~causal, float("-inf")), -1))

    return provider


def test_planted_groups_are_recovered():
    ident = ModelIdentity("llama", L, HQ, 2, 8, "t")
    sequences = [torch.arange(40), torch.arange(48)]
    profile = lg.calibrate_layer_groups(_group_provider(0.2), ident, sequences, delta=0.5, last=8, progress=False)
    assert profile.groups == PLANTED
    sim = torch.tensor(profile.similarity)
    assert torch.allclose(sim, sim.T) and torch.allclose(sim.diagonal(), torch.ones(L))
    assert sim[0, 1] > 0.9 and sim[2, 3] < 0.5
    profile.validate()
    assert profile.settings["last"] == 8 and profile.settings["samples"] == 2


def test_layer_similarity_requires_all_layers():
    def partial(ids, on_layer):
        on_layer(0, torch.ones(HQ, len(ids), len(ids)) / len(ids))

    with pytest.raises(RuntimeError, match="reported layers"):
        lg.layer_similarity(partial, [torch.arange(5)], L, HQ, last=2, progress=False)
    with pytest.raises(ValueError, match="at least one"):
        lg.calibrate_layer_groups(partial, ModelIdentity("llama", L, HQ, 2, 8, "t"), [], progress=False)
