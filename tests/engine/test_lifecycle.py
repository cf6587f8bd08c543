"""Blocks really go back to the pool, and nothing leaks on finish, abort or preemption."""

from __future__ import annotations

import math

import pytest

from tests.engine.conftest import BLOCK_SIZE, generate, params, prompt_ids, token_logprobs
from tests.engine.test_allocation_failures import RefusingAllocator, arm

pytestmark = pytest.mark.engine


def _live_blocks(engine, req_id: str) -> int:
    from vllm_kvcomp import vllm_compat

    table = vllm_compat.group_managers(engine.scheduler.kv_cache_manager)[0].tables[req_id]
    return sum(1 for b in table if not vllm_compat.is_null_block(b))


def _drain(engine) -> None:
    """Step until idle, then once more so the worker hears about finished requests."""
    core = engine.llm.llm_engine
    while core.has_unfinished_requests():
        core.step()
    core.step()


def _assert_clean(engine, free_before: int) -> None:
    assert engine.free_blocks == free_before
    assert engine.sched_connector.requests == {}
    assert engine.sched_connector.freed == {}
    assert engine.sched_connector.cow == {}
    assert engine.worker_connector.requests == {}


def _add(engine, rid: str, prompt: list[int], sp) -> str:
    engine.llm.llm_engine.add_request(rid, {"prompt_token_ids": prompt}, sp)
    (internal,) = [r for r in engine.scheduler.requests if r.startswith(rid)]
    return internal


@pytest.mark.parametrize("ratio", [0.5, 0.25])
def test_compression_frees_blocks_and_finish_returns_them(engine, ratio):
    _drain(engine)
    free0 = engine.free_blocks
    n = 300
    rid = _add(engine, f"free-{ratio}", prompt_ids(n, 1), params(8, policy="streamingllm", ratio=ratio))
    engine.llm.llm_engine.step()  # whole prompt (< max_num_batched_tokens): prefill, first token
    engine.llm.llm_engine.step()  # compression (before this step's forward), decode
    residue = n % BLOCK_SIZE
    kept = math.ceil(ratio * n) + (residue - math.ceil(ratio * n)) % BLOCK_SIZE  # rounded to the page grid
    pages = (kept - residue) // BLOCK_SIZE  # full packed pages per (layer, head): one block's worth
    freed = n // BLOCK_SIZE - pages
    allocated = math.ceil(n / BLOCK_SIZE)
    assert engine.sched_connector.requests[rid].blocks_freed == freed
    assert _live_blocks(engine, rid) == allocated - freed == pages + 1
    assert _live_blocks(engine, rid) <= math.ceil(kept / BLOCK_SIZE) + 1
    assert engine.free_blocks == free0 - allocated + freed
    _drain(engine)
    _assert_clean(engine, free0)


def test_abort_mid_prefill(engine):
    _drain(engine)
    free0 = engine.free_blocks
    _add(engine, "abort-prefill", prompt_ids(1200, 2), params(8, policy="snapkv", ratio=0.25))
    engine.llm.llm_engine.step()  # first 512-token chunk only
    (state,) = engine.worker_connector.requests.values()
    assert not state.compressed
    engine.llm.llm_engine.abort_request(["abort-prefill"])
    _drain(engine)
    _assert_clean(engine, free0)


@pytest.mark.parametrize("decode_steps", [0, 5])
def test_abort_after_compression_and_mid_decode(engine, decode_steps):
    _drain(engine)
    free0 = engine.free_blocks
    rid = _add(engine, f"abort-{decode_steps}", prompt_ids(400, 3), params(64, policy="streamingllm", ratio=0.25))
    engine.llm.llm_engine.step()  # prefill
    engine.llm.llm_engine.step()  # compression, decode
    assert engine.sched_connector.requests[rid].blocks_freed > 0
    for _ in range(decode_steps):
        engine.llm.llm_engine.step()
    engine.llm.llm_engine.abort_request([f"abort-{decode_steps}"])
    _drain(engine)
    _assert_clean(engine, free0)


def test_preemption_recompresses_and_leaks_nothing(engine):
    """A pool too small for the batch forces recompute-preemption.

    Recompute rebuilds the full KV of prompt + generated tokens and compresses again, so a
    preempted *compressed* request legitimately differs from its solo run; every other request
    must match its solo run exactly.
    """
    _drain(engine)
    free0 = engine.free_blocks
    # 8 x 11 blocks fit the 96-block pool; the 13th block of each request (token 384) does not.
    prompts = [prompt_ids(352, 10 + i) for i in range(8)]
    sps = [params(48, policy="snapkv", ratio=0.9) if i % 2 else params(48) for i in range(8)]
    solo = [generate(engine, [p], sp)[0].outputs[0].token_ids for p, sp in zip(prompts, sps)]
    before = engine.sched_connector.preemptions
    outputs = generate(engine, prompts, sps)
    assert engine.sched_connector.preemptions > before, "the pool was not small enough to preempt"
    recompressed = 0
    for i, out in enumerate(outputs):
        stats = (out.kv_transfer_params or {}).get("kvcomp")
        if stats and stats["preemptions"]:
            # once per admission, unless preempted before its compression ran (the next step)
            assert 1 <= stats["compressions"] <= stats["preemptions"] + 1
            recompressed += 1
        else:
            assert list(out.outputs[0].token_ids) == list(solo[i]), f"request {i} changed"
    assert recompressed, "no compressed request was preempted"
    _drain(engine)
    _assert_clean(engine, free0)


def test_a_compression_without_memory_serves_the_uncompressed_answer(engine, monkeypatch):
    """The engine on the tiny test model: the prompt-end compression's allocator refuses its 5th
    allocation; the request is served uncompressed and its tokens and logprobs are the full
    cache's (the prompt is in the prefix cache: the compression was a copy-on-compress one)."""
    prompt = prompt_ids(400, seed=211)
    full = generate(engine, [prompt], params(max_tokens=12))[0]
    arm(monkeypatch, (False, 0), RefusingAllocator(5))
    out = generate(engine, [prompt], params(max_tokens=12, policy="snapkv", ratio=0.25))[0]
    stats = out.kv_transfer_params["kvcomp"]
    assert stats["applied"] == "none" and stats["compression_failures"] == 1, stats
    assert out.outputs[0].token_ids == full.outputs[0].token_ids
    assert max(abs(a - b) for a, b in zip(token_logprobs(out), token_logprobs(full))) <= 1e-4
    monkeypatch.undo()
    again = generate(engine, [prompt_ids(400, seed=212)], params(max_tokens=4, policy="snapkv", ratio=0.25))[0]
    assert again.kv_transfer_params["kvcomp"]["compressions"] == 1  # the engine compresses on
