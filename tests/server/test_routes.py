"""Issue #20: operator limits hold on every route, one validation for every place a setting can be.

The middleware over an ASGI stub (see test_middleware.py): which body reaches vLLM, or which 400.
"""

from __future__ import annotations

import json
import logging

import pytest

from tests.server.test_middleware import (
    APPLIED,
    BASE,
    HEADER,
    FakeEngine,
    Stub,
    engine_result,
    error_of,
    make,
    send_json,
)
from vllm_kvcomp.server import protocol
from vllm_kvcomp.server.operator_config import OperatorConfig

# An operator who allows only compressed policies: no `full`, no `entropy`, a compressing default.
STRICT = OperatorConfig.validate_mapping({
    "default": "streamingllm; ratio=0.25",
    "allow": ["streamingllm", "snapkv", "lagkv"],
})
GENERATE = "/inference/v1/generate"
TOKENS = {"token_ids": [5, 6, 7], "sampling_params": {"max_tokens": 3}}
# A minimal body of each compressing route (what vLLM would accept there).
ROUTE_BODIES = {
    "/v1/chat/completions": BASE,
    "/v1/completions": {"model": "m", "prompt": "hi"},
    "/v1/chat/completions/batch": {"model": "m", "messages": [[{"role": "user", "content": "hi"}]]},
    "/v1/responses": {"model": "m", "input": "hi"},
    "/v1/messages": {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]},
    "/invocations": BASE,
    "/v1/chat/completions/render": BASE,
    "/v1/completions/render": {"model": "m", "prompt": "hi"},
    "/v1/responses/render": {"model": "m", "input": "hi"},
    "/v1/messages/render": {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]},
    GENERATE: TOKENS,
}


def ok_stub() -> Stub:
    return Stub(reply=lambda scope, send: send_json(send, 200, {"ok": True}))


def engine_keys(path: str, body: dict) -> dict:
    """The kvcomp_* keys vLLM reads on ``path``: vllm_xargs, or sampling_params.extra_args."""
    if path == GENERATE:
        place = body.get("sampling_params", {}).get("extra_args") or {}
    else:
        place = body.get("vllm_xargs") or {}
    return {k: v for k, v in place.items() if k.startswith("kvcomp_")}


def test_the_route_table_covers_the_routes_in_the_docs():
    from pathlib import Path

    text = (Path(__file__).parents[2] / "docs" / "operator_config.md").read_text()
    assert set(ROUTE_BODIES) == set(protocol.ROUTES)
    for path in protocol.ROUTES:
        assert f"`POST {path}`" in text


# ---------------------------------------------------------------------------- item 2


def test_generate_extra_args_go_through_the_allow_list_and_bounds():
    stub = ok_stub()
    client = make(stub, STRICT)
    disallowed = {**TOKENS, "sampling_params": {"max_tokens": 3, "extra_args": {
        "kvcomp_policy": "entropy", "kvcomp_ratio": 0.01}}}
    error = error_of(client.post(GENERATE, json=disallowed))
    assert error["param"] == "sampling_params.extra_args.kvcomp_policy"
    assert "not enabled on this server" in error["message"]
    below = {**TOKENS, "sampling_params": {"extra_args": {"kvcomp_policy": "snapkv", "kvcomp_ratio": 0.01}}}
    error = error_of(client.post(GENERATE, json=below))
    assert error["param"] == "sampling_params.extra_args.kvcomp_ratio" and "[0.05, 1]" in error["message"]
    assert stub.requests == []


