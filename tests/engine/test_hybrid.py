"""Hybrid attention (tiny Gemma 3: 5 sliding-window layers, 1 full-attention layer).

The sliding-window layers stay vLLM's (their own KV-cache groups, their mask, their block
recycling); the full-attention layer is compressed per head in its own group, with blocks freed
in that group. Engines run in child processes (tests/engine/stream_engine.py): the session
engine serves a Llama.
"""

from __future__ import annotations

import math

import pytest

from tests.engine.conftest import prompt_ids
from tests.engine.stream_engine import engine_request, run_engine

pytestmark = pytest.mark.engine

BLOCK = 32
POOL = 600  # shared by the six groups' blocks
MAX_TOKENS = 12
FULL_LAYER = 5
SPECS = {
    "full": {"policy": "full"},
    "snapkv": {"policy": "snapkv", "ratio": 0.25, "window": 8},
    "lagkv": {"policy": "lagkv", "ratio": 0.25, "sink": 4, "lag": 32},
    "razor": {"policy": "razor", "ratio": 0.25, "sink": 4, "buffer": 32},
}


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory):
    from tests.helpers.tiny_gemma import make_tiny_gemma3
    from vllm_kvcomp.calibration.profiles import ModelIdentity, RetrievalHeadsProfile, save_profile

    path = make_tiny_gemma3(tmp_path_factory.mktemp("gemma") / "gemma3")
    model = ModelIdentity.from_model_dir(path)
    save_profile(RetrievalHeadsProfile(model=model, kv_heads=frozenset({(FULL_LAYER, 1)})), model_dir=path)
    return path


@pytest.fixture(scope="module")
def oracle_model(gemma_dir):
    from vllm_kvcomp.oracle import load_model

    return load_model(gemma_dir)


def request(name: str, prompt: list[int], spec: dict | None) -> dict:
    return engine_request(name, prompt, spec, MAX_TOKENS)


def _oracle(gemma_dir, model, prompt, spec):
    from vllm_kvcomp.engine.policy_factory import PolicyFactory
    from vllm_kvcomp.oracle import generate
    from vllm_kvcomp.spec import CompressionSpec

    policy = PolicyFactory(str(gemma_dir)).build(CompressionSpec.from_mapping(spec))
    return generate(model, prompt, policy, MAX_TOKENS, block_size=BLOCK)


@pytest.fixture(scope="module")
def runs(gemma_dir):
    """Every spec alone, all of them in one batch, plain vLLM on the same prompts, and a batch too
    large for the pool (preemption), in two child engines."""
    prompts = {name: prompt_ids(600 + 11 * i, seed=70 + i) for i, name in enumerate(SPECS)}
    alone = [[request(name, prompts[name], spec)] for name, spec in SPECS.items()]
    mixed = [[request(name, prompts[name], spec) for name, spec in SPECS.items()]]
    crowd = [[{**request(f"crowd{i}", prompt_ids(700, seed=90 + i), SPECS["snapkv"] if i % 2 else None),
               "abort_after": (None, 1, 3, 8)[i % 4]} for i in range(8)]]  # mid-prefill, after compression, decode
    ours, free = run_engine(gemma_dir, 512, [*alone, *mixed, *crowd], pool=POOL)
    plain, _ = run_engine(gemma_dir, 512, [[request("full", prompts["full"], None)]], pool=POOL, connector=False)
    return {"prompts": prompts, "ours": ours, "free": free, "plain": plain}


def test_uncompressed_requests_are_vllms_own(runs):
    ours = next(r for r in runs["ours"] if r["name"] == "full-0")
    (plain,) = runs["plain"]
    assert ours["tokens"] == plain["tokens"] and ours["logprobs"] == plain["logprobs"]
    assert ours["kvcomp"] is None


@pytest.mark.parametrize("batch", ["alone", "mixed"])
def test_engine_equals_the_oracle(runs, gemma_dir, oracle_model, batch):
    results = runs["ours"][: len(SPECS)] if batch == "alone" else runs["ours"][len(SPECS) : 2 * len(SPECS)]
    for result in results:
        name = result["name"].rsplit("-", 1)[0]
        expected = _oracle(gemma_dir, oracle_model, runs["prompts"][name], SPECS[name])
        assert result["tokens"] == expected.token_ids, f"{name} ({batch})"
        worst = max(abs(a - b) for a, b in zip(result["logprobs"], expected.logprobs))
        assert worst <= 1e-4, f"{name} ({batch}): logprob differs by {worst:.2e}"
        if name != "full":
            assert result["kvcomp"]["compressions"] == len(expected.compressions) >= 1


def test_only_the_full_attention_group_is_compressed_and_freed(runs):
    """At ratio 0.25 the full-attention group holds <= 0.35x of its uncompressed blocks."""
    snap = next(r for r in runs["ours"] if r["name"] == "snapkv-0")
    n = len(runs["prompts"]["snapkv"])
    group_blocks = math.ceil(n / BLOCK)
    held = group_blocks - snap["kvcomp"]["blocks_freed"]
    assert held / group_blocks <= 0.35
    assert 0.25 <= snap["kvcomp"]["kept_fraction"] <= 0.25 + BLOCK / n


def test_abort_and_finish_leak_nothing_across_groups(runs):
    """Eight requests, six aborted (mid-prefill, right after compression, mid-decode): every block
    of every group is back in the pool. (Preemption is forced on the single-group Llama engine in
    test_lifecycle.py; this pool's scheduler admits hybrid requests without needing it.)"""
    crowd = [r for r in runs["ours"] if r["name"].startswith("crowd")]
    finished = [r for r in crowd if not r.get("aborted")]
    assert len(crowd) == 8 and len(finished) == 2 and all(len(r["tokens"]) == MAX_TOKENS for r in finished)
    assert runs["free"]["free"] == runs["free"]["total"]
