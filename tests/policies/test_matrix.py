"""Invariants every policy in POLICY_NAMES must satisfy on random K/V/queries."""

from __future__ import annotations

import itertools

import pytest
import torch

from vllm_kvcomp.policies.base import RequestState, ScorePolicy, SlotMemory
from vllm_kvcomp.policies.entropy import split_layer_budget
from vllm_kvcomp.policies.lagkv import lagkv_retained
from vllm_kvcomp.policies.registry import POLICY_NAMES, get_policy_class

EQUAL_BUDGET = ("streamingllm", "snapkv", "h2o", "knorm", "sagekv")
SHAPES = list(itertools.product((1, 7, 40, 97), (1, 3), (1, 3), (False, True)))
SHAPE_IDS = [f"n{n}-h{h}-g{g}-{'ragged' if r else 'equal'}" for n, h, g, r in SHAPES]


SCORE_POLICIES = [name for name in POLICY_NAMES if issubclass(get_policy_class(name), ScorePolicy)]


def _protected_slots(length: int, n: int, keep: int, sink: int, window: int) -> tuple[list[int], list[int]]:
    """(sink slots, window slots) a head of ``length`` live slots must keep out of ``keep``."""
    start = n - length
    s = min(sink, keep)
    w = min(window, keep - s)
    return list(range(start, start + s)), list(range(n - w, n))


def _check_protected(policy, name: str, kv, sel, state: RequestState, totals=None) -> None:
    """Sink and window slots kept; ``totals`` = tokens each head has seen (LagKV's grid)."""
    lengths = kv.valid_lengths().tolist()
    totals = totals or lengths
    n = kv.num_slots
    memory = state.layer(kv.layer)
    for h, idx in enumerate(sel.indices):
        kept = set(idx.tolist())
        length = lengths[h]
        if isinstance(policy, ScorePolicy):
            sink, window = policy.protected_for(kv, state)
            keep = min(int(state.budget), length)
        elif name == "lagkv":
            sink = policy.sink
            rest = totals[h] - sink
            window = policy.lag + rest % policy.lag if rest >= 2 * policy.lag else length
            keep = length
        elif name == "entropy":
            sink, _, window = split_layer_budget(memory["budget"])
            keep = min(memory["budget"], length)
        else:
            continue
        sinks, recent = _protected_slots(length, n, keep, sink, window)
        assert set(sinks) <= kept, f"{name}: head {h} lost a sink token"
        assert set(recent) <= kept, f"{name}: head {h} lost a window token"


def _check_counts(policy, name: str, kv, sel, state: RequestState, totals=None) -> None:
    counts = sel.counts().tolist()
    lengths = kv.valid_lengths().tolist()
    totals = totals or lengths
    if name == "full":
        assert counts == lengths
    elif name in EQUAL_BUDGET:
        assert counts == [min(int(state.budget), length) for length in lengths]
    elif name == "lagkv":
        assert counts == [lagkv_retained(total, policy.sink, policy.lag, policy.ratio) for total in totals]
    elif name == "entropy":
        budget = state.layer(kv.layer)["budget"]
        assert counts == [min(budget, length) for length in lengths]


def _check_memory(kv, sel, state: RequestState) -> None:
    """Per-slot memories hold exactly the kept tokens' positions (gathered with the selection)."""
    positions = kv.slot_positions()
    for value in state.layer(kv.layer).values():
        if not isinstance(value, SlotMemory):
            continue
        for h, idx in enumerate(sel.indices):
            remembered = value.positions[h][value.positions[h] >= 0]
            assert torch.equal(remembered, positions[h, idx]), "slot memory not gathered to the kept slots"