def test_generate_gets_the_resolved_spec_in_extra_args_and_nowhere_else():
    stub = ok_stub()
    config = OperatorConfig.validate_mapping({"policies": {"snapkv": {"window": 16}}})
    body = {**TOKENS, "vllm_xargs": {"kvcomp_policy": "snapkv", "other": 1},
            "sampling_params": {"max_tokens": 3, "extra_args": {"seed_text": "x", "KVComp_Policy": "SnapKV"}}}
    response = make(stub, config).post(GENERATE, json=body)
    assert response.status_code == 200 and response.headers[APPLIED] == "policy=snapkv; window=16"
    assert stub.body["sampling_params"] == {"max_tokens": 3, "extra_args": {
        "seed_text": "x", "kvcomp_policy": "snapkv", "kvcomp_window": 16}}
    assert stub.body["vllm_xargs"] == {"other": 1}


def test_generate_extra_args_disagreeing_with_the_header_are_refused():
    stub = ok_stub()
    body = {**TOKENS, "sampling_params": {"extra_args": {"kvcomp_policy": "h2o"}}}
    error = error_of(make(stub).post(GENERATE, json=body, headers={HEADER: "snapkv"}))
    assert error["param"] == "sampling_params.extra_args" and "X-KV-Compression" in error["message"]


# ---------------------------------------------------------------------------- item 3


@pytest.mark.parametrize("path", ROUTE_BODIES)
def test_every_generate_route_gets_the_operator_default(path):
    stub = ok_stub()
    response = make(stub, STRICT).post(path, json=ROUTE_BODIES[path])
    assert response.status_code == 200
    assert response.headers[APPLIED] == "policy=streamingllm; ratio=0.25"
    assert engine_keys(path, stub.body) == {"kvcomp_policy": "streamingllm", "kvcomp_ratio": 0.25}


@pytest.mark.parametrize("path", ROUTE_BODIES)
@pytest.mark.parametrize("opt_out", [{"headers": {HEADER: "none"}},
                                     {"body": {"kv_compression": {"policy": "full"}}},
                                     {"body": {"vllm_xargs": {"kvcomp_policy": "h2o"}}}])
def test_every_generate_route_applies_the_allow_list(path, opt_out):
    stub = ok_stub()
    body = {**ROUTE_BODIES[path], **opt_out.get("body", {})}
    error = error_of(make(stub, STRICT).post(path, json=body, headers=opt_out.get("headers", {})))
    assert error["param"].endswith("policy") and "streamingllm, snapkv, lagkv" in error["message"]
    assert stub.requests == []


REFUSING = ["/generative_scoring", "/v1/systemone", "/v1/messages/count_tokens", "/tokenize",
            "/v1/completions/derender", "/cohere/v2/chat", "/v1/embeddings", "/no/such/route"]


@pytest.mark.parametrize("path", REFUSING)
def test_routes_that_cannot_honour_a_spec_refuse_every_place(path):
    stub = ok_stub()
    client = make(stub, STRICT)
    places = {
        "X-KV-Compression": ({HEADER: "snapkv"}, {}),
        "kv_compression": ({}, {"kv_compression": {"policy": "snapkv"}}),
        "vllm_xargs": ({}, {"vllm_xargs": {"KVCOMP_POLICY": "snapkv"}}),
        "sampling_params.extra_args": ({}, {"sampling_params": {"extra_args": {"kvcomp_ratio": 0.5}}}),
    }
    for param, (headers, body) in places.items():
        error = error_of(client.post(path, json={"model": "m", **body}, headers=headers))
        assert error["param"] == param and path in error["message"] and GENERATE in error["message"]
    assert client.post(path, json={"model": "m", "vllm_xargs": {"seed": 1}}).status_code == 200
    assert len(stub.requests) == 1


def test_audio_form_fields_carrying_kvcomp_keys_are_refused():
    stub = ok_stub()
    client = make(stub)
    form = {"model": "m", "vllm_xargs": json.dumps({"kvcomp_policy": "snapkv"})}
    response = client.post("/v1/audio/transcriptions", data=form, files={"file": ("a.wav", b"RIFF....")})
    assert error_of(response)["param"] == "vllm_xargs"
    fine = client.post("/v1/audio/transcriptions", data={"model": "m", "vllm_xargs": '{"seed": 1}'},
                       files={"file": ("a.wav", b"RIFF....")})
    assert fine.status_code == 200 and len(stub.requests) == 1


