"""Invariants every registered policy (and each of its ``VARIANTS``) satisfies on random K/V and
queries, with the class's ``TEST_PARAMS``. Nothing here names a policy: a new one gets every
check. A policy's own rules (LagKV's eq. 10, the entropy layer budgets, ...) are in its own file."""

from __future__ import annotations

import itertools

import pytest
import torch

from tests.policies.conftest import (
    CASES,
    SHAPE_IDS,
    SHAPES,
    Compression,
    cases,
    compressions,
    keeps_budget_per_head,
    make_case,
    protected_slots,
    recompressing_cases,
)
from vllm_kvcomp.policies import base
from vllm_kvcomp.policies.base import Policy, RequestState, ScorePolicy, SlotMemory
from vllm_kvcomp.policies.registry import NO_COMPRESSION_WORDS

RECOMPRESSING = recompressing_cases()
PER_HEAD_BUDGET = cases(keeps_budget_per_head)


def check_counts(policy: Policy, done: Compression, first: bool) -> None:
    """The budget a compression fixes (``RequestState.budget``): a policy that fixed none kept
    everything; a per-head score policy keeps exactly ``min(budget, length)`` per head, then and
    in every recompression; at the ``first`` compression the heads a layer cuts (those not kept
    whole) keep at most the per-head budget between them, moved between heads or not, plus what
    the heads kept whole leave of theirs (those shorter than the budget)."""
    budget = done.state.budget
    for kv, sel in zip(done.layers, done.selections):
        counts, lengths = sel.counts().tolist(), kv.valid_lengths().tolist()
        if budget is None:
            assert counts == lengths, "no budget fixed, yet tokens were evicted"
        elif keeps_budget_per_head(policy):
            assert counts == [min(budget, length) for length in lengths]
        elif first:
            cut = [(c, n) for c, n in zip(counts, lengths) if c < n]
            left = sum(max(0, budget - n) for c, n in zip(counts, lengths) if c == n)
            assert sum(c for c, _ in cut) <= budget * len(cut) + left, (
                f"layer {kv.layer}: compressed heads keep (kept, live) {cut}, over the budget {budget} each")


def check_planning_bounds(policy: Policy, done: Compression) -> None:
    """What the scheduler plans a prompt-end compression by, every head having seen the whole
    prompt: ``mean_kept_bound`` (mean over every layer and head) and, for a policy that streams,
    ``streaming_bound`` (every head)."""
    prompt_len = done.state.prompt_len
    counts = torch.cat([sel.counts() for sel in done.selections]).float()
    mean_bound = policy.mean_kept_bound(prompt_len, num_heads=len(counts))
    if mean_bound is not None:
        assert float(counts.mean()) <= mean_bound + 1e-9, f"mean kept {float(counts.mean())} > {mean_bound}"
    stream_bound = policy.streaming_bound(prompt_len) if type(policy).STREAMS else None
    if stream_bound is not None:
        assert int(counts.max()) <= stream_bound, f"a head keeps {int(counts.max())} > {stream_bound}"


def check_protected(policy: Policy, done: Compression) -> None:
    """A score policy keeps its protected sink and window slots."""
    if not isinstance(policy, ScorePolicy):
        return
    for kv, sel in zip(done.layers, done.selections):
        sink, window = policy.protected_for(kv, done.state)
        for h, (idx, length) in enumerate(zip(sel.indices, kv.valid_lengths().tolist())):
            keep = min(int(done.state.budget), length)
            kept = set(protected_slots(length, kv.num_slots, keep, sink, window))
            assert kept <= set(idx.tolist()), f"head {h} lost a sink or window token"


def check_memory(done: Compression) -> None:
    """Per-slot memories remember kept tokens only (gathered with the selection): every kept
    token of a memory of values (H2O's scores), a subset of a memory of marks (pins)."""
    for kv, sel in zip(done.layers, done.selections):
        positions = kv.slot_positions()
        memory = done.state.layers.get(kv.layer)
        for value in vars(memory).values() if memory is not None else ():
            if not isinstance(value, SlotMemory):
                continue
            marks = bool(value.values[value.positions >= 0].eq(1).all())
            for h, idx in enumerate(sel.indices):
                remembered = value.positions[h][value.positions[h] >= 0]
                kept = positions[h, idx]
                if marks:
                    assert bool(torch.isin(remembered, kept).all()), "a pin memory remembers an evicted token"
                else:
                    assert torch.equal(remembered, kept), "slot memory not gathered to the kept slots"


