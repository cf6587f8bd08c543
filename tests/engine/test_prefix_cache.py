"""Prefix caching with compressed requests (copy-on-compress, docs/engine.md#prefix-caching).

A compressed request reads cached prompt blocks like any other (up to its observation window),
packs its kept pages into private blocks, and leaves every cached block as it found it: a warm
run equals a cold one, an uncompressed neighbour is unaffected, nothing leaks.
"""

from __future__ import annotations

import pytest

from tests.engine.conftest import BLOCK_SIZE, generate, params, prompt_ids, token_logprobs
from tests.engine.test_lifecycle import _add, _assert_clean, _drain
from vllm_kvcomp import vllm_compat
from vllm_kvcomp.spec import CompressionSpec

pytestmark = pytest.mark.engine

SPECS = {
    "streamingllm": {"policy": "streamingllm", "ratio": 0.25},
    "snapkv": {"policy": "snapkv", "ratio": 0.25, "window": 16},
    "snapkv-adaptive": {"policy": "snapkv", "ratio": 0.25, "window": 16, "heads": "adaptive"},
    "h2o": {"policy": "h2o", "ratio": 0.25, "window": 16},
    "knorm": {"policy": "knorm", "ratio": 0.25},
    "sagekv": {"policy": "sagekv", "ratio": 0.25},
    "lagkv": {"policy": "lagkv", "ratio": 0.25, "lag": 64},
    "entropy": {"policy": "entropy", "ratio": 0.25, "window": 16},
    "razor": {"policy": "razor", "ratio": 0.25},
    "pod": {"policy": "pod", "ratio": 0.25},
}


def _prefix_pages(engine, blocks: list[int]):
    """Every (layer, head) page of ``blocks``: [n_pages, page_elems] copy of the cache."""
    cache = engine.worker_connector.cache
    return cache.pages[cache.geometry.page_ids(blocks).flatten()].clone()


def _prefix_blocks(engine, name: str, prompt: list[int], n_blocks: int) -> list[int]:
    """Block ids of the first ``n_blocks`` columns an uncompressed run of ``prompt`` gets (its
    prefix-cache hit), read after its first step; the run is then finished."""
    internal = _add(engine, name, prompt, params(1))
    engine.llm.llm_engine.step()
    ids = engine.scheduler.kv_cache_manager.get_block_ids(internal)[0][:n_blocks]
    _drain(engine)
    return list(ids)


@pytest.mark.parametrize("name", list(SPECS))
def test_warm_equals_cold(engine, name):
    """The cold run caches the prompt's blocks while it compresses; the warm run reads them: if
    compaction had written into them, the warm run would attend garbage."""
    prompt = prompt_ids(600, seed=9100 + list(SPECS).index(name))
    cold = generate(engine, [prompt], params(16, **SPECS[name]))[0]
    warm = generate(engine, [prompt], params(16, **SPECS[name]))[0]
    assert cold.num_cached_tokens == 0
    window = max(SPECS[name].get("window", 0), 1 if name == "sagekv" else 0,
                 {"pod": 16, "entropy": 16}.get(name, 0))
    assert warm.num_cached_tokens == (600 - window) // BLOCK_SIZE * BLOCK_SIZE
    assert list(warm.outputs[0].token_ids) == list(cold.outputs[0].token_ids)
    assert max(abs(a - b) for a, b in zip(token_logprobs(warm), token_logprobs(cold))) <= 1e-4
    for out in (cold, warm):
        stats = out.kv_transfer_params["kvcomp"]
        assert stats["compressions"] >= 1 and stats["blocks_freed"] > 0, stats