@pytest.mark.parametrize(("path", "engine_ids", "reply"), [
    ("/v1/chat/completions/batch", ["chatcmpl-7_0", "chatcmpl-7_1"], {"id": "chatcmpl-7", "object": "chat.completion"}),
    ("/v1/responses", ["resp_7_0"], {"id": "resp_7", "object": "response"}),
    ("/invocations", ["cmpl-7-0", "cmpl-7-1"], {"id": "cmpl-7", "object": "text_completion"}),
    ("/invocations", ["chatcmpl-7"], {"id": "chatcmpl-7", "object": "chat.completion"}),
])
def test_usage_extension_on_the_other_routes(path, engine_ids, reply):
    engine = FakeEngine()
    for rid in engine_ids:
        engine.results[rid] = engine_result("snapkv", 40, 10, 1)

    async def answer(scope, send):
        for rid in engine_ids:
            async for _ in scope["app"].state.engine_client.generate(None, None, rid):
                pass
        await send_json(send, 200, {**reply, "usage": {"prompt_tokens": 40 * len(engine_ids)}})

    response = make(Stub(answer), engine=engine).post(path, json=ROUTE_BODIES[path], headers={HEADER: "snapkv"})
    ext = response.json()["usage"]["kv_compression"]
    assert ext["prompt_tokens"] == 40 * len(engine_ids) and ext["blocks_freed"] == len(engine_ids)


# ---------------------------------------------------------------------------- item 4


CONFLICTS = {
    "case variants in vllm_xargs": (
        {}, b'{"model":"m","messages":[],"vllm_xargs":{"KVComp_Policy":"snapkv","kvcomp_policy":"h2o"}}',
        "vllm_xargs.kvcomp_policy", ["KVComp_Policy='snapkv'", "kvcomp_policy='h2o'"]),
    "repeated JSON key in kv_compression": (
        {}, b'{"model":"m","messages":[],"kv_compression":{"policy":"snapkv","ratio":0.3,"ratio":0.5}}',
        "kv_compression.ratio", ["ratio=0.3", "ratio=0.5"]),
    "case variants in kv_compression": (
        {}, b'{"model":"m","messages":[],"kv_compression":{"policy":"snapkv","Ratio":0.3,"RATIO":"0.5"}}',
        "kv_compression.RATIO", ["Ratio=0.3", "RATIO='0.5'"]),
    "kv_compression twice": (
        {}, b'{"model":"m","messages":[],"kv_compression":{"policy":"snapkv"},"KV_Compression":{"policy":"h2o"}}',
        "KV_Compression", ["kv_compression=", "KV_Compression="]),
    "vllm_xargs twice": (
        {}, b'{"model":"m","messages":[],"vllm_xargs":{"kvcomp_policy":"snapkv"},"vllm_xargs":{"kvcomp_policy":"h2o"}}',
        "vllm_xargs", ["'policy=h2o'", "'policy=snapkv'"]),
    "header and body": (
        {HEADER: "snapkv; ratio=0.3"}, b'{"model":"m","messages":[],"kv_compression":{"policy":"snapkv","ratio":0.5}}',
        "kv_compression", ["X-KV-Compression", "ratio=0.3", "ratio=0.5"]),
}


@pytest.mark.parametrize("case", CONFLICTS)
def test_conflicting_duplicates_are_refused_naming_both(case):
    headers, raw, param, named = CONFLICTS[case]
    stub = Stub()
    response = make(stub).post("/v1/chat/completions", content=raw,
                               headers={**headers, "content-type": "application/json"})
    error = error_of(response)
    assert error["param"] == param
    for text in named:
        assert text in error["message"]
    assert stub.requests == []


