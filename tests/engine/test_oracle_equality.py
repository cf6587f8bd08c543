"""Greedy tokens and logprobs from vLLM + kvcomp equal the HF oracle with the same policy."""

from __future__ import annotations

import pytest

from tests.engine.conftest import BLOCK_SIZE, generate, params, prompt_ids, token_logprobs
from vllm_kvcomp.policies.registry import POLICY_NAMES, get_policy_class
from vllm_kvcomp.spec import CompressionSpec

pytestmark = pytest.mark.engine

PROMPT_LEN = 300
MAX_TOKENS = 20  # >= 16 decode steps after the prefill token
#: each policy's small test settings (``TEST_PARAMS``): decode-time recompression happens within MAX_TOKENS
SPECS: dict[str, dict] = {name: dict(get_policy_class(name).TEST_PARAMS) for name in POLICY_NAMES}
LOGPROB_TOL = 1e-4


@pytest.fixture(scope="module")
def oracle_model(engine):
    from vllm_kvcomp.oracle import load_model

    return load_model(engine.model_dir)


def _oracle(engine, oracle_model, prompt, name, tokens=MAX_TOKENS, lag=0, **settings):
    from vllm_kvcomp.engine.policy_factory import PolicyFactory
    from vllm_kvcomp.oracle import generate as oracle_generate

    spec = CompressionSpec.from_mapping({"policy": name, **SPECS[name], **settings})
    policy = PolicyFactory(str(engine.model_dir)).build(spec)
    return oracle_generate(oracle_model, prompt, policy, tokens, block_size=BLOCK_SIZE, lag=lag)


def _assert_same(vllm_out, expected, label):
    assert list(vllm_out.outputs[0].token_ids) == expected.token_ids, label
    got = token_logprobs(vllm_out)
    worst = max(abs(a - b) for a, b in zip(got, expected.logprobs))
    assert worst <= LOGPROB_TOL, f"{label}: logprob differs by {worst:.2e}"


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_policy_matches_oracle(engine, oracle_model, name):
    prompt = prompt_ids(PROMPT_LEN, seed=100)
    out = generate(engine, [prompt], params(MAX_TOKENS, policy=name, **SPECS[name]))[0]
    expected = _oracle(engine, oracle_model, prompt, name)
    _assert_same(out, expected, name)
    stats = (out.kv_transfer_params or {}).get("kvcomp")
    if name == "full":
        assert stats is None
    else:
        assert stats["compressions"] == len(expected.compressions)


@pytest.fixture
def lagged(engine):
    """The engine decides its compressions off the step and packs them at the 2nd bind after
    (``compression_lag`` 2: the same steps every run), for one test."""
    worker = engine.worker_connector
    worker.configure_offload(2)
    yield 2
    worker.configure_offload(0)


@pytest.mark.parametrize("name", [n for n in POLICY_NAMES if n != "full"])
def test_compressions_decided_off_the_step_match_the_oracle(engine, oracle_model, lagged, name):
    """Decided on the side thread while the request decodes over the pages it has, packed with
    every token since: equal to the oracle that applies each decision where the engine did."""
    prompt = prompt_ids(PROMPT_LEN, seed=300)
    out = generate(engine, [prompt], params(MAX_TOKENS, policy=name, **SPECS[name]))[0]
    expected = _oracle(engine, oracle_model, prompt, name, lag=lagged)
    _assert_same(out, expected, f"{name}, lag {lagged}")
    assert out.kv_transfer_params["kvcomp"]["compressions"] == len(expected.compressions) >= 1
    assert all(c["switched"] > c["num_tokens"] for c in expected.compressions)  # it decoded meanwhile


def test_mixed_batch_matches_oracle(engine, oracle_model):
    """Every policy plus an uncompressed request in one batch, each with its own prompt."""
    names = [n for n in POLICY_NAMES if n != "full"]
    prompts = [prompt_ids(PROMPT_LEN - 7 * i, seed=200 + i) for i in range(len(names) + 1)]
    sps = [params(MAX_TOKENS, policy=n, **SPECS[n]) for n in names] + [params(MAX_TOKENS)]
    outs = generate(engine, prompts, sps)
    for name, prompt, out in zip([*names, "full"], prompts, outs):
        _assert_same(out, _oracle(engine, oracle_model, prompt, name), f"{name} in a mixed batch")


def test_keep_everything_is_identical_to_plain_vllm(engine):
    """`full` and a spec that keeps every token give exactly plain vLLM's tokens and logprobs."""
    prompt = prompt_ids(PROMPT_LEN, seed=300)
    plain = generate(engine, [prompt], params(MAX_TOKENS))[0]
    for spec in ({"policy": "full"}, {"policy": "snapkv", "ratio": 1.0}, {"policy": "knorm", "budget": 4096}):
        out = generate(engine, [prompt], params(MAX_TOKENS, **spec))[0]
        assert list(out.outputs[0].token_ids) == list(plain.outputs[0].token_ids), spec
        assert token_logprobs(out) == token_logprobs(plain), spec


