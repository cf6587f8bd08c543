"""Compression during chunked prefill (``prefill=stream``, and ``block`` for the policies that
score with queries): equal to the chunked HF oracle, memory bounded by the budget and one chunk,
prompts larger than the pool complete, nothing leaks.

Each chunk size needs its own engine (``max_num_batched_tokens``), so engines run in child
processes (tests/engine/stream_engine.py); the shared in-process engine cannot be re-configured.
"""

from __future__ import annotations

import math

import pytest

from tests.engine.conftest import prompt_ids
from tests.engine.stream_engine import engine_request, run_engine
from vllm_kvcomp.params import SpecError
from vllm_kvcomp.policies.registry import (
    POLICY_NAMES,
    compressing_policy_names,
    get_policy_class,
    streaming_policy_names,
)
from vllm_kvcomp.spec import CompressionSpec

pytestmark = pytest.mark.engine

BLOCK = 32
PROMPT = 700
MAX_TOKENS = 12
LOGPROB_TOL = {"knorm": 2e-2}  # see test_streaming_equals_the_chunked_oracle
SPECS = {  # small windows so that a 700-token prompt compresses several times
    "streamingllm": {"ratio": 0.25, "sink": 4, "interval": 4},
    "knorm": {"ratio": 0.25, "sink": 4, "window": 8},
    "lagkv": {"ratio": 0.25, "sink": 4, "lag": 32},
    "razor": {"ratio": 0.25, "sink": 4, "buffer": 32},
    "duoattention": {"ratio": 0.5, "sink": 4},
    "kvzap": {"ratio": 0.25, "sink": 4, "window": 8},
}


#: every other compressing policy compresses its prefill chunks with ``prefill=block``
BLOCK_SPECS = {name: {**get_policy_class(name).TEST_PARAMS, "ratio": 0.25}
               for name in compressing_policy_names() if name not in SPECS}


def request(name: str, prompt: list[int], spec: dict | None) -> dict:
    return engine_request(name, prompt, spec, MAX_TOKENS)


def stream_spec(name: str) -> dict:
    return {"policy": name, **SPECS[name], "prefill": "stream"}


def test_exact_streaming_policies_take_prefill_stream_and_the_others_block():
    assert set(streaming_policy_names()) == set(SPECS)
    for name in POLICY_NAMES:
        accepted, refused = ("stream", "block") if name in SPECS else ("block", "stream")
        if name == "full":
            accepted, refused = None, "block"
        if accepted is not None:
            spec = CompressionSpec.from_mapping({"policy": name, "prefill": accepted})
            assert spec.build_policy().prefill == accepted and spec.build_policy().compresses_in_prefill
        with pytest.raises(SpecError) as err:
            CompressionSpec.from_mapping({"policy": name, "prefill": refused})
        assert err.value.field == "prefill" and name in err.value.message
        assert err.value.allowed == ("end" if name == "full" else f"end, {accepted}")


@pytest.fixture(scope="module")
def oracle_model(tiny_model_dir):
    from vllm_kvcomp.oracle import load_model

    return load_model(tiny_model_dir)


def _oracle(model_dir, model, prompt, spec: dict, chunk_ends: list[int]):
    from vllm_kvcomp.engine.policy_factory import PolicyFactory
    from vllm_kvcomp.oracle import generate

    policy = PolicyFactory(str(model_dir)).build(CompressionSpec.from_mapping(spec))
    return generate(model, prompt, policy, MAX_TOKENS, block_size=BLOCK, prefill_chunk=chunk_ends)


@pytest.mark.parametrize("chunk", [64, 256, 1024])
def test_streaming_equals_the_chunked_oracle(tiny_model_dir, oracle_model, chunk):
    """Every streamable policy alone, then each in one batch with an uncompressed request (whose
    decode rows shift the streamed request's chunk ends: the oracle replays the engine's ends).

    knorm ranks tokens by a continuous score: two keys whose fp32 norms differ by ~5e-7 (seen:
    5.3105664 vs 5.3105659) rank differently in vLLM and in HF, whose K differ in the last bits,
    and one token of one head differs. Over ten compressions of 700 tokens that happens, so its
    logprobs get a looser bound (tokens must still match)."""
    prompts = {name: prompt_ids(PROMPT + 13 * i, seed=50 + i) for i, name in enumerate(SPECS)}
    alone = [[request(name, prompts[name], stream_spec(name))] for name in SPECS]
    mixed = [[request("plain", prompt_ids(60, seed=99), None), request(name, prompts[name], stream_spec(name))]
             for name in SPECS]
    results, free = run_engine(tiny_model_dir, chunk, [*alone, *mixed])
    assert free["free"] == free["total"], "blocks leaked"
    for result in results:
        name = result["name"].rsplit("-", 1)[0]
        if name == "plain":
            assert result["kvcomp"] is None
            continue
        expected = _oracle(tiny_model_dir, oracle_model, prompts[name], stream_spec(name), result["chunk_ends"])
        assert result["tokens"] == expected.token_ids, f"{name}, chunk {chunk}"
        worst = max(abs(a - b) for a, b in zip(result["logprobs"], expected.logprobs))
        assert worst <= LOGPROB_TOL.get(name, 1e-4), f"{name}, chunk {chunk}: logprob differs by {worst:.2e}"
        assert result["kvcomp"]["compressions"] == len(expected.compressions)
        if chunk < PROMPT:  # compressed before the prompt ended
            assert sum(1 for c in expected.compressions if c["num_tokens"] < len(prompts[name])) >= 1


