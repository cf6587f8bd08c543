"""``prefill=block``: every compression of the prompt decides afresh, as the prompt-end one does,
over the cache as it stands, with the chunk's own last queries and the whole prompt's budget.

KeyDiff's block-wise prefill (Park et al. 2025; kvpress ``BlockPress(KeyDiffPress)``) is the
method as its paper runs it: pinned here against a plain loop over its formula. The engine equals
the chunked oracle for every policy (tests/engine/test_streaming.py).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.policies.conftest import (
    FakeRequest,
    cases,
    keeps_budget_per_head,
    make_case,
    make_policy,
)
from vllm_kvcomp.policies.base import RequestState, ScorePolicy


def _blockwise(policy) -> bool:
    return policy.name != "full" and not policy.STREAMS


BLOCK_CASES = cases(_blockwise)


def prefix(request: FakeRequest, end: int) -> FakeRequest:
    """The first ``end`` tokens of ``request`` (every head, and the queries up to them)."""
    take = [[pos < end for pos in layer] for layer in request.positions]
    return FakeRequest(
        keys=[[k[m] for k, m in zip(layer, masks)] for layer, masks in zip(request.keys, take)],
        values=[[v[m] for v, m in zip(layer, masks)] for layer, masks in zip(request.values, take)],
        positions=[[p[m] for p, m in zip(layer, masks)] for layer, masks in zip(request.positions, take)],
        queries=[q[:, :end] for q in request.queries], query_positions=request.query_positions[:end],
        next_position=end, generator=request.generator, out_proj=request.out_proj,
    )


def extend(cache: FakeRequest, request: FakeRequest, end: int) -> FakeRequest:
    """``cache`` (what an earlier chunk kept) plus ``request``'s tokens from ``cache.next_position`` to ``end``."""
    new = [[(p >= cache.next_position) & (p < end) for p in layer] for layer in request.positions]

    def join(ours, theirs):
        return [[torch.cat([a, b[m]]) for a, b, m in zip(o, t, masks)] for o, t, masks in zip(ours, theirs, new)]

    return FakeRequest(
        keys=join(cache.keys, request.keys), values=join(cache.values, request.values),
        positions=join(cache.positions, request.positions),
        queries=[q[:, :end] for q in request.queries], query_positions=request.query_positions[:end],
        next_position=end, generator=request.generator, out_proj=request.out_proj,
    )


def block_prefill(policy, request: FakeRequest, chunk: int) -> FakeRequest:
    """``request``'s prompt compressed chunk by chunk as the engine and the oracle do it."""
    prompt = request.next_position
    state = RequestState(prompt_len=prompt, budget=policy.prefill_budget(prompt))
    cache = prefix(request, 0)
    for end in [*range(chunk, prompt, chunk), prompt]:
        cache = extend(cache, request, end)
        if end < prompt and not policy.stream_due(state, cache.max_live()):
            continue
        policy.start_prefill_compression(state)
        cache.apply(policy.decide(cache.inputs(policy, state), state))
    return cache


def keydiff_blockwise_reference(keys: torch.Tensor, budget: int, ends: list[int]) -> list[int]:
    """KeyDiff's block-wise prefill of one head's keys [P, D], in plain loops: after each block
    the cache is what was kept plus the block; its anchor is the mean of its unit keys, and the
    ``budget`` keys least cosine-similar to it stay (once the cache is over the budget)."""
    kept: list[int] = []
    start = 0
    for end in ends:
        cache = kept + list(range(start, end))
        start = end
        if len(cache) <= budget:
            kept = cache
            continue
        unit = [F.normalize(keys[i].double(), dim=0) for i in cache]
        anchor = F.normalize(torch.stack(unit).mean(0), dim=0)
        score = {i: -float(u @ anchor) for i, u in zip(cache, unit)}
        kept = sorted(sorted(cache, key=lambda i: (-score[i], i))[:budget])
    return kept


@pytest.mark.parametrize("chunk", [16, 25, 64])
@pytest.mark.parametrize("ratio", [0.25, 0.5])
def test_keydiff_block_prefill_is_the_papers_block_wise_prefill(chunk, ratio):
    request = FakeRequest.random(150, num_kv_heads=3, num_layers=2, dim=8, seed=chunk)
    policy = make_policy("keydiff", ratio=ratio, sink=0, window=0, prefill="block")
    cache = block_prefill(policy, request, chunk)
    budget = policy.target_budget(150)
    ends = [*range(chunk, 150, chunk), 150]
    for layer in range(request.num_layers):
        for head in range(3):
            expected = keydiff_blockwise_reference(request.keys[layer][head], budget, ends)
            assert cache.positions[layer][head].tolist() == expected, (layer, head)
    assert policy.stream_due(RequestState(budget=budget), budget + 1)  # no page grid here: due at once


@pytest.mark.parametrize("case", BLOCK_CASES)
def test_a_block_compression_forgets_the_earlier_ones(case):
    """After a first compression (its memory: pins, layer budgets, accumulators), a block
    compression of the next chunk decides what a new request's prompt-end compression of the same
    cache with the whole prompt's budget decides."""
    policy = make_case(case)
    policy.prefill = "block"
    request = FakeRequest.random(160, num_kv_heads=3, group=3, num_layers=2, dim=8, seed=3)
    state = RequestState(prompt_len=160)
    cache = prefix(request, 100)
    policy.start_prefill_compression(state)
    cache.apply(policy.decide(cache.inputs(policy, state), state))
    assert min(min(cache.lengths(layer)) for layer in range(2)) < 100  # it evicted: its memory is set
    cache = extend(cache, request, 160)
    policy.start_prefill_compression(state)
    again = policy.decide(cache.inputs(policy, state), state)
    fresh = policy.decide(cache.inputs(policy), RequestState(prompt_len=160))
    for a, b in zip(again, fresh):
        assert [x.tolist() for x in a.indices] == [x.tolist() for x in b.indices]


@pytest.mark.parametrize("case", cases(lambda p: _blockwise(p) and keeps_budget_per_head(p)))
def test_a_chunk_is_compressed_to_the_whole_prompts_budget(case):
    """A chunk of 100 tokens of a 400-token prompt keeps the 400-token prompt's budget per head."""
    policy = make_case(case)
    policy.prefill = "block"
    assert isinstance(policy, ScorePolicy)
    request = FakeRequest.random(100, num_kv_heads=2, group=2, num_layers=2, dim=8, seed=5)
    state = RequestState(prompt_len=400)
    policy.start_prefill_compression(state)
    for sel in policy.decide(request.inputs(policy, state), state):
        assert sel.counts().tolist() == [min(100, policy.target_budget(400))] * 2
    assert state.budget == policy.target_budget(400)
