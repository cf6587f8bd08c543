"""Tensor parallelism on vLLM's CPU backend: two ranks (one core each) give what one rank gives.

Each rank holds half of the KV heads and packs its own pages; policies that rank or average
across heads (adaptive heads, entropy budgets, razor's global head ids, LagKV's schedule) ask
every rank (``Ranks``), criticalkv reads each rank's slice of ``o_proj`` (its query heads'
columns), and the scheduler merges the ranks' reports (a block is freed only when
every rank freed it; one event per request). A tiny Llama with 4 KV heads (SmolLM2's 3 do not
split in two), built so that greedy tokens change with the kept set.
"""

from __future__ import annotations

import pytest

from tests.engine.conftest import prompt_ids
from tests.engine.stream_engine import engine_request, run_engine

pytestmark = pytest.mark.engine

MAX_TOKENS = 12
NUMBERS = ("tokens_kept", "kept_max_head", "compressions", "blocks_freed", "tokens_evicted")
SPECS = {
    "full": None,
    "snapkv": {"policy": "snapkv", "ratio": 0.25, "window": 8},
    "snapkv-adaptive": {"policy": "snapkv", "ratio": 0.25, "window": 8, "heads": "adaptive"},
    "entropy": {"policy": "entropy", "ratio": 0.25, "window": 8, "interval": 4},
    "lagkv": {"policy": "lagkv", "ratio": 0.25, "sink": 4, "lag": 32},
    "razor": {"policy": "razor", "ratio": 0.25, "sink": 4, "buffer": 32},
    "pod": {"policy": "pod", "ratio": 0.5, "sink": 4, "window": 16},
    "criticalkv": {"policy": "criticalkv", "ratio": 0.25, "window": 8},  # each rank's W_o columns
    "criticalkv-adaptive": {"policy": "criticalkv", "ratio": 0.25, "window": 8, "heads": "adaptive"},
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from tests.helpers.tiny_llama import make_tiny_llama
    from vllm_kvcomp.calibration.profiles import (
        LayerGroupsProfile,
        ModelIdentity,
        RetrievalHeadsProfile,
        save_profile,
    )

    path = make_tiny_llama(tmp_path_factory.mktemp("tp") / "llama", num_layers=4, hidden_size=256, num_heads=8,
                           num_kv_heads=4, head_dim=32, intermediate_size=256, vocab_size=512, seed=3)
    model = ModelIdentity.from_model_dir(path)
    save_profile(RetrievalHeadsProfile(model=model, kv_heads=frozenset({(1, 3), (2, 0)})), model_dir=path)
    save_profile(LayerGroupsProfile(model=model, groups=((0, 1), (2, 3))), model_dir=path)
    return path


@pytest.fixture(scope="module")
def runs(model_dir):
    """Every spec alone, on one rank and on two; then a mixed batch with aborts on two ranks."""
    prompt = prompt_ids(500, seed=120)  # the same prompt for every spec: their outputs compare
    alone = [[engine_request(name, prompt, spec, MAX_TOKENS)] for name, spec in SPECS.items()]
    mixed = [[{**engine_request(f"mix{i}", prompt_ids(400, seed=140 + i), spec, MAX_TOKENS),
               "abort_after": (None, 2, 6)[i % 3]} for i, spec in enumerate(SPECS.values())]]
    one, _ = run_engine(model_dir, 512, alone, pool=200)
    two, free = run_engine(model_dir, 512, [*alone, *mixed], pool=200, tensor_parallel=2)
    return {"one": one, "two": two, "free": free}


@pytest.mark.parametrize("name", list(SPECS))
def test_two_ranks_equal_one(runs, name):
    one = next(r for r in runs["one"] if r["name"].startswith(f"{name}-"))
    two = next(r for r in runs["two"] if r["name"].startswith(f"{name}-"))
    assert two["tokens"] == one["tokens"], name
    assert max(abs(a - b) for a, b in zip(two["logprobs"], one["logprobs"])) <= 1e-4
    if SPECS[name] is None:
        assert one["kvcomp"] is None and two["kvcomp"] is None
    else:
        assert {k: two["kvcomp"][k] for k in NUMBERS} == {k: one["kvcomp"][k] for k in NUMBERS}
        assert one["kvcomp"]["compressions"] >= 1


def test_outputs_depend_on_the_kept_set(runs):
    """Otherwise the equalities above would prove nothing."""
    tokens = {r["name"].rsplit("-", 1)[0]: r["tokens"] for r in runs["one"]}
    assert len(set(tokens["full"])) > 3  # not one repeated token
    assert sum(tokens[name] != tokens["full"] for name in SPECS if name != "full") >= 3


def test_mixed_load_with_aborts_leaves_every_rank_clean(runs):
    mixed = [r for r in runs["two"] if r["name"].startswith("mix")]
    assert len(mixed) == len(SPECS) and sum(not r.get("aborted") for r in mixed) >= 2
    assert runs["free"]["free"] == runs["free"]["total"]
