"""Speculative decoding (ngram: drafts verified on the target model alone) with compressed requests.

A decode step of a compressed request then attends several query tokens over its packed pages,
and the drafts the sampler rejects are rolled back: their queries leave the query windows and the
recompression check of that step waits for the next bind, over the confirmed tokens only
(:mod:`vllm_kvcomp.engine.lifecycle`). Every policy equals the HF oracle replaying the engine's
forwards (``decode_forwards``: how many tokens each forward confirmed; ``decode_drafts``: how many
drafts it verified, which H2O's observed attention misses). The engine runs in a child
process (tests/engine/stream_engine.py); the prompts repeat a pattern so that ngram drafts come.
"""

from __future__ import annotations

import pytest

from tests.engine.conftest import prompt_ids
from tests.engine.stream_engine import engine_request, run_engine
from vllm_kvcomp.policies.registry import POLICY_NAMES, get_policy_class
from vllm_kvcomp.spec import CompressionSpec

pytestmark = pytest.mark.engine

BLOCK = 32
MAX_TOKENS = 64
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
SPECS = {name: dict(get_policy_class(name).TEST_PARAMS) for name in POLICY_NAMES if name != "full"}
BATCH = 6  # requests per batch (the child engine runs 8 at most)


def _prompt(seed: int) -> list[int]:
    """A 300-token prompt: a 30-token pattern ten times, so that the ngram proposer finds matches."""
    return prompt_ids(30, seed=seed) * 10


@pytest.fixture(scope="module")
def speculative_runs(tiny_model_dir):
    names = list(SPECS)
    batches = [[engine_request(f"plain{b}", _prompt(1000 + b), None, MAX_TOKENS)]
               + [engine_request(n, _prompt(1001 + b * BATCH + i), {"policy": n, **SPECS[n]}, MAX_TOKENS)
                  for i, n in enumerate(names[b * BATCH:(b + 1) * BATCH])]
               for b in range((len(names) + BATCH - 1) // BATCH)]
    results, free = run_engine(tiny_model_dir, 512, batches, engine_args={"speculative_config": NGRAM})
    prompts = {r["name"]: r["prompt"] for batch in batches for r in batch}
    return [(r, prompts[r["name"].rsplit("-", 1)[0]]) for r in results], free


@pytest.fixture(scope="module")
def oracle_model(tiny_model_dir):
    from vllm_kvcomp.oracle import load_model

    return load_model(tiny_model_dir)


def _forwards(result: dict) -> list[int]:
    """Tokens each decode forward confirmed; the last forward (the request left the scheduler
    after it) confirmed what is left of the output."""
    counts = [confirmed for _, confirmed in result["decode_forwards"]]
    return [*counts, len(result["tokens"]) - 1 - sum(counts)]


def test_every_policy_equals_the_oracle_under_ngram_speculation(tiny_model_dir, oracle_model, speculative_runs):
    from vllm_kvcomp.engine.policy_factory import PolicyFactory
    from vllm_kvcomp.oracle import generate

    runs, free = speculative_runs
    assert free["free"] == free["total"], "blocks leaked"
    factory = PolicyFactory(str(tiny_model_dir))
    for result, prompt in runs:
        name = result["name"].rsplit("-", 1)[0]
        assert len(result["tokens"]) == MAX_TOKENS, name
        if name.startswith("plain"):
            assert result["kvcomp"] is None
            continue
        policy = factory.build(CompressionSpec.from_mapping({"policy": name, **SPECS[name]}))
        forwards = _forwards(result)
        drafts = [drafts for drafts, _ in result["decode_forwards"]]
        expected = generate(oracle_model, prompt, policy, MAX_TOKENS, block_size=BLOCK, decode_forwards=forwards,
                            decode_drafts=drafts)
        assert result["tokens"] == expected.token_ids, name
        worst = max(abs(a - b) for a, b in zip(result["logprobs"], expected.logprobs))
        assert worst <= 1e-4, f"{name}: logprob differs by {worst:.2e}"
        stats = result["kvcomp"]
        assert stats["applied"] != "none", stats
        # the engine skips the check after its last forward when that forward verified drafts
        before_last = sum(1 for c in expected.compressions if c["step"] < len(forwards))
        assert before_last <= stats["compressions"] <= len(expected.compressions), name
        if policy.recompresses:
            assert stats["compressions"] >= 2, f"{name} never recompressed during decode"


def test_drafts_were_accepted_and_rejected(speculative_runs):
    """The runs above exercise both paths: forwards that confirmed drafts, and drafts rolled back."""
    runs, _ = speculative_runs
    steps = [step for result, _ in runs if result["kvcomp"] is not None for step in result["decode_forwards"]]
    assert any(confirmed > 1 for _, confirmed in steps), "no draft was ever accepted"
    assert any(confirmed < drafts + 1 for drafts, confirmed in steps), "no draft was ever rejected"
    recompressing = [result["name"] for result, _ in runs if result["kvcomp"] is not None
                     and get_policy_class(result["name"].rsplit("-", 1)[0]).RECOMPRESSES
                     and any(confirmed > 1 for _, confirmed in result["decode_forwards"])]
    assert recompressing, "no recompressing policy had a draft accepted"