def check_compression(policy: Policy, done: Compression, check_indices, first: bool = True) -> None:
    """Every check of one compression (the ``first`` of a request, or a recompression)."""
    assert len(done.selections) == len(done.layers)
    for kv, sel in zip(done.layers, done.selections):
        check_indices(kv, sel)
    check_counts(policy, done, first)
    check_protected(policy, done)
    check_memory(done)


@pytest.mark.parametrize(("n", "heads", "group", "ragged"), SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("case", CASES)
def test_selection_invariants(case, n, heads, group, ragged, fake_request, check_indices):
    policy = make_case(case)
    (done,) = compressions(policy, fake_request(n, heads, group, ragged=ragged, seed=n * 7 + heads))
    check_compression(policy, done, check_indices)
    if not ragged:
        check_planning_bounds(policy, done)


@pytest.mark.parametrize("case", CASES)
def test_test_params_make_short_prompts_compress(case, fake_request):
    """The matrix is not vacuous: with ``TEST_PARAMS`` the longest prompt loses tokens (but for
    the policy that never compresses)."""
    policy = make_case(case)
    request = fake_request(SHAPES[-1][0], 3, 3, seed=1)
    live = sum(sum(request.lengths(layer)) for layer in range(request.num_layers))
    (done,) = compressions(policy, request)
    kept = sum(int(sel.counts().sum()) for sel in done.selections)
    assert (kept == live) == (case[1] in NO_COMPRESSION_WORDS), f"kept {kept} of {live}"


@pytest.mark.parametrize(("n", "heads", "group", "ragged"), SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("case", PER_HEAD_BUDGET)
def test_score_policy_keeps_top_scores(case, n, heads, group, ragged, fake_request):
    """Kept = protected regions + the best scores of the rest (brute force, any tie order)."""
    policy = make_case(case)
    (done,) = compressions(policy, fake_request(n, heads, group, ragged=ragged, seed=n + 13 * heads + group))
    for kv, sel in zip(done.layers, done.selections):
        scores = policy.score(kv, RequestState(budget=done.state.budget)).float()
        sink, window = policy.protected_for(kv, done.state)
        lengths = kv.valid_lengths().tolist()
        for h, idx in enumerate(sel.indices):
            keep = min(int(done.state.budget), lengths[h])
            protected = set(protected_slots(lengths[h], kv.num_slots, keep, sink, window))
            middle = [s for s in range(kv.num_slots - lengths[h], kv.num_slots) if s not in protected]
            chosen = [s for s in idx.tolist() if s in set(middle)]
            dropped = [s for s in middle if s not in set(chosen)]
            assert len(chosen) == keep - len(protected)
            if chosen and dropped:
                worst_kept = min(float(scores[h, s]) for s in chosen)
                best_dropped = max(float(scores[h, s]) for s in dropped)
                assert worst_kept >= best_dropped, "dropped a better-scored slot"


@pytest.mark.parametrize("case", CASES)
def test_an_interval_means_recompression(case):
    policy = make_case(case)
    if "interval" in policy.accepted_params():  # by itself, or under decode=recompress
        assert policy.RECOMPRESSES or policy.CAN_RECOMPRESS, "an interval that never triggers a recompression"
    else:
        assert not (policy.CAN_RECOMPRESS and policy.PACED_BY_INTERVAL), "a recompression no interval can pace"


@pytest.mark.parametrize(("heads", "group", "ragged"), list(itertools.product((1, 3), (1, 3), (False, True))))
@pytest.mark.parametrize("case", RECOMPRESSING)
def test_decode_recompression(case, heads, group, ragged, fake_request, check_indices):
    """Decode: recompressions keep the budget of the first compression and every invariant."""
    policy = make_case(case)
    request = fake_request(40, heads, group, ragged=ragged, seed=heads * 5 + group)
    budgets = []
    for done in compressions(policy, request, decode_steps=40):
        budgets.append(done.state.budget)
        check_compression(policy, done, check_indices, first=len(budgets) == 1)
    assert len(budgets) >= 2, "never recompressed in 40 decode steps"
    assert set(budgets) == {budgets[0]}, "the per-head budget is fixed at the first compression"


def _check_on_page_grid(layers, selections, state: RequestState) -> None:
    block_size, residue = state.page_quantum
    for kv, sel in zip(layers, selections):
        for h, idx in enumerate(sel.indices):
            live = int(kv.valid_lengths()[h])
            assert len(idx) == live or len(idx) % block_size == residue, (
                f"layer {kv.layer} head {h}: {len(idx)} kept of {live}, not ≡ {residue} (mod {block_size})")


@pytest.mark.parametrize(("n", "group"), [(37, 1), (61, 3), (96, 3)])
@pytest.mark.parametrize("case", CASES)
def test_page_rounding_keeps_a_superset_on_the_page_grid(case, n, group, fake_request,
                                                         check_indices):
    """With the engine's page quantum every head keeps ≡ residue (mod bs) slots (or all), a
    superset of what it keeps without rounding, through decode recompressions too. Per-layer or
    per-head budgets (``budgets_on_pages()``) move onto the grid first with their sum kept: one
    may then keep less than without the grid, so for them the total over every layer and head is
    what is checked, at least the plain total and less than one page per head and layer above it
    (each policy's own tests pin its tighter bound)."""
    block_size = 8
    policy = make_case(case)
    plain = make_case(case).decide(fake_request(n, 2, group, seed=n).inputs(policy), RequestState(prompt_len=n))
    request = fake_request(n, 2, group, seed=n)
    state = RequestState(prompt_len=n, page_quantum=(block_size, n % block_size))
    layers = request.inputs(policy)
    selections = policy.decide(layers, state)
    _check_on_page_grid(layers, selections, state)
    if policy.budgets_on_pages():
        pairs = [(s, b, h) for s, b in zip(selections, plain) for h in range(len(b.indices))]
        extra = sum(len(s.indices[h]) - len(b.indices[h]) for s, b, h in pairs)
        assert 0 <= extra < block_size * len(pairs), f"{extra} more slots over {len(pairs)} heads than without the grid"
    else:
        for sel, base in zip(selections, plain):
            for idx, base_idx in zip(sel.indices, base.indices):
                assert set(base_idx.tolist()) <= set(idx.tolist()), "rounding dropped a chosen slot"
    request.apply(selections)
    steps_since = 0
    for _ in range(30):
        request.decode_step()
        steps_since += 1
        if policy.recompresses and policy.due(state, request.max_live(), steps_since):
            state.page_quantum = (block_size, request.next_position % block_size)
            layers = request.inputs(policy)
            selections = policy.decide(layers, state)
            for kv, sel in zip(layers, selections):
                check_indices(kv, sel)
            _check_on_page_grid(layers, selections, state)
            request.apply(selections)
            steps_since = 0


@pytest.mark.parametrize("case", CASES)
def test_a_window_attended_a_few_rows_at_a_time_keeps_what_the_whole_window_keeps(case, fake_request, monkeypatch):
    """Policies attend their query window WINDOW_ROWS queries at a time (what engine/memory.py
    bounds): in runs of 2 rows they keep exactly what they keep attending the window at once."""
    def kept() -> list[list[torch.Tensor]]:
        (done,) = compressions(make_case(case), fake_request(97, 3, 3, seed=5))
        if case[1] in ("snapkv", "h2o", "pod", "entropy"):  # those that attend the window in runs: it is cut
            assert done.layers[0].queries.shape[1] > 2
        return [sel.indices for sel in done.selections]

    whole = kept()
    monkeypatch.setattr(base, "WINDOW_ROWS", 2)
    for want, got in zip(whole, kept(), strict=True):
        assert all(torch.equal(w, g) for w, g in zip(want, got, strict=True))