@pytest.mark.parametrize(("n", "heads", "group", "ragged"), SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("name", POLICY_NAMES)
def test_selection_invariants(name, n, heads, group, ragged, make_policy, fake_request, check_indices):
    policy = make_policy(name)
    request = fake_request(n, heads, group, ragged=ragged, seed=n * 7 + heads)
    layers = request.layers(policy.queries_needed())
    state = RequestState(prompt_len=n)
    selections = policy.select(layers, state)
    assert len(selections) == len(layers)
    for kv, sel in zip(layers, selections):
        check_indices(kv, sel)
        _check_counts(policy, name, kv, sel, state)
        _check_protected(policy, name, kv, sel, state)
        _check_memory(kv, sel, state)
    if name == "entropy" and not ragged:
        for sel in selections:
            assert all(torch.equal(sel.indices[0], idx) for idx in sel.indices), "entropy: heads differ"


@pytest.mark.parametrize(("n", "heads", "group", "ragged"), SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("name", SCORE_POLICIES)
def test_score_policy_keeps_top_scores(name, n, heads, group, ragged, make_policy, fake_request):
    """Kept = protected regions + the best scores of the rest (brute force, any tie order)."""
    policy = make_policy(name)
    request = fake_request(n, heads, group, ragged=ragged, seed=n + 13 * heads + group)
    layers = request.layers(policy.queries_needed())
    state = RequestState(prompt_len=n)
    selections = policy.select(layers, state)
    for kv, sel in zip(layers, selections):
        scores = policy.score(kv, RequestState(budget=state.budget)).float()
        sink, window = policy.protected_for(kv, state)
        lengths = kv.valid_lengths().tolist()
        for h, idx in enumerate(sel.indices):
            keep = min(int(state.budget), lengths[h])
            sinks, recent = _protected_slots(lengths[h], kv.num_slots, keep, sink, window)
            middle = [s for s in range(kv.num_slots - lengths[h], kv.num_slots) if s not in set(sinks + recent)]
            chosen = [s for s in idx.tolist() if s in set(middle)]
            dropped = [s for s in middle if s not in set(chosen)]
            assert len(chosen) == keep - len(sinks) - len(recent)
            if chosen and dropped:
                worst_kept = min(float(scores[h, s]) for s in chosen)
                best_dropped = max(float(scores[h, s]) for s in dropped)
                assert worst_kept >= best_dropped, f"{name}: dropped a better-scored slot"


RECOMPRESSING = [name for name in POLICY_NAMES if name not in ("razor", "pod", "full")]


@pytest.mark.parametrize(("heads", "group", "ragged"), list(itertools.product((1, 3), (1, 3), (False, True))))
@pytest.mark.parametrize("name", RECOMPRESSING)
def test_decode_recompression(name, heads, group, ragged, make_policy, fake_request, check_indices):
    """Decode: recompressions return to the budget and state stays gathered to the kept slots."""
    policy = make_policy(name)
    if not policy.RECOMPRESSES:
        assert not getattr(policy, "interval", None), f"{name} has an interval but never recompresses"
        return
    request = fake_request(40, heads, group, ragged=ragged, seed=heads * 5 + group)
    prompt_lengths = [request.lengths(layer) for layer in range(request.num_layers)]
    window = policy.queries_needed()
    state = RequestState(prompt_len=40)
    request.apply(policy.select(request.layers(window), state))
    budget = state.budget
    recompressions = 0
    steps_since = 0
    for step in range(1, 41):
        request.decode_step()
        steps_since += 1
        if not policy.due(state, request.max_live(), steps_since):
            continue
        layers = request.layers(window)
        selections = policy.select(layers, state)
        assert state.budget == budget, "the per-head budget is fixed at the first compression"
        for kv, sel in zip(layers, selections):
            totals = [length + step for length in prompt_lengths[kv.layer]]
            check_indices(kv, sel)
            _check_counts(policy, name, kv, sel, state, totals)
            _check_protected(policy, name, kv, sel, state, totals)
            _check_memory(kv, sel, state)
        request.apply(selections)
        recompressions += 1
        steps_since = 0
    assert recompressions >= 1, f"{name} never recompressed in 40 decode steps"


PAGED = [*POLICY_NAMES, "snapkv-adaptive"]


def _paged_policy(name: str, make_policy):
    return make_policy("snapkv", heads="adaptive") if name == "snapkv-adaptive" else make_policy(name)


def _check_on_page_grid(layers, selections, state: RequestState) -> None:
    block_size, residue = state.page_quantum
    for kv, sel in zip(layers, selections):
        for h, idx in enumerate(sel.indices):
            live = int(kv.valid_lengths()[h])
            assert len(idx) == live or len(idx) % block_size == residue, (
                f"layer {kv.layer} head {h}: {len(idx)} kept of {live}, not ≡ {residue} (mod {block_size})")


@pytest.mark.parametrize(("n", "group"), [(37, 1), (61, 3), (96, 3)])
@pytest.mark.parametrize("name", PAGED)
def test_page_rounding_keeps_a_superset_on_the_page_grid(name, n, group, make_policy, fake_request,
                                                         check_indices):
    """With the engine's page quantum every head keeps ≡ residue (mod bs) slots (or all), a
    superset of what it keeps without rounding, through decode recompressions too."""
    block_size = 8
    window = _paged_policy(name, make_policy).queries_needed()
    plain = _paged_policy(name, make_policy).select(fake_request(n, 2, group, seed=n).layers(window),
                                                   RequestState(prompt_len=n))
    policy = _paged_policy(name, make_policy)
    request = fake_request(n, 2, group, seed=n)
    state = RequestState(prompt_len=n, page_quantum=(block_size, n % block_size))
    layers = request.layers(window)
    selections = policy.select(layers, state)
    _check_on_page_grid(layers, selections, state)
    for sel, base in zip(selections, plain):
        for idx, base_idx in zip(sel.indices, base.indices):
            assert set(base_idx.tolist()) <= set(idx.tolist()), f"{name}: rounding dropped a chosen slot"
    request.apply(selections)
    steps_since = 0
    for _ in range(30):
        request.decode_step()
        steps_since += 1
        if policy.RECOMPRESSES and policy.due(state, request.max_live(), steps_since):
            state.page_quantum = (block_size, request.next_position % block_size)
            layers = request.layers(window)
            selections = policy.select(layers, state)
            for kv, sel in zip(layers, selections):
                check_indices(kv, sel)
            _check_on_page_grid(layers, selections, state)
            request.apply(selections)
            steps_since = 0