def test_the_same_setting_twice_with_the_same_value_is_fine_and_case_does_not_matter():
    stub = Stub()
    raw = (b'{"model":"m","messages":[],"KV_Compression":{"Policy":"SnapKV","ratio":0.3,"RATIO":"0.3 "},'
           b'"vllm_xargs":{"KVCOMP_policy":"snapkv","kvcomp_ratio":0.3,"kvcomp_ratio":0.3,"seed":2}}')
    response = make(stub).post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
    assert response.status_code == 200 and response.headers[APPLIED] == "policy=snapkv; ratio=0.3"
    assert stub.body["vllm_xargs"] == {"seed": 2, "kvcomp_policy": "snapkv", "kvcomp_ratio": 0.3}
    assert "KV_Compression" not in stub.body


# ---------------------------------------------------------------------------- item 5


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/tokenize", GENERATE, "/abort_requests"])
@pytest.mark.parametrize("depth", [protocol.MAX_JSON_DEPTH + 1, 5000, 100_000])
def test_deeply_nested_json_is_a_400_without_traceback_or_error_log(path, depth, caplog):
    stub = Stub()
    raw = b'{"model":"m","messages":' + b"[" * depth + b"]" * depth + b"}"
    with caplog.at_level(logging.DEBUG):
        response = make(stub).post(path, content=raw, headers={"content-type": "application/json"})
    error = error_of(response)
    assert error["param"] == "body" and f"at most {protocol.MAX_JSON_DEPTH} levels" in error["message"]
    assert "Traceback" not in response.text and stub.requests == []
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_nesting_up_to_the_limit_is_forwarded():
    stub = Stub()
    depth = protocol.MAX_JSON_DEPTH - 2
    body = {**BASE, "extra": json.loads("[" * depth + "]" * depth)}
    assert make(stub).post("/v1/chat/completions", json=body).status_code == 200


@pytest.mark.parametrize("raw", [b'{"model":"m","n":' + b"9" * 5000 + b"}", b'{"model":"\xff"}'])
def test_json_python_cannot_convert_is_a_400(raw):
    stub = Stub()
    response = make(stub).post("/invocations", content=raw, headers={"content-type": "application/json"})
    assert error_of(response)["param"] == "body" and stub.requests == []


# ---------------------------------------------------------------------------- item 8


@pytest.mark.parametrize("extra", [
    {"kv_compression": {"policy": "snapkv", "ratio": "０.２５"}},
    {"vllm_xargs": {"kvcomp_policy": "snapkv", "kvcomp_ratio": "０.２５"}},
    {"vllm_xargs": {"kvcomp_policy": "snapkv", "kvcomp_budget": "１２８"}},
    {"kv_compression": {"policy": "snapkv", "budget": "1_000"}},
])
def test_numbers_in_text_must_be_ascii_digits(extra):
    stub = Stub()
    error = error_of(make(stub).post("/v1/chat/completions", json={**BASE, **extra}))
    assert "in ASCII digits" in error["message"] and stub.requests == []


def test_huge_integers_are_a_400_naming_the_field():
    stub = Stub()
    body = {**BASE, "kv_compression": {"policy": "snapkv", "budget": 10**400}}
    error = error_of(make(stub).post("/v1/chat/completions", content=json.dumps(body).encode(),
                                     headers={"content-type": "application/json"}))
    assert error["param"] == "kv_compression.budget" and "401 digits" in error["message"]


# ---------------------------------------------------------------------------- item 9


def test_uncompressed_requests_leave_preemptions_out():
    response = make(Stub()).post("/v1/chat/completions", json=BASE)
    ext = response.json()["usage"]["kv_compression"]
    assert ext["policy"] == "full" and "preemptions" not in ext


def test_preemptions_are_summed_over_the_results_that_track_them():
    tracked = {**engine_result("h2o", 40, 10, 1), "preemptions": 2}
    ext = protocol.usage_extension([tracked, protocol.uncompressed_result(40)])
    assert ext["preemptions"] == 2
    assert "preemptions" not in protocol.usage_extension([protocol.uncompressed_result(40)])