@pytest.mark.parametrize("name", ["snapkv", "h2o"])
def test_chunked_prefill_window_spans_chunks(engine, oracle_model, name):
    """1034 tokens in 512-token chunks: the last chunk (10 tokens) is shorter than the window."""
    prompt = prompt_ids(1034, seed=500)
    spec = {**SPECS[name], "window": 32}
    out = generate(engine, [prompt], params(MAX_TOKENS, policy=name, **spec))[0]
    from vllm_kvcomp.oracle import generate as oracle_generate

    policy = CompressionSpec.from_mapping({"policy": name, **spec}).build_policy()
    _assert_same(out, oracle_generate(oracle_model, prompt, policy, MAX_TOKENS, block_size=BLOCK_SIZE),
                 f"chunked {name}")


def test_context_scope_matches_oracle(engine, oracle_model):
    """``scope=context``: every policy in one batch compresses the first 230 of its ~300 tokens
    with the context's own queries and keeps the rest, as the oracle does; a 1034-token prompt in
    512-token chunks whose context ends inside the second chunk does too."""
    names = [n for n in POLICY_NAMES if n != "full"]
    context = {"scope": "context", "context_tokens": 230}
    prompts = [prompt_ids(PROMPT_LEN - 5 * i, seed=600 + i) for i in range(len(names))]
    outs = generate(engine, prompts, [params(MAX_TOKENS, policy=n, **SPECS[n], **context) for n in names])
    for name, prompt, out in zip(names, prompts, outs):
        expected = _oracle(engine, oracle_model, prompt, name, **context)
        _assert_same(out, expected, f"{name} scope=context")
        assert out.kv_transfer_params["kvcomp"]["compressions"] == len(expected.compressions) == 1, name
    prompt = prompt_ids(1034, seed=700)
    spec = {**SPECS["snapkv"], "window": 32, "scope": "context", "context_tokens": 700}
    out = generate(engine, [prompt], params(MAX_TOKENS, policy="snapkv", **spec))[0]
    _assert_same(out, _oracle(engine, oracle_model, prompt, "snapkv", **spec), "chunked snapkv scope=context")


def test_one_shot_policies_asked_to_recompress_match_oracle(engine, oracle_model):
    """``decode=recompress``: every one-shot method that may recompress, in one batch, cuts its
    generated tokens back to its prompt budget as the oracle does (a recompression is due once a
    page is over the budget: within 40 tokens)."""
    from vllm_kvcomp.policies.registry import recompressing_policy_names

    tokens = 40
    names = [n for n in recompressing_policy_names() if not get_policy_class(n).RECOMPRESSES]
    specs = [{"policy": n, **SPECS[n], "decode": "recompress"} for n in names]
    prompts = [prompt_ids(PROMPT_LEN - 3 * i, seed=800 + i) for i in range(len(names))]
    outs = generate(engine, prompts, [params(tokens, **spec) for spec in specs])
    for spec, prompt, out in zip(specs, prompts, outs):
        expected = _oracle(engine, oracle_model, prompt, spec["policy"], tokens=tokens, decode="recompress")
        _assert_same(out, expected, f"{spec['policy']} decode=recompress")
        assert out.kv_transfer_params["kvcomp"]["compressions"] == len(expected.compressions) >= 2, spec["policy"]


def test_variants_match_oracle(engine, oracle_model):
    """Every policy's named variants (``VARIANTS``: e.g. ``heads=adaptive``) in one batch equal the
    oracle; h2o adaptive recompresses during decode with heads of unequal lengths (the engine
    right-aligns them for the policy)."""
    tokens = 40
    variants = [(n, extra) for n in POLICY_NAMES for extra in get_policy_class(n).VARIANTS.values()]
    specs = [{"policy": n, **SPECS[n], **extra} for n, extra in variants]
    prompts = [prompt_ids(PROMPT_LEN - 3 * i, seed=900 + i) for i in range(len(specs))]
    outs = generate(engine, prompts, [params(tokens, **spec) for spec in specs])
    for (name, extra), spec, prompt, out in zip(variants, specs, prompts, outs):
        expected = _oracle(engine, oracle_model, prompt, name, tokens=tokens, **extra)
        _assert_same(out, expected, str(spec))
        assert out.kv_transfer_params["kvcomp"]["compressions"] == len(expected.compressions), spec
    recompressed = [s for s, o in zip(specs, outs) if o.kv_transfer_params["kvcomp"]["compressions"] >= 2]
    assert {"policy": "h2o", **SPECS["h2o"], "heads": "adaptive"} in recompressed
