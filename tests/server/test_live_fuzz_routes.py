"""Live server, property-based (issue #20): random JSON on every POST route, with and without the
header, never gets a 5xx; every POST route vLLM serves is classified (compresses or refuses).

Bodies are written by hand (not ``json.dumps``) so that they can repeat keys, nest thousands of
levels deep, carry numbers no float holds and bytes that are not UTF-8. Every body asks for at
most one generated token, so the requests that do reach the engine stay cheap.
"""

from __future__ import annotations

import json
import urllib.request

import httpx
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tests.server.conftest import Server
from vllm_kvcomp.policies.registry import POLICY_NAMES
from vllm_kvcomp.server.protocol import ROUTES

pytestmark = pytest.mark.server

HEADER = "X-KV-Compression"
# POST routes of vLLM 0.32 (tiny generate model, --enable-scale-out) that do not compress.
REFUSING = (
    "/tokenize", "/detokenize", "/v1/messages/count_tokens", "/v1/chat/completions/derender",
    "/v1/completions/derender", "/generative_scoring", "/v1/systemone", "/ping",
    "/inference/v1/abort_requests", "/is_scaling_elastic_ep", "/scale_elastic_ep",
    "/v1/responses/{response_id}/cancel",
)
FUZZED = (*ROUTES, *(r for r in REFUSING if r != "/scale_elastic_ep"), "/v1/responses/resp_1/cancel",
          "/v1/embeddings", "/no/such/route")
ONE_TOKEN = {"max_tokens": 1, "max_completion_tokens": 1, "max_output_tokens": 1, "n": 1, "stream": False}
KEYS = ("model", "messages", "prompt", "input", "token_ids", "sampling_params", "extra_args", "vllm_xargs",
        "kv_compression", "KV_Compression", "kvcomp_policy", "KVComp_Ratio", "kvcomp_ratio", "kvcomp_lag",
        "kvcomp_interval", "policy", "ratio", "budget", "lag", "interval", "role", "content", "request_ids",
        "temperature", "seed", "query", "items")
WORDS = (*POLICY_NAMES, "none", "user", "assistant", "０.２５", "１６", "٣", "1_000", "0.25", "16", "1e999", "-0",
         "nan", "inf", "", "\u2003", "\ud800")
NUMBERS = ("1e999", "-1e999", "1" * 500, "-" + "9" * 330, "0.1e-400", "1E+2", "-0", "0.5", "16", "1", "0")

scalars = st.one_of(
    st.sampled_from(("null", "true", "false")),
    st.sampled_from(NUMBERS),
    st.integers(-(1 << 70), 1 << 70).map(str),
    st.floats(allow_nan=False, allow_infinity=False).map(json.dumps),
    st.sampled_from(WORDS).map(json.dumps),
    st.text(max_size=8).map(json.dumps),
)


def _object(pairs: list[tuple[str, str]]) -> str:
    """A JSON object from (key, JSON text) pairs: keys may repeat."""
    return "{" + ",".join(f"{json.dumps(k)}:{v}" for k, v in pairs) + "}"


keys = st.one_of(st.sampled_from(KEYS), st.text(max_size=6))
json_text = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4).map(lambda items: "[" + ",".join(items) + "]"),
        st.lists(st.tuples(keys, inner), max_size=4).map(_object),
    ),
    max_leaves=12,
)
deep = st.tuples(st.integers(2, 20_000), st.sampled_from(("[", '{"a":'))).map(
    lambda d: d[1] * d[0] + "1" + ("]" if d[1] == "[" else "}") * d[0])


@st.composite
def bodies(draw, server: Server) -> bytes:
    """Mostly an object with the route's usual fields (some wrong) plus random keys, sometimes any JSON."""
    shape = draw(st.sampled_from(("object", "object", "object", "any", "deep", "bytes")))
    if shape == "any":
        return draw(json_text).encode()
    if shape == "deep":
        return draw(deep).encode()
    if shape == "bytes":
        return draw(st.binary(max_size=40))
    usual = {
        "model": json.dumps(server.model),
        "messages": json.dumps([{"role": "user", "content": "hi"}]),
        "prompt": json.dumps("hi"),
        "input": json.dumps("hi"),
        "token_ids": "[5, 6, 7]",
        "sampling_params": json.dumps({"max_tokens": 1}),
    }
    usual_or_not = st.sampled_from((True, True, True, False))  # mostly right, so some reach the engine
    pairs = [(k, v if draw(usual_or_not) else draw(json_text)) for k, v in usual.items() if draw(st.booleans())]
    pairs += draw(st.lists(st.tuples(keys, json_text), max_size=3))
    pairs = [(k, v) for k, v in pairs if k not in ONE_TOKEN and k != "sampling_params"]
    pairs += [(k, json.dumps(v)) for k, v in ONE_TOKEN.items()]
    pairs.append(("sampling_params", json.dumps({"max_tokens": 1, "extra_args": {}})))
    return _object(pairs).encode()


header_values = st.one_of(
    st.none(),
    st.sampled_from(("snapkv; ratio=0.5", "lagkv; lag=16", "none", "entropy", "snapkv; ratio=０.５", "h2o; interval=1")),
    st.text(st.characters(min_codepoint=33, max_codepoint=126), max_size=30),
)


def post(server: Server, path: str, raw: bytes, header: str | None) -> httpx.Response:
    headers: dict[str, str | bytes] = {"content-type": "application/json"}
    if header:
        headers[HEADER] = header.encode()  # UTF-8 bytes: the server reads header bytes as latin-1
    with httpx.Client(base_url=server.url, timeout=120) as client:
        return client.post(path, content=raw, headers=headers)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                   HealthCheck.too_slow])
@given(data=st.data())
def test_random_json_on_every_route_is_never_a_5xx(server, data):
    path = data.draw(st.sampled_from(FUZZED), label="path")
    raw = data.draw(bodies(server), label="body")
    header = data.draw(header_values, label="header")
    response = post(server, path, raw, header)
    event(f"HTTP {response.status_code}")
    assert response.status_code < 500, response.text[:500]


@pytest.mark.parametrize("raw", [b"[]", b"null", b"7", b'"x"', b"[{}]"])
def test_a_json_value_that_is_not_an_object_is_never_a_5xx(server, raw):
    """vLLM's untyped routes (e.g. /inference/v1/abort_requests) index the body as a dict."""
    for path in FUZZED:
        response = post(server, path, raw, None)
        assert response.status_code < 500, (path, response.text[:300])


def test_every_post_route_is_classified(server):
    """A vLLM upgrade that adds a POST route fails here until protocol.ROUTES or REFUSING has it."""
    with urllib.request.urlopen(f"{server.url}/openapi.json", timeout=10) as response:
        paths = json.load(response)["paths"]
    posts = {path for path, methods in paths.items() if "post" in methods}
    assert posts - set(ROUTES) - set(REFUSING) == set()
    assert set(ROUTES) <= posts


def test_server_still_serves_after_the_route_fuzz(server):
    reply = server.client().chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": "still there?"}], max_tokens=3,
        extra_headers={HEADER: "snapkv; ratio=0.5"},
    )
    assert reply.choices[0].finish_reason in ("length", "stop")
    log = server.log_path.read_text(errors="replace")
    assert "Traceback" not in log and "Exception in ASGI application" not in log
