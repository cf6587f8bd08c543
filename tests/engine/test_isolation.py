"""Compressed requests never corrupt others: prefix cache, bad specs, missing profiles."""

from __future__ import annotations

from tests.engine.conftest import generate, params, prompt_ids, token_logprobs

PREFIX = 256


def _same(a, b, tol: float = 0.0) -> bool:
    """Same tokens, logprobs equal within ``tol`` (0 = bitwise)."""
    if list(a.outputs[0].token_ids) != list(b.outputs[0].token_ids):
        return False
    return all(abs(x - y) <= tol for x, y in zip(token_logprobs(a), token_logprobs(b)))


def test_prefix_cache_is_never_shared_with_compressed_requests(engine):
    prefix = prompt_ids(PREFIX, seed=400)
    plain = prefix + prompt_ids(40, seed=401)
    squeezed = prefix + prompt_ids(40, seed=402)
    generate(engine, [plain], params(16))  # populate the prefix cache
    reference = generate(engine, [plain], params(16))[0]  # a cache hit, like every run below
    assert reference.num_cached_tokens >= PREFIX

    compressed = generate(engine, [squeezed], params(16, policy="streamingllm", ratio=0.25))[0]
    assert compressed.num_cached_tokens == 0, "a compressed request read the shared prefix cache"
    assert compressed.kv_transfer_params["kvcomp"]["blocks_freed"] > 0

    again = generate(engine, [plain], params(16))[0]
    assert again.num_cached_tokens == reference.num_cached_tokens
    assert _same(again, reference)

    together = generate(engine, [squeezed, plain], [params(16, policy="streamingllm", ratio=0.25), params(16)])
    assert together[1].num_cached_tokens == reference.num_cached_tokens
    assert _same(together[1], reference, tol=1e-5)  # batching changes the kernel's work split


def test_invalid_spec_in_extra_args_is_served_uncompressed(engine):
    prompt = prompt_ids(200, seed=410)
    reference = generate(engine, [prompt], params(12))[0]
    for bad in ({"policy": "bogus"}, {"policy": "snapkv", "ratio": "lots"}, {"policy": "snapkv", "nope": 1}):
        out = generate(engine, [prompt], params(12, **bad))[0]
        assert _same(out, reference), bad
        assert out.kv_transfer_params is None


def test_missing_profile_is_served_uncompressed(engine):
    prompt = prompt_ids(200, seed=411)
    reference = generate(engine, [prompt], params(12))[0]
    out = generate(engine, [prompt], params(12, policy="razor", profile="missing"))[0]
    assert _same(out, reference)
    assert out.kv_transfer_params["kvcomp"]["compressions"] == 0
