"""Live server, issue #20: operator limits on every route, bad JSON, the interval floor, usage truth."""

from __future__ import annotations

import math

import httpx
import openai
import pytest

from tests.server.conftest import Server, chat_text, prompt_ids
from vllm_kvcomp.server.operator_config import DEFAULT_MIN_INTERVAL
from vllm_kvcomp.server.protocol import MAX_JSON_DEPTH

pytestmark = pytest.mark.server

HEADER = "X-KV-Compression"
APPLIED = "x-kv-compression-applied"
GENERATE = "/inference/v1/generate"
MESSAGES = [{"role": "user", "content": chat_text(300, seed=4)}]


def http(server: Server) -> httpx.Client:
    return httpx.Client(base_url=server.url, timeout=120)


def error_param(response: httpx.Response) -> str:
    assert response.status_code == 400, response.text
    return response.json()["error"]["param"]


def tokens_body(server: Server, extra_args: dict | None = None, **sampling) -> dict:
    sampling_params = {"max_tokens": 3, "temperature": 0, **sampling}
    if extra_args is not None:
        sampling_params["extra_args"] = extra_args
    return {"model": server.model, "token_ids": prompt_ids(700, seed=5), "sampling_params": sampling_params}


# ---------------------------------------------------------------------------- item 2


def test_generate_extra_args_obey_the_operator_config(server):
    with http(server) as client:
        disallowed = client.post(GENERATE, json=tokens_body(server, {"kvcomp_policy": "entropy", "kvcomp_ratio": 0.01}))
        below = client.post(GENERATE, json=tokens_body(server, {"kvcomp_policy": "snapkv", "kvcomp_ratio": 0.01}))
        fine = client.post(GENERATE, json=tokens_body(server, {"kvcomp_policy": "snapkv", "kvcomp_ratio": 0.5}))
    assert error_param(disallowed) == "sampling_params.extra_args.kvcomp_policy"
    assert "not enabled on this server" in disallowed.text
    assert error_param(below) == "sampling_params.extra_args.kvcomp_ratio"
    assert fine.status_code == 200 and fine.headers[APPLIED] == "policy=snapkv; ratio=0.5"
    result = fine.json()["kv_transfer_params"]["kvcomp"]
    assert result["applied"] == "policy=snapkv; ratio=0.5" and result["compressions"] == 1


def test_generate_with_the_header_compresses(server):
    with http(server) as client:
        response = client.post(GENERATE, json=tokens_body(server), headers={HEADER: "streamingllm; ratio=0.25"})
    assert response.status_code == 200 and response.headers[APPLIED] == "policy=streamingllm; ratio=0.25"
    assert response.json()["kv_transfer_params"]["kvcomp"]["blocks_freed"] > 0


# ---------------------------------------------------------------------------- item 3


def route_requests(server: Server) -> dict[str, dict]:
    """One small request per compressing route (besides chat, completions and generate)."""
    return {
        "/v1/responses": {"model": server.model, "input": MESSAGES[0]["content"], "max_output_tokens": 16},
        "/v1/messages": {"model": server.model, "max_tokens": 3, "messages": MESSAGES},
        "/invocations": {"model": server.model, "max_tokens": 3, "messages": MESSAGES},
        "/v1/chat/completions/batch": {"model": server.model, "max_tokens": 3, "messages": [MESSAGES, MESSAGES]},
        "/v1/chat/completions/render": {"model": server.model, "max_tokens": 3, "messages": MESSAGES},
    }


@pytest.mark.parametrize("path", ["/v1/responses", "/v1/messages", "/invocations", "/v1/chat/completions/batch",
                                  "/v1/chat/completions/render"])
