"""POD: Appendix A.1 split attention (float64 exactness) and the training-free selection policy."""

from __future__ import annotations

import pytest
import torch

from vllm_kvcomp.calibration.profiles import (
    LayerGroupsProfile,
    ModelIdentity,
    ProfileError,
    bind_profile,
)
from vllm_kvcomp.params import SpecError
from vllm_kvcomp.policies.base import LayerKV, RequestState
from vllm_kvcomp.policies.compensation import attention_with_lse
from vllm_kvcomp.policies.pod import POD, pod_gate, proximal_masks, share_budget, split_attention
from vllm_kvcomp.spec import CompressionSpec

# ---------------------------------------------------------------------------- Appendix A.1


def test_proximal_masks_follow_eq3():
    prox, dist = proximal_masks(torch.tensor([3, 9]), torch.arange(10), start=2, recent=3)
    assert torch.nonzero(prox[0]).flatten().tolist() == [0, 1, 2, 3]
    assert not dist[0].any()
    assert torch.nonzero(prox[1]).flatten().tolist() == [0, 1, 7, 8, 9]
    assert torch.nonzero(dist[1]).flatten().tolist() == [2, 3, 4, 5, 6]


@pytest.mark.parametrize("start,recent", [(0, 1), (1, 4), (4, 16), (2, 64)])
def test_split_attention_with_own_scores_is_full_attention(start, recent):
    g = torch.Generator().manual_seed(start * 100 + recent)
    t, s, h, d = 24, 48, 4, 16
    q = torch.randn(t, h, d, generator=g, dtype=torch.float64) * 2
    k = torch.randn(s, h, d, generator=g, dtype=torch.float64)
    v = torch.randn(s, h, d, generator=g, dtype=torch.float64)
    q_pos = torch.arange(s - t, s)
    prox, dist = proximal_masks(q_pos, torch.arange(s), start, recent)
    out, gate = split_attention(q, k, v, d**-0.5, prox, dist)
    full, _ = attention_with_lse(q, k, v, d**-0.5, prox | dist)
    torch.testing.assert_close(out, full, rtol=1e-12, atol=1e-12)
    # the gate is the full softmax mass on the proximal tokens
    probs = torch.softmax(
        (torch.einsum("thd,shd->ths", q, k) * d**-0.5).masked_fill(~(prox | dist).unsqueeze(1), float("-inf")), -1
    )
    torch.testing.assert_close(gate, (probs * prox.unsqueeze(1)).sum(-1), rtol=1e-12, atol=1e-12)
    assert ((gate >= 0) & (gate <= 1)).all()


def test_split_attention_with_shared_scores_uses_them_for_distant_tokens_only():
    g = torch.Generator().manual_seed(5)
    t, s, h, d = 4, 20, 2, 8
    q, q_low = (torch.randn(t, h, d, generator=g, dtype=torch.float64) for _ in range(2))
    k, k_low, v = (torch.randn(s, h, d, generator=g, dtype=torch.float64) for _ in range(3))
    prox, dist = proximal_masks(torch.arange(s - t, s), torch.arange(s), 2, 4)
    out, gate = split_attention(q, k, v, 0.3, prox, dist, shared_q=q_low, shared_k=k_low)
    out_p, lse_p = attention_with_lse(q, k, v, 0.3, prox)
    out_d, lse_d = attention_with_lse(q_low, k_low, v, 0.3, dist)
    expected_gate = torch.exp(lse_p) / (torch.exp(lse_p) + torch.exp(lse_d))
    torch.testing.assert_close(gate, expected_gate, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out, gate.unsqueeze(-1) * out_p + (1 - gate.unsqueeze(-1)) * out_d)
    full, _ = attention_with_lse(q, k, v, 0.3, prox | dist)
    assert not torch.allclose(out, full, atol=1e-3)


def test_gate_without_distant_tokens_is_one():
    inf = float("-inf")
    gate = pod_gate(torch.tensor([0.5, inf, 1.0]), torch.tensor([inf, inf, 1.0]))
    assert gate.tolist() == [1.0, 1.0, 0.5]


# ---------------------------------------------------------------------------- the policy