@pytest.mark.parametrize("name", ["snapkv", "sagekv", "tova", "expected_attention", "criticalkv"])
def test_context_scope_computes_its_window_before_the_question(engine, name):
    """``scope=context`` with a question longer than the observation window: the warm run reads
    the cache only up to the window before the context's end (it computes the window's queries
    itself) and equals the cold run."""
    from vllm_kvcomp.policies.registry import get_policy_class

    prompt = prompt_ids(600, seed=9140 + len(name))
    spec = {**get_policy_class(name).TEST_PARAMS, "policy": name, "ratio": 0.25, "scope": "context",
            "context_tokens": 400}
    window = CompressionSpec.from_mapping(spec).build_policy().queries_needed()
    assert 0 < window < 200
    cold = generate(engine, [prompt], params(12, **spec))[0]
    warm = generate(engine, [prompt], params(12, **spec))[0]
    assert warm.num_cached_tokens == (400 - window) // BLOCK_SIZE * BLOCK_SIZE
    assert list(warm.outputs[0].token_ids) == list(cold.outputs[0].token_ids)
    assert max(abs(a - b) for a, b in zip(token_logprobs(warm), token_logprobs(cold))) <= 1e-4
    for out in (cold, warm):
        assert out.kv_transfer_params["kvcomp"]["compressions"] == 1, out.kv_transfer_params


