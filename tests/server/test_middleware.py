"""The middleware without vLLM: an ASGI stub stands in for the server and its engine client."""

from __future__ import annotations

import json
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from starlette.testclient import TestClient

from vllm_kvcomp.server import protocol
from vllm_kvcomp.server.middleware import KVCompressionMiddleware
from vllm_kvcomp.server.operator_config import OperatorConfig
from vllm_kvcomp.spec import MAX_HEADER_LENGTH

HEADER = "X-KV-Compression"
APPLIED = "x-kv-compression-applied"
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
BASE = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def engine_result(policy: str, prompt: int, kept: int, blocks: int) -> dict[str, Any]:
    """What the engine's connector puts into ``kv_transfer_params['kvcomp']``."""
    return {"applied": f"policy={policy}", "policy": policy, "prompt_tokens": prompt, "compressions": 1,
            "tokens_kept": kept, "kept_max_head": kept, "kept_fraction": kept / prompt,
            "tokens_evicted": (prompt - kept) * 6, "blocks_freed": blocks, "compression_seconds": 0.01,
            "preemptions": 0}


class FakeEngine:
    """An engine client whose ``generate`` yields two outputs; the last carries ``results[id]``."""

    def __init__(self) -> None:
        self.results: dict[str, dict[str, Any] | None] = {}
        self.closed: list[str] = []

    async def generate(self, prompt: Any, sampling_params: Any, request_id: str, **kwargs: Any):
        try:
            for finished in (False, True):
                result = self.results.get(request_id) if finished else None
                yield SimpleNamespace(prompt_token_ids=[1] * 40 if not finished else None, finished=finished,
                                      kv_transfer_params=None if result is None else {"kvcomp": result})
        finally:
            self.closed.append(request_id)


class Stub:
    """Stands in for vLLM: records the request it got, runs the engine, answers with ``reply``."""

    def __init__(self, reply: Callable[[Any, dict], Any] | None = None):
        self.requests: list[dict[str, Any]] = []
        self.reply = reply or json_reply

    async def __call__(self, scope, receive, send):
        message = await receive()
        self.requests.append({"headers": dict(scope["headers"]), "raw": message["body"]})
        await self.reply(scope, send)

    @property
    def body(self) -> dict[str, Any]:
        return json.loads(self.requests[-1]["raw"])


async def run_engine(scope, request_ids: list[str]) -> None:
    engine = scope["app"].state.engine_client
    for rid in request_ids:
        async for _ in engine.generate(None, None, rid):
            pass


async def send_json(send, status: int, data: dict) -> None:
    body = json.dumps(data).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


async def json_reply(scope, send) -> None:
    if scope["path"] == COMPLETIONS:
        await run_engine(scope, ["cmpl-1-0", "cmpl-1-1"])
        await send_json(send, 200, {"id": "cmpl-1", "usage": {"prompt_tokens": 80}})
    else:
        await run_engine(scope, ["chatcmpl-1"])
        await send_json(send, 200, {"id": "chatcmpl-1", "usage": {"prompt_tokens": 40}})


