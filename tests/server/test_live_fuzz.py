"""Live server, property-based: any header or body object gives 200 or 400, never a 5xx."""

from __future__ import annotations

import urllib.request

import openai
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tests.server.conftest import Server, chat_text
from vllm_kvcomp.policies.registry import POLICY_NAMES, get_policy_class

pytestmark = pytest.mark.server

HEADER = "X-KV-Compression"
KEYS = ("policy", "ratio", "budget", "sink", "window", "lag", "interval", "heads", "kernel", "tau",
        "buffer", "observe", "profile", "min_ratio", "max_ratio", "colour", "")
WORDS = (*POLICY_NAMES, "none", "magic", "uniform", "adaptive", "default", "0", "1", "-1", "0.5",
         "1e9", "nan", "inf", "", " ")
PROMPT = chat_text(80, seed=9)  # a few hundred tokens: several blocks to compress
FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

printable = st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=40)
header_values = st.one_of(
    st.sampled_from(WORDS),
    st.integers(-10, 1 << 25).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.text(st.characters(min_codepoint=33, max_codepoint=126, exclude_characters=";="), max_size=8),
)


# Ranges inside the server's default bounds, so that most valid-looking specs are accepted.
WITHIN_BOUNDS = {"ratio": (0.05, 1.0), "budget": (64, 4096), "window": (0, 512)}


def _param_value(param) -> st.SearchStrategy[str]:
    if param.choices:
        return st.sampled_from(param.choices)
    low, high = WITHIN_BOUNDS.get(param.name, (param.low or 0, min(param.high or 1 << 16, 1 << 16)))
    if param.kind is int:
        return st.integers(int(low), int(high)).map(str)
    return st.floats(low, high).map(repr)


@st.composite
def valid_looking(draw) -> str:
    """A policy with some of its own keys (not both ratio and budget), each within range."""
    policy = draw(st.sampled_from(POLICY_NAMES))
    params = get_policy_class(policy).accepted_params()
    keys = draw(st.lists(st.sampled_from(sorted(params)), unique=True, max_size=4)) if params else []
    if "ratio" in keys and "budget" in keys:
        keys.remove("budget")
    return "; ".join([f"policy={policy}", *(f"{k}={draw(_param_value(params[k]))}" for k in keys)])


headers = st.one_of(
    valid_looking(),
    st.lists(st.tuples(st.sampled_from(KEYS), header_values), max_size=5).map(
        lambda pairs: "; ".join(f"{k}={v}" for k, v in pairs)),
    st.lists(st.one_of(st.sampled_from(WORDS), printable), max_size=4).map(";".join),
    printable,
).map(str.strip)  # HTTP trims header values; h11 refuses untrimmed ones
scalars = st.one_of(st.none(), st.booleans(), st.integers(-(1 << 40), 1 << 40),
                    st.floats(allow_nan=False, allow_infinity=False), st.sampled_from(WORDS), st.text(max_size=6))
values = st.one_of(scalars, st.lists(scalars, max_size=2), st.dictionaries(st.text(max_size=3), scalars, max_size=2))
spec_objects = st.dictionaries(st.one_of(st.sampled_from(KEYS), st.text(max_size=6)), values, max_size=5)
bodies = st.one_of(
    st.fixed_dictionaries({"kv_compression": st.one_of(spec_objects, values)}),
    st.fixed_dictionaries({"vllm_xargs": st.dictionaries(
        st.one_of(st.sampled_from(KEYS).map("kvcomp_".__add__), st.text(max_size=6)), scalars, max_size=4)}),
)


def status_of(server: Server, headers: dict[str, str], body: dict) -> int:
    try:
        raw = server.client().chat.completions.with_raw_response.create(
            model=server.model, messages=[{"role": "user", "content": PROMPT}], max_tokens=2, temperature=0,
            extra_headers=headers, extra_body=body,
        )
    except openai.BadRequestError as err:
        return err.status_code
    raw.parse()
    return raw.status_code


@FUZZ
@given(header=headers)
def test_any_header_is_200_or_400(server, header):
    status = status_of(server, {HEADER: header}, {})
    event(f"HTTP {status}")
    assert status in (200, 400)


@FUZZ
@given(body=bodies)
def test_any_body_object_is_200_or_400(server, body):
    status = status_of(server, {}, body)
    event(f"HTTP {status}")
    assert status in (200, 400)


def test_server_still_serves_after_the_fuzz(server):
    with urllib.request.urlopen(f"{server.url}/health", timeout=5) as response:
        assert response.status == 200
    reply = server.client().chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": "still there?"}], max_tokens=3,
        extra_headers={HEADER: "snapkv; ratio=0.5"},
    )
    assert reply.choices[0].finish_reason in ("length", "stop")
    assert reply.usage.model_extra["kv_compression"]["applied"] == "policy=snapkv; ratio=0.5"