def test_other_generate_routes_apply_the_spec_and_the_allow_list(server, path):
    body = route_requests(server)[path]
    with http(server) as client:
        refused = client.post(path, json=body, headers={HEADER: "entropy"})
        xargs = client.post(path, json={**body, "vllm_xargs": {"kvcomp_policy": "entropy"}})
        response = client.post(path, json=body, headers={HEADER: "streamingllm; ratio=0.25"})
    assert error_param(refused) == "X-KV-Compression.policy" and error_param(xargs) == "vllm_xargs.kvcomp_policy"
    assert response.status_code == 200, response.text
    assert response.headers[APPLIED] == "policy=streamingllm; ratio=0.25"
    data = response.json()
    if path == "/v1/chat/completions/render":  # the rendered engine request carries the resolved keys
        extra = data["sampling_params"]["extra_args"]
        assert {k: v for k, v in extra.items() if k.startswith("kvcomp_")} == {
            "kvcomp_policy": "streamingllm", "kvcomp_ratio": 0.25}
    elif path != "/v1/messages":
        ext = data["usage"]["kv_compression"]
        assert ext["policy"] == "streamingllm" and ext["compressions"] >= 1 and ext["blocks_freed"] > 0


def test_scoring_routes_refuse_compression_settings(server):
    with http(server) as client:
        response = client.post("/generative_scoring", json={"model": server.model, "query": "a", "items": ["b"]},
                               headers={HEADER: "snapkv"})
    assert error_param(response) == HEADER and "/generative_scoring" in response.text


# ---------------------------------------------------------------------------- items 4, 5, 8


def post_raw(server: Server, path: str, raw: bytes, headers: dict | None = None) -> httpx.Response:
    with http(server) as client:
        return client.post(path, content=raw, headers={"content-type": "application/json", **(headers or {})})


def test_conflicting_duplicate_keys_are_refused_naming_both(server):
    raw = (b'{"model":"%s","messages":[{"role":"user","content":"hi"}],"max_tokens":2,'
           b'"vllm_xargs":{"KVComp_Policy":"snapkv","kvcomp_policy":"h2o"}}' % server.model.encode())
    response = post_raw(server, "/v1/chat/completions", raw)
    assert error_param(response) == "vllm_xargs.kvcomp_policy"
    assert "KVComp_Policy='snapkv'" in response.text and "kvcomp_policy='h2o'" in response.text


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/tokenize", GENERATE, "/invocations",
                                  "/inference/v1/abort_requests"])
def test_deep_json_is_a_400_without_a_traceback(server, path):
    log_before = server.log_path.read_text(errors="replace")
    for depth in (MAX_JSON_DEPTH + 1, 100_000):
        raw = b'{"model":"m","messages":' + b"[" * depth + b"]" * depth + b"}"
        response = post_raw(server, path, raw)
        assert error_param(response) == "body" and "levels of nesting" in response.text
    new_log = server.log_path.read_text(errors="replace")[len(log_before):]
    assert "Traceback" not in new_log and " ERROR " not in new_log


def test_full_width_digits_are_refused_in_the_body_and_xargs(server):
    client = server.client()
    for body in ({"kv_compression": {"policy": "snapkv", "ratio": "０.２５"}},
                 {"vllm_xargs": {"kvcomp_policy": "snapkv", "kvcomp_ratio": "０.２５"}}):
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model=server.model, messages=MESSAGES, max_tokens=2, extra_body=body)
        assert "ASCII digits" in caught.value.response.text


# ---------------------------------------------------------------------------- item 6


DECODE_STEPS = 96


@pytest.mark.parametrize("spec", [f"streamingllm; ratio=0.25; interval={DEFAULT_MIN_INTERVAL}",
                                  f"lagkv; ratio=0.25; lag={DEFAULT_MIN_INTERVAL}; sink=4"])
def test_a_request_is_compressed_at_most_once_per_min_interval_steps(server, spec):
    """The smallest interval (lagkv: lag) the default bounds allow: over N decode steps a request
    is compressed at most 1 + ceil(N / min_interval) times (the prefill one, then one per floor)."""
    response = server.client().completions.create(
        model=server.model, prompt=prompt_ids(700, seed=6), max_tokens=DECODE_STEPS + 1, temperature=0,
        extra_headers={HEADER: spec}, extra_body={"ignore_eos": True},
    )
    ext = response.usage.model_extra["kv_compression"]
    assert response.usage.completion_tokens == DECODE_STEPS + 1
    assert 2 <= ext["compressions"] <= 1 + math.ceil(DECODE_STEPS / DEFAULT_MIN_INTERVAL)