def test_shared_prefix_read_and_left_unchanged(engine):
    prefix = prompt_ids(256, seed=9120)
    plain = prefix + prompt_ids(40, seed=9121)
    squeezed = prefix + prompt_ids(40, seed=9122)
    generate(engine, [plain], params(16))  # populate the prefix cache
    reference = generate(engine, [plain], params(16))[0]  # a cache hit, like every run below
    assert reference.num_cached_tokens >= 256
    shared = _prefix_blocks(engine, "probe-1", plain, 256 // BLOCK_SIZE)
    before = _prefix_pages(engine, shared)

    spec = {"policy": "snapkv", "ratio": 0.25, "window": 16}
    compressed = generate(engine, [squeezed], params(16, **spec))[0]
    assert compressed.num_cached_tokens == 256  # its whole shared prefix (the window is after it)
    assert compressed.kv_transfer_params["kvcomp"]["blocks_freed"] > 0
    assert _prefix_blocks(engine, "probe-2", plain, 256 // BLOCK_SIZE) == shared  # still cached
    assert bool((_prefix_pages(engine, shared) == before).all()), "compaction wrote into a cached block"

    again = generate(engine, [plain], params(16))[0]
    assert again.num_cached_tokens == reference.num_cached_tokens
    assert list(again.outputs[0].token_ids) == list(reference.outputs[0].token_ids)
    assert token_logprobs(again) == token_logprobs(reference)

    together = generate(engine, [squeezed, plain], [params(16, **spec), params(16)])
    assert together[1].num_cached_tokens == reference.num_cached_tokens
    assert list(together[1].outputs[0].token_ids) == list(reference.outputs[0].token_ids)
    assert list(together[0].outputs[0].token_ids) == list(compressed.outputs[0].token_ids)
    assert bool((_prefix_pages(engine, shared) == before).all())


def test_second_turn_hits_the_first_turns_prompt(engine):
    document = prompt_ids(1000, seed=9130)
    spec = {"policy": "snapkv", "ratio": 0.25, "window": 16}
    first = generate(engine, [document], params(24, **spec))[0]
    turn2 = document + list(first.outputs[0].token_ids) + prompt_ids(30, seed=9131)
    second = generate(engine, [turn2], params(8, **spec))[0]
    # the first turn's prompt blocks are cached; its decode blocks (attended over a compressed
    # cache) are not
    assert second.num_cached_tokens == 1000 // BLOCK_SIZE * BLOCK_SIZE
    assert second.num_cached_tokens >= 0.8 * len(turn2)


@pytest.mark.parametrize("abort_after", [0, 1, 4])
def test_abort_with_shared_blocks_leaks_nothing(engine, abort_after):
    """Two compressed requests and a plain one share a cached prefix; one is aborted right after
    its compression (spares sent, maybe not yet placed) or later: every block comes back once."""
    _drain(engine)
    prefix = prompt_ids(320, seed=9140)
    generate(engine, [prefix + prompt_ids(8, seed=9141)], params(2))  # cache the prefix
    _drain(engine)
    free0 = engine.free_blocks
    spec = {"policy": "snapkv", "ratio": 0.25, "window": 16}
    _add(engine, f"shared-a{abort_after}", prefix + prompt_ids(64, seed=9142), params(32, **spec))
    _add(engine, f"shared-b{abort_after}", prefix + prompt_ids(64, seed=9143), params(32, **spec))
    _add(engine, f"shared-c{abort_after}", prefix + prompt_ids(64, seed=9144), params(32))
    for _ in range(1 + abort_after):
        engine.llm.llm_engine.step()
    engine.llm.llm_engine.abort_request([f"shared-a{abort_after}"])
    _drain(engine)
    _assert_clean(engine, free0)
    assert engine.sched_connector.cow == {}
    assert all(vllm_compat.block_refs(b) == 0 for b in engine.pool.blocks if not vllm_compat.is_null_block(b))


def test_without_spares_packs_in_place_outside_the_cache(engine, monkeypatch):
    """A pool with no block to spare: the request's own unshared columns leave the prefix cache
    and it packs into them, at the same point and with the same result as with spares."""
    from vllm_kvcomp.engine import blocks

    prompt = prompt_ids(600, seed=9150)
    spec = {"policy": "snapkv", "ratio": 0.25, "window": 16}
    hit = (600 - 16) // BLOCK_SIZE * BLOCK_SIZE
    generate(engine, [prompt], params(1))  # cache the prompt
    with_spares = generate(engine, [prompt], params(16, **spec))[0]
    _drain(engine)
    free0 = engine.free_blocks
    monkeypatch.setattr(blocks, "new_blocks", lambda manager, count: None if count > 0 else [])
    in_place = generate(engine, [prompt], params(16, **spec))[0]
    monkeypatch.undo()
    assert with_spares.num_cached_tokens == in_place.num_cached_tokens == hit
    assert list(in_place.outputs[0].token_ids) == list(with_spares.outputs[0].token_ids)
    assert token_logprobs(in_place) == token_logprobs(with_spares)
    stats = in_place.kv_transfer_params["kvcomp"]
    assert stats["compressions"] == 1 and stats["blocks_freed"] > 0
    _drain(engine)
    _assert_clean(engine, free0)
    # the columns it packed into left the cache; the ones before are still there
    warm = generate(engine, [prompt], params(1, **spec))[0]
    assert 0 < warm.num_cached_tokens < hit


def test_without_spares_and_shared_blocks_waits(engine, monkeypatch):
    """No spare and its columns shared with a running request: the compaction waits (the
    request decodes uncompressed meanwhile) and happens once spares come."""
    from vllm_kvcomp.engine import blocks

    _drain(engine)
    prompt = prompt_ids(600, seed=9160)
    generate(engine, [prompt], params(1))  # cache the prompt
    free0 = engine.free_blocks
    spec = {"policy": "snapkv", "ratio": 0.25, "window": 16}
    calls = []
    real = blocks.new_blocks

    def short_pool(manager, count):
        calls.append(count)
        return None if len(calls) <= 3 and count > 0 else real(manager, count)

    monkeypatch.setattr(blocks, "new_blocks", short_pool)
    _add(engine, "sharer", prompt, params(40))  # plain: holds the same cached blocks
    _add(engine, "waiter", prompt, params(24, **spec))
    outputs = {}
    while engine.llm.llm_engine.has_unfinished_requests():
        for out in engine.llm.llm_engine.step():
            outputs[out.request_id] = out
    stats = outputs["waiter"].kv_transfer_params["kvcomp"]
    assert len(calls) > 3 and stats["compressions"] == 1 and stats["blocks_freed"] > 0
    _drain(engine)
    _assert_clean(engine, free0)
