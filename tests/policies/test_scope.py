"""``scope=context``: every policy compresses the context only, scored with the context's own
queries, and keeps the question after it: the kept set of a context does not depend on the
question (issue #27 item 2). The query windows are the engine's (:class:`QueryWindow` with the
context's end as its limit), fed every prompt query in chunks as the engine feeds them."""

from __future__ import annotations

import pytest
import torch

from tests.policies.conftest import CASES, FakeRequest, make_policy
from vllm_kvcomp.engine.state import QueryWindow
from vllm_kvcomp.params import SpecError
from vllm_kvcomp.policies.base import LayerKV, Policy, RequestState, Selection
from vllm_kvcomp.spec import CompressionSpec

CONTEXT = 45
BLOCK = 8
CHUNK = 16  # prefill chunk the query windows are fed by


def ask(request: FakeRequest, tokens: int, seed: int) -> FakeRequest:
    """``request`` cut to its first CONTEXT tokens, then a random ``tokens``-token question."""
    gen = torch.Generator().manual_seed(seed)
    for layer in range(request.num_layers):
        for h in range(len(request.keys[layer])):
            dim = request.keys[layer][h].shape[-1]
            request.keys[layer][h] = torch.cat([request.keys[layer][h][:CONTEXT], torch.randn(tokens, dim, generator=gen) * 2])
            request.values[layer][h] = torch.cat([request.values[layer][h][:CONTEXT], torch.randn(tokens, dim, generator=gen)])
            request.positions[layer][h] = torch.arange(CONTEXT + tokens)
        q = request.queries[layer][:, :CONTEXT]
        request.queries[layer] = torch.cat([q, torch.randn(q.shape[0], tokens, q.shape[2], generator=gen) * 2], 1)
    request.query_positions = torch.arange(CONTEXT + tokens)
    request.next_position = CONTEXT + tokens
    return request


def engine_inputs(policy: Policy, request: FakeRequest) -> list[LayerKV]:
    """Every layer as the worker gives it at the prompt's end: the window holds the last queries
    before the context's end, pushed chunk by chunk."""
    n = request.next_position
    layers = request.inputs(policy)
    for layer, kv in enumerate(layers):
        window = QueryWindow(policy.queries_needed(), limit=policy.context_end(n))
        for start in range(0, n, CHUNK):
            end = min(start + CHUNK, n)
            window.push(request.queries[layer][:, start:end].transpose(0, 1), start)
        kv.queries = None if window.queries is None else window.queries.transpose(0, 1)
        kv.query_positions = window.positions
    return layers


def decide(policy: Policy, request: FakeRequest) -> tuple[list[Selection], list[LayerKV]]:
    n = request.next_position
    state = RequestState(prompt_len=policy.context_end(n))
    state.page_quantum = (BLOCK, n % BLOCK)
    layers = engine_inputs(policy, request)
    return policy.decide(layers, state), layers


@pytest.mark.parametrize("case", CASES)
def test_kept_context_does_not_depend_on_the_question(case):
    kept, evicted = [], False
    for question, seed in ((11, 1), (26, 2)):
        policy = make_policy(case[1], **case[2], scope="context", context_tokens=CONTEXT)
        request = ask(FakeRequest.random(CONTEXT + 30, num_kv_heads=3, group=2, seed=0), question, seed)
        n = request.next_position
        selections, _ = decide(policy, request)
        context_kept = []
        for sel in selections:
            for idx in sel.indices:
                assert idx[idx >= CONTEXT].tolist() == list(range(CONTEXT, n)), "the question is not kept whole"
                assert len(idx) == n or len(idx) % BLOCK == n % BLOCK, "off the page grid"
                context_kept.append(idx[idx < CONTEXT].tolist())
                evicted |= len(context_kept[-1]) < CONTEXT
            compensation = sel.compensation
            if compensation is not None:
                context_kept.append(compensation.counts.tolist())
        kept.append(context_kept)
        assert not policy.recompresses
    assert kept[0] == kept[1]
    assert evicted or not CompressionSpec(policy=case[1]).compresses, "the context was not compressed"


def test_window_keeps_the_last_queries_before_the_context_end():
    window = QueryWindow(4, limit=10)
    for start in range(0, 16, 3):
        window.push(torch.full((3, 2, 1), float(start)), start)
    assert window.positions.tolist() == [6, 7, 8, 9]


def test_scope_settings_are_checked():
    spec = CompressionSpec.from_mapping({"policy": "snapkv", "scope": "context", "context_tokens": 100})
    assert spec.build_policy().context_end(80) == 80 and spec.build_policy().context_end(300) == 100
    assert CompressionSpec.from_mapping({"policy": "snapkv", "scope": "context"}).build_policy().context_end(80) == 80
    with pytest.raises(SpecError) as err:
        CompressionSpec.from_mapping({"policy": "lagkv", "scope": "context", "prefill": "stream"})
    assert err.value.field == "prefill"
    with pytest.raises(SpecError) as err:
        CompressionSpec.from_mapping({"policy": "snapkv", "context_tokens": 10})
    assert err.value.field == "context_tokens"
    with pytest.raises(SpecError) as err:
        CompressionSpec.from_mapping({"policy": "snapkv", "scope": "question"})
    assert err.value.field == "scope" and "all, context" in err.value.allowed
    assert make_policy("h2o").recompresses and not make_policy("h2o", scope="context").recompresses


def test_context_view_refuses_a_compacted_cache():
    request = FakeRequest.random(20, num_kv_heads=2, ragged=True, seed=3)
    with pytest.raises(ValueError, match="first compression"):
        request.layer_kv(0, 0).context(10)
