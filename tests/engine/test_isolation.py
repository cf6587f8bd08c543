"""Bad specs and missing profiles never hurt a request (prefix sharing: test_prefix_cache.py)."""

from __future__ import annotations

import pytest

from tests.engine.conftest import generate, params, prompt_ids, token_logprobs

pytestmark = pytest.mark.engine


def _same(a, b, tol: float = 0.0) -> bool:
    """Same tokens, logprobs equal within ``tol`` (0 = bitwise)."""
    if list(a.outputs[0].token_ids) != list(b.outputs[0].token_ids):
        return False
    return all(abs(x - y) <= tol for x, y in zip(token_logprobs(a), token_logprobs(b)))


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


@pytest.mark.parametrize("where", ["score", "compact"])
def test_a_compression_that_fails_is_served_uncompressed_and_says_why(engine, monkeypatch, where):
    """An error at the prompt-end compression (a bug, nothing moved yet: the policy's score, or
    packing its selection into pages) must not stop the engine: the request is served exactly as
    uncompressed, its result names the failure, and the next compressed request compresses."""
    from vllm_kvcomp.engine.pages import RequestPages
    from vllm_kvcomp.policies.snapkv import SnapKV

    prompt = prompt_ids(300, seed=412)
    reference = generate(engine, [prompt], params(12))[0]

    def broken(self, *args, **kwargs):
        raise ValueError(f"{where} unavailable")

    with monkeypatch.context() as patch:
        patch.setattr(SnapKV if where == "score" else RequestPages, where, broken)
        out = generate(engine, [prompt], params(12, policy="snapkv", ratio=0.25))[0]
    assert _same(out, reference)
    stats = out.kv_transfer_params["kvcomp"]
    assert stats["applied"] == "none" and f"{where} unavailable" in stats["reason"], stats
    after = generate(engine, [prompt_ids(300, seed=413)], params(12, policy="snapkv", ratio=0.25))[0]
    assert after.kv_transfer_params["kvcomp"]["compressions"] == 1