@pytest.mark.parametrize("chunk", [64, 256])
def test_block_prefill_equals_the_chunked_oracle(tiny_model_dir, oracle_model, chunk):
    """``prefill=block``: after every chunk the policy decides afresh, as at the prompt's end, over
    the cache as it stands with the chunk's last queries, to the whole prompt's budget; the
    engine's tokens, logprobs and compression count equal the oracle's replay of its chunk ends,
    alone and next to an uncompressed request."""
    prompts = {name: prompt_ids(PROMPT + 11 * i, seed=70 + i) for i, name in enumerate(BLOCK_SPECS)}
    specs = {name: {"policy": name, **settings, "prefill": "block"} for name, settings in BLOCK_SPECS.items()}
    batches = [[request(name, prompts[name], specs[name])] for name in BLOCK_SPECS]
    batches.append([request("plain", prompt_ids(60, seed=98), None), request("snapkv", prompts["snapkv"], specs["snapkv"])])
    results, free = run_engine(tiny_model_dir, chunk, batches)
    assert free["free"] == free["total"], "blocks leaked"
    for result in results:
        name = result["name"].rsplit("-", 1)[0]
        if name == "plain":
            continue
        expected = _oracle(tiny_model_dir, oracle_model, prompts[name], specs[name], result["chunk_ends"])
        assert result["tokens"] == expected.token_ids, f"{name}, chunk {chunk}"
        worst = max(abs(a - b) for a, b in zip(result["logprobs"], expected.logprobs))
        assert worst <= LOGPROB_TOL.get(name, 1e-4), f"{name}, chunk {chunk}: logprob differs by {worst:.2e}"
        # a decode recompression after the last forward serves no token, and lands after the result
        served = [c for c in expected.compressions if c["step"] < MAX_TOKENS - 1]
        assert result["kvcomp"]["compressions"] == len(served), name
        assert sum(1 for c in expected.compressions if c["num_tokens"] < len(prompts[name])) >= 2, name


#: a budget of 128 tokens per head, compressed after every prefill chunk
BOUNDED = {"streamingllm": {"policy": "streamingllm", "budget": 128, "sink": 4, "prefill": "stream"},
           "snapkv": {"policy": "snapkv", "budget": 128, "window": 8, "prefill": "block"}}


def test_prefill_peak_is_bounded_by_the_budget_and_one_chunk(tiny_model_dir):
    """A 1500-token prompt in 64-token chunks: streaming (``stream`` or ``block``) holds the
    budget plus a chunk, full the prompt."""
    prompt = prompt_ids(1500, seed=7)
    batches = [[request("full", prompt, None)], *([request(name, prompt, spec)] for name, spec in BOUNDED.items())]
    results, free = run_engine(tiny_model_dir, 64, batches)
    full, *streamed = results
    assert full["peak_blocks"] == math.ceil((1500 + MAX_TOKENS) / BLOCK)
    bound = math.ceil((128 + BLOCK + 64 + BLOCK) / BLOCK) + 1  # kept + rounding page + chunk + growth
    for result in streamed:
        assert result["peak_blocks"] <= bound < full["peak_blocks"] / 3, result["name"]
        assert result["kvcomp"]["compressions"] > 10, result["name"]
    assert free["free"] == free["total"]


def test_a_prompt_four_times_the_pool_completes_when_streamed(tiny_model_dir):
    """Pool of 20 blocks (640 tokens), prompt of 2600 tokens: vLLM starts only because of
    ``long_prompts`` (--allow-prompts-beyond-kv-cache); a streamed request (``stream`` or
    ``block``) holds a few blocks throughout and completes. (A full-cache request for it gets
    HTTP 400 from the server: tests/server/test_live_requests.py.)"""
    prompt = prompt_ids(2600, seed=8)
    results, free = run_engine(tiny_model_dir, 64, [[request(name, prompt, spec)] for name, spec in BOUNDED.items()],
                               pool=21, max_len=4096, long_prompts=True)
    assert len(prompt) >= 4 * 20 * BLOCK
    for streamed in results:
        assert streamed["finish_reason"] == "length" and len(streamed["tokens"]) == MAX_TOKENS, streamed["name"]
        assert streamed["kvcomp"]["compressions"] > 10
        assert streamed["peak_blocks"] <= 8
    assert free["free"] == free["total"]