@pytest.mark.parametrize("spec", ["streamingllm; ratio=0.25; interval=1", "h2o; ratio=0.5; interval=2",
                                  "sagekv; ratio=0.5; interval=1", "lagkv; ratio=0.25; lag=2; sink=4",
                                  "lagkv; ratio=0.9; lag=8; sink=4",
                                  "snapkv; ratio=0.25; decode=recompress; interval=1",
                                  "knorm; ratio=0.25; decode=recompress"])
def test_a_hostile_request_is_refused_or_held_to_the_floor(server, spec):
    """Whatever a client asks, it gets a 400 or at most 1 + ceil(N / min_interval) compressions
    in N decode steps: the compression work it adds to its neighbours' steps is bounded."""
    with http(server) as client:
        response = client.post("/v1/completions", headers={HEADER: spec}, json={
            "model": server.model, "prompt": prompt_ids(700, seed=7), "max_tokens": DECODE_STEPS + 1,
            "temperature": 0, "ignore_eos": True})
    if response.status_code == 400:
        assert f">= {DEFAULT_MIN_INTERVAL}" in response.text
        return
    assert response.status_code == 200, response.text
    compressions = response.json()["usage"]["kv_compression"]["compressions"]
    assert compressions <= 1 + math.ceil(DECODE_STEPS / DEFAULT_MIN_INTERVAL)


@pytest.mark.parametrize(("spec", "param"), [
    ("streamingllm; ratio=0.25; interval=1", "X-KV-Compression.interval"),
    (f"h2o; interval={DEFAULT_MIN_INTERVAL - 1}", "X-KV-Compression.interval"),
    ("lagkv; lag=4", "X-KV-Compression.lag"),
])
def test_recompressing_more_often_than_the_floor_is_refused(server, spec, param):
    with http(server) as client:
        response = client.post("/v1/chat/completions", json={"model": server.model, "messages": MESSAGES},
                               headers={HEADER: spec})
    assert error_param(response) == param and f"an integer >= {DEFAULT_MIN_INTERVAL}" in response.text


# ---------------------------------------------------------------------------- items 7, 9


def test_lagkv_lag_1_is_refused_as_a_no_op(server):
    with http(server) as client:
        response = client.post("/v1/chat/completions", json={"model": server.model, "messages": MESSAGES},
                               headers={HEADER: "lagkv; lag=1"})
    assert error_param(response) == "X-KV-Compression.lag" and "compresses nothing" in response.text


@pytest.mark.parametrize(("prompt", "lag"), [(90, 16), (333, 16), (700, 32), (1290, 64)])
def test_lagkv_kept_fraction_is_never_above_one(server, prompt, lag):
    response = server.client().completions.create(
        model=server.model, prompt=prompt_ids(prompt, seed=prompt), max_tokens=40, temperature=0,
        extra_headers={HEADER: f"lagkv; ratio=0.5; lag={lag}; sink=4"}, extra_body={"ignore_eos": True},
    )
    ext = response.usage.model_extra["kv_compression"]
    raw = response.model_extra["kv_transfer_params"]["kvcomp"]
    assert ext["compressions"] >= (1 if prompt >= 4 + 2 * lag else 0)
    assert 0 < ext["kept_fraction"] <= 1 and 0 < raw["kept_fraction"] <= 1


def test_only_compressed_requests_report_preemptions(server):
    client = server.client()
    plain = client.chat.completions.create(model=server.model, messages=MESSAGES, max_tokens=2)
    compressed = client.chat.completions.create(model=server.model, messages=MESSAGES, max_tokens=2,
                                                extra_headers={HEADER: "snapkv; ratio=0.5"})
    assert "preemptions" not in plain.usage.model_extra["kv_compression"]
    assert compressed.usage.model_extra["kv_compression"]["preemptions"] == 0
