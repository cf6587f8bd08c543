"""Entropy-guided layer budgets: allocation, shared token set, decode."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.policies.conftest import SHAPE_IDS, SHAPES, compressions, make_policy, protected_slots
from vllm_kvcomp.policies.base import LayerKV, RequestState
from vllm_kvcomp.policies.entropy import (
    EntropyBudget,
    EntropyMemory,
    entropy_budgets,
    row_entropies,
    split_layer_budget,
)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.floats(0.0, 10.0), min_size=1, max_size=12),
    st.integers(1, 500),
    st.floats(0.0, 1.0),
    st.floats(1.0, 8.0),
)
def test_budgets_average_to_target_within_bounds_and_monotone(entropies, target, min_ratio, max_ratio):
    budgets = entropy_budgets(entropies, target, min_ratio, max_ratio)
    low = math.ceil(min_ratio * target - 1e-9)
    high = math.floor(max_ratio * target + 1e-9)
    assert len(budgets) == len(entropies)
    assert sum(budgets) == target * len(entropies)
    assert all(low <= b <= high for b in budgets)
    order = sorted(range(len(entropies)), key=lambda i: entropies[i])
    for a, b in itertools.pairwise(order):
        assert budgets[a] <= budgets[b] or (entropies[a] == entropies[b] and budgets[a] - budgets[b] <= 1)


def test_budgets_are_proportional_when_unclipped():
    assert entropy_budgets([1.0, 2.0, 3.0], 100, 0.0, 10.0) == [50, 100, 150]


def test_budgets_clip_and_redistribute():
    # proportional would be [10, 10, 280]; max 2x -> 200, the rest goes to the others evenly
    assert entropy_budgets([1.0, 1.0, 28.0], 100, 0.0, 2.0) == [50, 50, 200]
    assert entropy_budgets([0.0, 5.0], 10, 0.5, 2.0) == [5, 15]


def test_equal_entropies_give_the_uniform_budget():
    assert entropy_budgets([2.5] * 4, 37, 0.25, 2.0) == [37] * 4


def test_split_layer_budget():
    assert split_layer_budget(10) == (1, 5, 4)
    assert split_layer_budget(3) == (1, 1, 1)
    assert split_layer_budget(2) == (0, 1, 1)
    assert split_layer_budget(1) == (0, 0, 1)


def attention_entropy(logits: torch.Tensor) -> tuple[torch.Tensor, float]:
    """Softmax and mean row entropy over the rows with a visible key (one rank)."""
    probs, total, count = row_entropies(logits)
    return probs, total / count if count else 0.0


def test_attention_entropy_uniform_one_hot_and_empty():
    n, hidden = 16, float("-inf")
    probs, value = attention_entropy(torch.zeros(2, 3, n))
    assert value == pytest.approx(math.log(n))
    torch.testing.assert_close(probs, torch.full((2, 3, n), 1.0 / n))
    one_hot = torch.full((2, 3, n), hidden)
    one_hot[..., 4] = 3.0
    probs, value = attention_entropy(one_hot)
    assert value == pytest.approx(0.0)
    assert probs[..., 4].eq(1.0).all() and probs.sum() == 6.0
    empty = torch.full((1, 2, n), hidden)
    empty[0, 0, :2] = 0.0  # one row sees two keys (entropy log 2), the other none (ignored)
    probs, value = attention_entropy(empty)
    assert value == pytest.approx(math.log(2))
    assert probs[0, 1].eq(0.0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_attention_entropy_equals_softmax_and_p_log_p(dtype):
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 5, 40, generator=gen, dtype=dtype) * 4
    logits[torch.rand(4, 5, 40, generator=gen) < 0.3] = float("-inf")
    logits[1, 2] = float("-inf")  # an empty row
    expected = torch.softmax(logits, dim=-1).nan_to_num(0.0)
    rows = -torch.special.xlogy(expected, expected).sum(-1)
    probs, value = attention_entropy(logits.clone())
    torch.testing.assert_close(probs, expected)
    live = expected.sum(-1) > 0
    assert value == pytest.approx(float(rows[live].mean()), rel=1e-5)


def _layers(n: int = 64, heads: int = 2, dim: int = 8) -> list[LayerKV]:
    """Layer 0: flat attention (queries 0 -> max entropy); layer 1: sharp attention on a few keys."""
    gen = torch.Generator().manual_seed(0)
    keys = torch.randn(heads, n, dim, generator=gen)
    values = torch.randn(heads, n, dim, generator=gen)
    flat = LayerKV(keys, values, layer=0, num_layers=2, queries=torch.zeros(heads, 4, dim))
    sharp_q = keys[:, [10, 20, 30, 40]] * 20  # each query points at one key, strongly
    sharp = LayerKV(keys.clone(), values.clone(), layer=1, num_layers=2, queries=sharp_q)
    return [flat, sharp]


def test_flat_layer_gets_more_budget_and_mean_is_target():
    layers = _layers()
    policy = EntropyBudget(ratio=0.25, window=4)
    state = RequestState()
    selections = policy.decide(layers, state)
    counts = [sel.counts()[0].item() for sel in selections]
    assert counts[0] > counts[1]
    assert sum(counts) == 2 * policy.kept_for(64)
    assert state.budget == max(counts)


def test_shared_set_is_sink_top_and_recent():
    layers = _layers()
    policy = EntropyBudget(ratio=0.25, window=4, min_ratio=0.75)
    selections = policy.decide(layers, RequestState())
    kv, sel = layers[1], selections[1]
    budget = len(sel.indices[0])
    sink, top, recent = split_layer_budget(budget)
    # independent aggregated attention: softmax of every window query (causal) summed over heads
    logits = torch.einsum("hwd,hnd->hwn", kv.queries, kv.keys) * kv.keys.shape[-1] ** -0.5
    qpos = torch.arange(64 - 4, 64)
    logits = logits.masked_fill(torch.arange(64).view(1, 1, -1) > qpos.view(1, -1, 1), float("-inf"))
    shared = logits.softmax(-1).sum((0, 1))
    middle = shared[sink : 64 - recent]
    expected = set(range(sink)) | {sink + int(i) for i in middle.topk(top).indices} | set(range(64 - recent, 64))
    for idx in sel.indices:
        assert set(idx.tolist()) == expected
    assert top >= 4 and {10, 20, 30, 40} <= expected  # the sharply attended keys


def test_decode_slides_recent_and_keeps_pinned():
    layers = _layers()
    policy = EntropyBudget(ratio=0.25, window=4, interval=5)
    state = RequestState()
    selections = policy.decide(layers, state)
    grown = []
    kept_before = []
    for kv, sel in zip(layers, selections):
        idx = sel.indices[0]
        kept_before.append(idx.tolist())
        keys = torch.cat([kv.keys[:, idx], torch.randn(2, 5, 8)], 1)
        values = torch.cat([kv.values[:, idx], torch.randn(2, 5, 8)], 1)
        pos = torch.cat([idx, torch.arange(64, 69)]).expand(2, -1)
        grown.append(LayerKV(keys, values, layer=kv.layer, num_layers=2, positions=pos))
    assert policy.due(state, max(g.num_slots for g in grown), 5)
    for g, sel, before in zip(grown, policy.decide(grown, state), kept_before):
        budget = len(before)
        sink, top, recent = split_layer_budget(budget)
        kept = g.slot_positions()[0, sel.indices[0]].tolist()
        assert len(kept) == budget
        assert kept[: sink + top] == before[: sink + top]
        assert kept[sink + top :] == list(range(69 - recent, 69))


@pytest.mark.parametrize(("n", "heads", "group", "ragged"), SHAPES, ids=SHAPE_IDS)
def test_every_head_keeps_its_layer_budget_with_sink_and_recent(n, heads, group, ragged, fake_request,
                                                                check_indices):
    """On the shared shapes, at the prompt's end and in every decode recompression: each head
    keeps ``min(layer budget, length)`` with the budget's sink and recent window; heads of equal
    length keep the same slots."""
    policy = make_policy("entropy")
    request = fake_request(n, heads, group, ragged=ragged, seed=n * 7 + heads)
    for done in compressions(policy, request, decode_steps=40):
        for kv, sel in zip(done.layers, done.selections):
            check_indices(kv, sel)
            budget = done.state.layer(kv.layer, EntropyMemory).budget
            sink, _, recent = split_layer_budget(budget)
            lengths = kv.valid_lengths().tolist()
            assert sel.counts().tolist() == [min(budget, length) for length in lengths]
            for idx, length in zip(sel.indices, lengths):
                keep = min(budget, length)
                assert set(protected_slots(length, kv.num_slots, keep, sink, recent)) <= set(idx.tolist())
            if not ragged:
                assert all(torch.equal(sel.indices[0], idx) for idx in sel.indices), "heads differ"


@pytest.mark.parametrize(("ratio", "n"), [(0.5, 200), (0.25, 200), (0.125, 333), (0.25, 1000)])
def test_the_request_holds_the_ratio_within_a_page(ratio, n):
    """Issue #28: ``ratio`` is the mean kept fraction over every layer and head. Six layers whose
    attention runs from flat to sharp get unequal budgets (clipped to [0.25, 2]·B) that sum to
    6·B, B = ceil(ratio·N); on 32-token pages the mean held is within one page of B."""
    gen = torch.Generator().manual_seed(n)
    heads, dim, window = 2, 8, 8
    layers = []
    for layer in range(6):
        keys, values = torch.randn(heads, n, dim, generator=gen), torch.randn(heads, n, dim, generator=gen)
        queries = keys[:, torch.randint(0, n, (window,), generator=gen)] * layer  # sharper with depth
        layers.append(LayerKV(keys, values, layer=layer, num_layers=6, queries=queries))
    policy = EntropyBudget(ratio=ratio, window=window)
    budget = policy.kept_for(n)
    plain = torch.cat([sel.counts() for sel in policy.decide(layers, RequestState(prompt_len=n))])
    assert len(set(plain.tolist())) > 2, "the layers did not get different budgets"
    assert int(plain.sum()) == budget * 6 * heads
    assert policy.mean_kept_bound(n, num_heads=6 * heads) == budget
    state = RequestState(prompt_len=n, page_quantum=(32, n % 32))
    paged = torch.cat([sel.counts() for sel in policy.decide(layers, state)]).float()
    assert budget <= float(paged.mean()) < budget + 32
    assert abs(float(paged.mean()) / n - ratio) <= 32 / n