def sse_reply(events: list[dict | str], piece: int) -> Callable:
    """A streamed reply of ``events`` (``[DONE]`` last) cut into ``piece``-byte body messages."""

    async def reply(scope, send) -> None:
        await run_engine(scope, ["chatcmpl-1"])
        data = b"".join(b"data: " + (e.encode() if isinstance(e, str) else json.dumps(e).encode()) + b"\n\n"
                        for e in events)
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream; charset=utf-8")]})
        for start in range(0, len(data), piece):
            await send({"type": "http.response.body", "body": data[start:start + piece], "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    return reply


def make(stub: Stub, config: OperatorConfig | None = None, engine: FakeEngine | None = None,
         config_path: str | None = None) -> TestClient:
    """TestClient for the middleware over ``stub``; ``app.state`` as vLLM's server has it."""
    state = SimpleNamespace(args=SimpleNamespace(kv_compression_config=config_path),
                            engine_client=engine or FakeEngine())
    middleware = KVCompressionMiddleware(stub, config=config)

    async def app(scope, receive, send):
        scope["app"] = SimpleNamespace(state=state)
        await middleware(scope, receive, send)

    return TestClient(app)


def error_of(response) -> dict[str, Any]:
    assert response.status_code == 400
    data = response.json()
    assert set(data) == {"error"} and set(data["error"]) == {"message", "type", "param", "code"}
    assert data["error"]["type"] == "BadRequestError" and data["error"]["code"] == 400
    assert data["error"]["message"].startswith(data["error"]["param"] + ": ")
    return data["error"]


# ---------------------------------------------------------------------------- request side

SOURCES = {
    "header": ({HEADER: "policy=snapkv; ratio=0.3"}, {}),
    "body": ({}, {"kv_compression": {"policy": "snapkv", "ratio": 0.3}}),
    "xargs": ({}, {"vllm_xargs": {"kvcomp_policy": "snapkv", "kvcomp_ratio": "0.3"}}),
    "header and body agreeing": ({HEADER: "snapkv;ratio=0.30"}, {"kv_compression": {"Policy": "SNAPKV", "ratio": 0.3}}),
}


@pytest.mark.parametrize("source", SOURCES)
def test_every_source_becomes_the_same_xargs(source):
    headers, extra = SOURCES[source]
    stub = Stub()
    response = make(stub).post(CHAT, json={**BASE, **extra}, headers=headers)
    assert response.status_code == 200
    assert response.headers[APPLIED] == "policy=snapkv; ratio=0.3"
    assert stub.body == {**BASE, "vllm_xargs": {"kvcomp_policy": "snapkv", "kvcomp_ratio": 0.3}}
    assert int(stub.requests[0]["headers"][b"content-length"]) == len(stub.requests[0]["raw"])


def test_client_kvcomp_keys_are_replaced_and_other_xargs_kept():
    stub = Stub()
    config = OperatorConfig.validate_mapping({"policies": {"h2o": {"window": 16, "ratio": 0.5}}})
    body = {**BASE, "vllm_xargs": {"foo": 1, "kvcomp_policy": "h2o", "kvcomp_budget": 128}}
    response = make(stub, config).post(CHAT, json=body)
    assert response.headers[APPLIED] == "policy=h2o; budget=128; window=16"
    assert stub.body["vllm_xargs"] == {"foo": 1, "kvcomp_policy": "h2o", "kvcomp_budget": 128, "kvcomp_window": 16}


def test_silent_requests_get_the_operator_default_and_none_opts_out():
    config = OperatorConfig.validate_mapping({"default": "lagkv; ratio=0.25"})
    stub = Stub()
    client = make(stub, config)
    silent = client.post(CHAT, json={**BASE, "vllm_xargs": {"foo": "bar"}})
    assert silent.headers[APPLIED] == config.default_spec.to_header()
    assert stub.body["vllm_xargs"] == {"foo": "bar", **config.default_spec.to_xargs()}
    for opt_out in ({"headers": {HEADER: "none"}}, {"json": {**BASE, "kv_compression": {"policy": "full"}}}):
        response = client.post(CHAT, **{"json": BASE, **opt_out})
        assert response.headers[APPLIED] == "none"
        assert "vllm_xargs" not in stub.body and "kv_compression" not in stub.body


def test_operator_config_comes_from_the_server_arguments(tmp_path):
    path = tmp_path / "ops.yaml"
    path.write_text("allow: [full, snapkv]\n")
    stub = Stub()
    client = make(stub, config_path=str(path))
    assert client.post(CHAT, json=BASE, headers={HEADER: "snapkv"}).status_code == 200
    error = error_of(client.post(CHAT, json=BASE, headers={HEADER: "streamingllm"}))
    assert error["param"] == "X-KV-Compression.policy" and "allowed: full, snapkv" in error["message"]
    assert len(stub.requests) == 1


ERRORS = {
    "unknown policy": ({HEADER: "policy=zip"}, {}, "X-KV-Compression.policy", "lagkv"),
    "non-numeric": ({HEADER: "snapkv; ratio=lots"}, {}, "X-KV-Compression.ratio", "(0, 1]"),
    "out of range": ({HEADER: "snapkv; window=-3"}, {}, "X-KV-Compression.window", "integer in [0,"),
    "outside bounds": ({HEADER: "snapkv; budget=8"}, {}, "X-KV-Compression.budget", "[64, 1048576]"),
    "unknown key": ({HEADER: "snapkv; lag=4"}, {}, "X-KV-Compression.lag", "kernel"),
    "needs a profile": ({HEADER: "pod"}, {}, "X-KV-Compression.policy", "snapkv"),
    "malformed": ({HEADER: "snapkv; =3"}, {}, "X-KV-Compression", "key=value"),
    "key twice": ({HEADER: "snapkv; ratio=0.5; ratio=0.4"}, {}, "X-KV-Compression.ratio", "each key once"),
    "empty": ({HEADER: " ; "}, {}, "X-KV-Compression", "policy=NAME"),
    "too long": ({HEADER: "snapkv" + ";" * MAX_HEADER_LENGTH}, {}, "X-KV-Compression",
                 f"at most {MAX_HEADER_LENGTH} characters"),
    "body not an object": ({}, {"kv_compression": ["snapkv"]}, "kv_compression", '"policy"'),
    "body value": ({}, {"kv_compression": {"policy": "snapkv", "ratio": True}}, "kv_compression.ratio", "(0, 1]"),
    "xargs key": ({}, {"vllm_xargs": {"kvcomp_policy": "snapkv", "kvcomp_lag": 3}}, "vllm_xargs.kvcomp_lag",
                  "kernel"),
    "xargs disallowed by bounds": ({}, {"vllm_xargs": {"kvcomp_policy": "snapkv", "kvcomp_ratio": 0.01}},
                                   "vllm_xargs.kvcomp_ratio", "[0.05, 1]"),
    "disagreeing sources": ({HEADER: "snapkv"}, {"vllm_xargs": {"kvcomp_policy": "h2o"}}, "vllm_xargs",
                            "one source"),
}


@pytest.mark.parametrize("case", ERRORS)
def test_errors_are_openai_shaped_400s_and_nothing_is_forwarded(case):
    headers, extra, param, allowed = ERRORS[case]
    stub = Stub()
    error = error_of(make(stub).post(CHAT, json={**BASE, **extra}, headers=headers))
    assert error["param"] == param
    assert allowed in error["message"]
    assert stub.requests == []


def test_the_header_given_twice_is_refused():
    stub = Stub()
    response = make(stub).post(CHAT, json=BASE, headers=[(HEADER, "snapkv"), (HEADER, "snapkv")])
    assert error_of(response)["param"] == HEADER
    assert stub.requests == []


def test_other_routes_refuse_compression_settings_and_pass_the_rest_untouched():
    stub = Stub(reply=lambda scope, send: send_json(send, 200, {"ok": True}))
    client = make(stub)
    raw = b'{"prompt": "x",  "vllm_xargs": {"seed": 1}}'
    assert client.post("/tokenize", content=raw, headers={"content-type": "application/json"}).status_code == 200
    assert stub.requests[-1]["raw"] == raw
    assert client.get("/v1/models", headers={HEADER: "snapkv"}).status_code == 200  # not a POST
    refused = [
        client.post("/tokenize", content=raw, headers={HEADER: "snapkv", "content-type": "application/json"}),
        client.post("/generative_scoring", json={"query": "x", "kv_compression": {"policy": "snapkv"}}),
        client.post("/v1/systemone", json={"input": "x", "vllm_xargs": {"kvcomp_policy": "snapkv"}}),
        client.post("/v1/audio/transcriptions", files={"file": b"..."}, headers={HEADER: "snapkv"}),
    ]
    assert [error_of(r)["param"] for r in refused] == [HEADER, "kv_compression", "vllm_xargs", HEADER]
    assert "/generative_scoring" in error_of(refused[1])["message"]
    assert len(stub.requests) == 2


def test_a_body_that_is_not_json_gets_a_400_and_is_not_forwarded():
    stub = Stub()
    response = make(stub).post(CHAT, content=b"{not json", headers={HEADER: "snapkv", "content-type": "application/json"})
    assert error_of(response)["param"] == "body" and "not valid JSON" in response.json()["error"]["message"]
    assert stub.requests == [] and APPLIED not in response.headers


def test_an_empty_body_or_json_that_is_not_an_object_is_left_to_vllm():
    stub = Stub(reply=lambda scope, send: send_json(send, 422, {"error": {"message": "vLLM says no"}}))
    client = make(stub)
    for content in (b"", b"[1, 2]"):
        response = client.post(CHAT, content=content, headers={"content-type": "application/json"})
        assert response.status_code == 422 and stub.requests[-1]["raw"] == content


@settings(max_examples=60, deadline=None)
@given(header=st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=80).map(str.strip))
def test_any_header_is_forwarded_or_refused_with_a_400(header):
    stub = Stub()
    response = make(stub).post(CHAT, json=BASE, headers={HEADER: header})
    assert response.status_code in (200, 400)
    assert len(stub.requests) == (response.status_code == 200)
    if response.status_code == 400:
        assert error_of(response)["param"].startswith(HEADER)


# ---------------------------------------------------------------------------- response side


def test_json_response_gets_usage_extension_from_the_engine_result():
    engine = FakeEngine()
    engine.results["chatcmpl-1"] = engine_result("snapkv", 40, 12, 0)
    response = make(Stub(), engine=engine).post(CHAT, json=BASE, headers={HEADER: "snapkv; ratio=0.3"})
    assert response.headers[APPLIED] == "policy=snapkv; ratio=0.3"
    assert int(response.headers["content-length"]) == len(response.content)
    ext = response.json()["usage"]["kv_compression"]
    assert ext["tokens_kept"] == 12 and ext["kept_fraction"] == pytest.approx(12 / 40)
    assert ext["tokens_evicted"] == 28 * 6 and ext["policy"] == "snapkv"
    assert response.json()["usage"]["prompt_tokens"] == 40


def test_uncompressed_requests_report_everything_kept():
    response = make(Stub()).post(CHAT, json=BASE)
    assert response.headers[APPLIED] == "none"
    ext = response.json()["usage"]["kv_compression"]
    assert ext["policy"] == "full" and ext["tokens_kept"] == ext["prompt_tokens"] == 40
    assert ext["kept_fraction"] == 1.0 and ext["blocks_freed"] == 0


def test_a_request_the_engine_served_uncompressed_says_so_and_why():
    """The engine could not compress (e.g. the worker found an unsupported backend after loading):
    its result says ``applied: none`` with the reason; the JSON response's header follows it."""
    engine = FakeEngine()
    engine.results["chatcmpl-1"] = {**protocol.uncompressed_result(40), "requested": "policy=snapkv; ratio=0.3",
                                    "reason": "layer x uses ALiBi"}
    response = make(Stub(), engine=engine).post(CHAT, json=BASE, headers={HEADER: "snapkv; ratio=0.3"})
    assert response.headers[APPLIED] == "none"
    ext = response.json()["usage"]["kv_compression"]
    assert ext["applied"] == "none" and ext["reason"] == "layer x uses ALiBi"
    assert ext["requested"] == "policy=snapkv; ratio=0.3" and ext["kept_fraction"] == 1.0


@pytest.mark.parametrize("stream", [False, True])
def test_engines_that_cannot_compress_and_beam_search_apply_none(stream):
    """Known before the request runs (the engine's config; vLLM's beam search issues its own
    requests without the spec): the applied header says ``none`` from the first byte, streams too."""
    reply = sse_reply([{"id": "chatcmpl-1", "choices": []}, "[DONE]"], 10_000) if stream else None
    spec_engine = FakeEngine()
    spec_engine.vllm_config = SimpleNamespace(speculative_config=SimpleNamespace(method="eagle"))  # a draft model
    response = make(Stub(reply), engine=spec_engine).post(CHAT, json=BASE, headers={HEADER: "snapkv; ratio=0.3"})
    assert response.status_code == 200 and response.headers[APPLIED] == "none"
    beam = {**BASE, "use_beam_search": True, "n": 2}
    response = make(Stub(reply)).post(CHAT, json=beam, headers={HEADER: "snapkv; ratio=0.3"})
    assert response.status_code == 200 and response.headers[APPLIED] == "none"
    response = make(Stub(reply)).post(CHAT, json=BASE, headers={HEADER: "snapkv; ratio=0.3"})
    assert response.headers[APPLIED] == "policy=snapkv; ratio=0.3"  # a plain engine: what was asked


def test_completion_with_two_prompts_sums_their_results():
    engine = FakeEngine()
    engine.results.update({"cmpl-1-0": engine_result("h2o", 40, 10, 1), "cmpl-1-1": engine_result("h2o", 40, 30, 0)})
    response = make(Stub(), engine=engine).post(COMPLETIONS, json={"model": "m", "prompt": ["a", "b"]},
                                               headers={HEADER: "h2o; ratio=0.5"})
    ext = response.json()["usage"]["kv_compression"]
    assert (ext["prompt_tokens"], ext["tokens_kept"], ext["blocks_freed"]) == (80, 40, 1)
    assert ext["kept_fraction"] == 0.5 and ext["compressions"] == 2


CHUNK = {"id": "chatcmpl-1", "object": "chat.completion.chunk",
         "choices": [{"index": 0, "delta": {"content": "é"}, "finish_reason": None}]}
LAST = {**CHUNK, "choices": [{"index": 0, "delta": {"content": ""}, "finish_reason": "length"}]}
USAGE = {**CHUNK, "choices": [], "usage": {"prompt_tokens": 40, "completion_tokens": 3}}


def sse_events(text: str) -> list[dict | str]:
    events = [e[len("data: "):] for e in text.split("\n\n") if e]
    return [e if e == "[DONE]" else json.loads(e) for e in events]


@pytest.mark.parametrize("piece", [7, 10_000])
@pytest.mark.parametrize("with_usage", [False, True])
def test_stream_final_chunk_carries_the_numbers(piece, with_usage):
    engine = FakeEngine()
    engine.results["chatcmpl-1"] = engine_result("streamingllm", 40, 10, 0)
    events = [CHUNK, CHUNK, LAST, *([USAGE] if with_usage else []), "[DONE]"]
    response = make(Stub(sse_reply(events, piece)), engine=engine).post(
        CHAT, json={**BASE, "stream": True}, headers={HEADER: "streamingllm; ratio=0.25"})
    assert response.headers[APPLIED] == "policy=streamingllm; ratio=0.25"
    out = sse_events(response.text)
    assert len(out) == len(events) and out[-1] == "[DONE]"
    final = out[-2]
    ext = final["usage"]["kv_compression"] if with_usage else final["kv_compression"]
    assert ext["tokens_kept"] == 10 and ext["kept_fraction"] == 0.25
    assert out[:-2] == events[:-2]  # every other event passes unchanged
    if with_usage:
        assert final == {**USAGE, "usage": {**USAGE["usage"], "kv_compression": ext}}
    else:
        assert final == {**LAST, "kv_compression": ext}


def test_stream_without_done_is_flushed_unchanged():
    events = [CHUNK, LAST]
    response = make(Stub(sse_reply(events, 5))).post(CHAT, json={**BASE, "stream": True})
    assert sse_events(response.text) == events


def test_error_responses_pass_unchanged_without_applied_header():
    stub = Stub(reply=lambda scope, send: send_json(send, 404, {"error": {"message": "no such model"}}))
    response = make(stub).post(CHAT, json=BASE, headers={HEADER: "snapkv"})
    assert response.status_code == 404 and response.json() == {"error": {"message": "no such model"}}
    assert APPLIED not in response.headers


def test_the_engine_stream_is_closed_when_the_consumer_stops():
    engine = FakeEngine()

    async def reply(scope, send):
        stream = scope["app"].state.engine_client.generate(None, None, "chatcmpl-9")
        await stream.__anext__()
        await stream.aclose()  # a client that went away: vLLM aborts the request here
        await send_json(send, 200, {"id": "chatcmpl-9", "usage": {}})

    make(Stub(reply), engine=engine).post(CHAT, json=BASE)
    assert engine.closed == ["chatcmpl-9"]


def test_prompts_beyond_the_kv_cache_are_refused_unless_streamed():
    """--allow-prompts-beyond-kv-cache: a prompt the KV cache cannot hold is a 400-class validation
    error at the API server (as vLLM's own max_model_len check), unless compressed during prefill."""
    import types

    from vllm.exceptions import VLLMValidationError

    from vllm_kvcomp import vllm_compat
    from vllm_kvcomp.server.results import ResultTap

    def client(long_prompts: bool):
        extra = {"long_prompts": True} if long_prompts else {}
        config = types.SimpleNamespace(
            kv_transfer_config=types.SimpleNamespace(kv_connector_extra_config=extra),
            cache_config=types.SimpleNamespace(num_gpu_blocks=2 * 21, block_size=32),
            parallel_config=types.SimpleNamespace(data_parallel_size=2))
        return types.SimpleNamespace(vllm_config=config)

    assert vllm_compat.long_prompt_kv_cache_tokens(client(False)) is None
    assert vllm_compat.long_prompt_kv_cache_tokens(client(True)) == 20 * 32  # per engine, less the null block
    tap = ResultTap(kv_cache_tokens=640)
    plain = types.SimpleNamespace(extra_args={"kvcomp_policy": "snapkv"})
    streamed = types.SimpleNamespace(extra_args={"kvcomp_policy": "lagkv", "kvcomp_prefill": "stream"})
    tap.check_fits({"prompt_token_ids": list(range(639))}, plain)
    with pytest.raises(VLLMValidationError, match="prefill=stream"):
        tap.check_fits({"prompt_token_ids": list(range(640))}, plain)
    tap.check_fits({"prompt_token_ids": list(range(2600))}, streamed)
    ResultTap().check_fits({"prompt_token_ids": list(range(10**5))}, plain)  # without the flag: vLLM's checks