def _layers(num_layers=4, n=64, h_kv=2, group=2, w=4, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [
        LayerKV(
            torch.randn(h_kv, n, d, generator=g),
            torch.randn(h_kv, n, d, generator=g),
            layer=i,
            num_layers=num_layers,
            queries=torch.randn(h_kv * group, w, d, generator=g),
        )
        for i in range(num_layers)
    ]


def _plant(kv: LayerKV, slots: list[int], strength: float = 6.0) -> None:
    """Make every window query of ``kv`` attend strongly to ``slots`` (same key direction)."""
    direction = torch.zeros(kv.keys.shape[-1])
    direction[0] = 1.0
    kv.keys[:, :, 0] = 0.0
    kv.keys[:, slots] = direction * strength
    kv.queries[:, :] = direction * strength


def test_proximal_always_kept_and_budget_respected():
    layers = _layers()
    policy = POD(ratio=0.5, sink=4, window=8, tau=1.0, observe=4)
    sels = policy.decide(layers, RequestState())
    for sel in sels:
        assert sel.counts().tolist() == [32, 32]
        for idx in sel.indices:
            assert set(range(4)) <= set(idx.tolist()) and set(range(56, 64)) <= set(idx.tolist())
            assert torch.equal(idx, torch.sort(idx).values)


def test_group_layers_keep_the_lowest_layers_distant_choice():
    layers = _layers()
    _plant(layers[0], [10, 20, 30])
    _plant(layers[1], [40, 41, 42])  # layer 1 would choose otherwise on its own
    policy = POD(groups=((0, 1), (2, 3)), budget=4 + 8 + 3, sink=4, window=8, tau=1.0, observe=4)
    sels = policy.decide(layers, RequestState())
    distant = lambda sel, h: [i for i in sel.indices[h].tolist() if 4 <= i < 56]  # noqa: E731
    for h in range(2):
        assert distant(sels[0], h) == [10, 20, 30]
        assert distant(sels[1], h) == [10, 20, 30]
    alone = POD(groups=None, budget=15, sink=4, window=8, tau=1.0, observe=4).decide(layers, RequestState())
    assert distant(alone[1], 0) == [40, 41, 42]
    # layers 2 and 3 share layer 2's ranking
    for h in range(2):
        assert torch.equal(sels[2].indices[h], sels[3].indices[h])


def test_gate_threshold_drops_all_distant_tokens():
    layers = _layers()
    keep_all = POD(ratio=0.5, sink=4, window=8, tau=1.0).decide(layers, RequestState())
    skip_all = POD(ratio=0.5, sink=4, window=8, tau=0.0).decide(layers, RequestState())
    assert all(s.counts().tolist() == [32, 32] for s in keep_all)
    expected = list(range(4)) + list(range(56, 64))
    for sel in skip_all:
        assert all(idx.tolist() == expected for idx in sel.indices)


def test_gate_is_decided_per_kv_head_from_its_query_group():
    layers = _layers(num_layers=1)
    kv = layers[0]
    # head 0: queries attend to a proximal key (gate ~ 1); head 1: to a distant key (gate ~ 0)
    kv.keys.zero_()
    kv.keys[0, 60, 0] = 20.0
    kv.keys[1, 30, 0] = 20.0
    kv.queries.zero_()
    kv.queries[:, :, 0] = 1.0
    state = RequestState()
    sel = POD(ratio=0.5, sink=4, window=8, tau=0.9).decide(layers, state)[0]
    assert sel.counts().tolist() == [12, 32 + (32 - 12)]  # head 0's unused budget goes to head 1
    assert 30 in sel.indices[1].tolist() and state.allotted == 52
    # on the engine's page grid (8-token pages) the skipping head holds its proximal tokens' pages
    # (12 -> 16) and the other the rest of the budget on the grid: 2 x 32 held, not 16 + 56
    on_pages = RequestState(page_quantum=(8, 64 % 8))
    sel = POD(ratio=0.5, sink=4, window=8, tau=0.9).decide(layers, on_pages)[0]
    assert sel.counts().tolist() == [16, 48] and on_pages.allotted == 48


def test_a_decode_recompression_decides_afresh_to_the_prompts_budget():
    """``decode=recompress``: the gates come from the newest queries and the mean returns to the
    prompt's budget (``budget`` stays the mean; were it the largest share, 52, that would be
    shared out again)."""
    layers = _layers(num_layers=1)
    kv = layers[0]
    kv.keys.zero_()
    kv.keys[0, 60, 0] = 20.0  # head 0 attends to a proximal key (skips), head 1 to a distant one
    kv.keys[1, 30, 0] = 20.0
    kv.queries.zero_()
    kv.queries[:, :, 0] = 1.0
    policy = POD(ratio=0.5, sink=4, window=8, tau=0.9, decode="recompress")
    state = RequestState(prompt_len=64)
    assert policy.decide(layers, state)[0].counts().tolist() == [12, 52]
    assert state.budget == 32 and state.allotted == 52
    kv.keys[0, 60, 0], kv.keys[0, 30, 0] = 0.0, 20.0  # now head 0 reads far back, head 1 near
    kv.keys[1, 30, 0], kv.keys[1, 60, 0] = 0.0, 20.0
    assert policy.decide(layers, state)[0].counts().tolist() == [52, 12] and state.budget == 32


def test_unused_budget_goes_to_the_heads_that_keep_distant_tokens():
    """``ratio`` is the mean over every (layer, head): skipping heads keep their proximal tokens,
    the rest share what they leave, the first in order one more where it does not divide."""
    assert share_budget([False, True, False, False], 20, 12) == [23, 12, 23, 22]
    assert share_budget([False] * 3, 20, 12) == [20] * 3
    assert share_budget([True] * 2, 20, 12) == [12, 12]  # nobody to give it to
    for skips in ([True, False], [True, True, False, False, True]):
        assert sum(share_budget(skips, 37, 5)) == 37 * len(skips)
    # on a page grid (16-token pages, residue 5): skipping heads hold 144 -> 149, the others share
    # 5 x 300 - 2 x 149 = 1202, snapped to the grid with the sum kept (389 + 16 for each here)
    skips = [False, True, False, False, True]
    on_pages = share_budget(skips, 300, 144, (16, 5), 2005)
    assert on_pages == [405, 149, 405, 405, 149]
    assert all(k % 16 == 5 for k in on_pages) and 0 <= sum(on_pages) - 300 * 5 < 16


def test_select_layer_and_sharded_groups_use_the_lowest_present_layer():
    layers = _layers()
    _plant(layers[1], [10, 11, 12])
    policy = POD(groups=((0, 1, 2, 3),), budget=15, sink=4, window=8, tau=1.0)
    sels = policy.decide(layers[1:3], RequestState())
    assert [i for i in sels[1].indices[0].tolist() if 4 <= i < 56] == [10, 11, 12]
    single = policy.decide([layers[1]], RequestState())[0]
    assert torch.equal(single.indices[0], sels[0].indices[0])


def test_spec_and_validation():
    policy = CompressionSpec.from_header("pod").build_policy()
    assert isinstance(policy, POD)
    assert (policy.ratio, policy.sink, policy.window, policy.tau, policy.observe) == (0.5, 16, 128, 0.9, 16)
    assert policy.queries_needed() == 16 and not POD.RECOMPRESSES
    assert CompressionSpec.from_header("pod; observe=4").build_policy().queries_needed() == 4
    with pytest.raises(SpecError) as err:
        CompressionSpec.from_header("pod; budget=10; sink=4; window=8")
    assert err.value.field == "budget"
    with pytest.raises(SpecError) as err:
        CompressionSpec.from_header("pod; tau=1.5")
    assert err.value.field == "tau"
    with pytest.raises(SpecError) as err:
        CompressionSpec.from_header("pod; observe=0")
    assert err.value.field == "observe"
    with pytest.raises(ProfileError, match="consecutive"):
        POD(groups=((0, 2), (1, 3))).decide(_layers(), RequestState())
    with pytest.raises(ProfileError):
        POD(groups=((0, 1),)).decide(_layers(), RequestState())
    no_queries = _layers(num_layers=1)
    no_queries[0].queries = None
    with pytest.raises(ValueError, match="queries"):
        POD().decide(no_queries, RequestState())


def test_bind_profile_fills_the_layer_groups():
    profile = LayerGroupsProfile(model=ModelIdentity("llama", 4, 4, 2, 8, "x"), groups=((0,), (1, 2, 3)))
    policy = POD()
    assert bind_profile(policy, profile).groups == ((0,), (1, 2, 3))
    assert policy.groups is None
