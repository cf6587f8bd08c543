"""Live server: every route to a spec, the applied header and usage numbers, streams, errors."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from tests.server.conftest import (
    chat_text,
    equal_budget_numbers,
    metric,
    prompt_ids,
    scrape,
)
from vllm_kvcomp.server.operator_config import DEFAULT_MIN_INTERVAL, OperatorConfig
from vllm_kvcomp.spec import MAX_HEADER_LENGTH, CompressionSpec

pytestmark = pytest.mark.server

HEADER = "X-KV-Compression"
APPLIED = "X-KV-Compression-Applied"
NUMBERS = ("tokens_kept", "tokens_evicted", "blocks_freed", "compressions")


def kv_usage(usage) -> dict:
    return (usage.model_extra or {})["kv_compression"]


def numbers(ext: dict) -> dict:
    return {k: ext[k] for k in NUMBERS}


def uncompressed(prompt_tokens: int) -> dict:
    return {"tokens_kept": prompt_tokens, "tokens_evicted": 0, "blocks_freed": 0, "compressions": 0}


# ---------------------------------------------------------------------------- non-streaming


def test_chat_context_scope_counts_the_context_and_keeps_the_question(server):
    """``scope=context`` on a chat: the server counts the tokens before the last user message (as
    vLLM's own /tokenize renders them), says so in the applied header, and keeps the question."""
    import httpx

    messages = [{"role": "user", "content": chat_text(300, seed=21)}, {"role": "assistant", "content": "Read."},
                {"role": "user", "content": "What was the third word?"}]
    raw = server.client().chat.completions.with_raw_response.create(
        model=server.model, messages=messages, max_tokens=4, temperature=0,
        extra_headers={HEADER: "policy=snapkv; ratio=0.25; scope=context"},
    )
    ext = kv_usage(raw.parse().usage)
    counted = httpx.post(f"{server.url}/tokenize", json={"model": server.model, "messages": messages[:-1],
                                                          "add_generation_prompt": False}).json()["count"]
    assert raw.headers[APPLIED] == f"policy=snapkv; ratio=0.25; scope=context; context_tokens={counted}" == ext["applied"]
    question = ext["prompt_tokens"] - counted
    assert 0 < question < 40 and ext["compressions"] == 1
    assert question / ext["prompt_tokens"] < ext["kept_fraction"] < 0.25 + (question + 32) / ext["prompt_tokens"]


@pytest.mark.parametrize("ratio", [0.25, 0.5])
def test_chat_header_reports_what_the_engine_did(server, ratio):
    raw = server.client().chat.completions.with_raw_response.create(
        model=server.model, messages=[{"role": "user", "content": chat_text(400, seed=1)}],
        max_tokens=4, temperature=0, extra_headers={HEADER: f"policy=streamingllm; ratio={ratio}"},
    )
    response = raw.parse()
    prompt = response.usage.prompt_tokens
    ext = kv_usage(response.usage)
    assert raw.headers[APPLIED] == f"policy=streamingllm; ratio={ratio:g}" == ext["applied"]
    assert ext["policy"] == "streamingllm"
    assert ext["prompt_tokens"] == prompt > 1000
    expected = equal_budget_numbers(prompt, ratio)
    assert numbers(ext) == expected
    assert expected["blocks_freed"] > 0
    assert ext["kept_fraction"] == pytest.approx(expected["tokens_kept"] / prompt, abs=1e-6)
    assert ext["preemptions"] == 0 and ext["compression_seconds"] > 0


ROUTES = {
    "header": {"extra_headers": {HEADER: "policy=snapkv; ratio=0.3"}},
    "body": {"extra_body": {"kv_compression": {"policy": "snapkv", "ratio": 0.3}}},
    "xargs": {"extra_body": {"vllm_xargs": {"kvcomp_policy": "snapkv", "kvcomp_ratio": 0.3}}},
    "all three, agreeing": {
        "extra_headers": {HEADER: "snapkv; ratio=0.3"},
        "extra_body": {"kv_compression": {"policy": "SnapKV", "ratio": "0.30"},
                       "vllm_xargs": {"kvcomp_policy": "snapkv", "kvcomp_ratio": "0.3"}},
    },
}


@pytest.mark.parametrize("route", ROUTES)
def test_completions_every_route_gives_the_same_spec_and_numbers(server, route):
    prompt = 700
    raw = server.client().completions.with_raw_response.create(
        model=server.model, prompt=prompt_ids(prompt, seed=2), max_tokens=3, temperature=0, **ROUTES[route]
    )
    response = raw.parse()
    assert raw.headers[APPLIED] == "policy=snapkv; ratio=0.3"
    assert response.usage.prompt_tokens == prompt
    assert numbers(kv_usage(response.usage)) == equal_budget_numbers(prompt, 0.3)


@pytest.mark.parametrize("header", [None, "none", "full", "policy=none"])
def test_no_compression_when_not_asked_or_asked_for_none(server, header):
    prompt = 400
    raw = server.client().completions.with_raw_response.create(
        model=server.model, prompt=prompt_ids(prompt, seed=3), max_tokens=2, temperature=0,
        extra_headers={HEADER: header} if header else None,
    )
    ext = kv_usage(raw.parse().usage)
    assert raw.headers[APPLIED] == "none" == ext["applied"]
    assert ext["policy"] == "full" and ext["kept_fraction"] == 1.0
    assert numbers(ext) == uncompressed(prompt)


def test_operator_defaults_fill_in_what_the_request_left_unset(server):
    raw = server.client().completions.with_raw_response.create(
        model=server.model, prompt=prompt_ids(600, seed=4), max_tokens=3, temperature=0,
        extra_headers={HEADER: "lagkv; ratio=0.5"},
    )
    resolved = OperatorConfig.load(server.config_path).resolve(CompressionSpec.from_header("lagkv; ratio=0.5"))
    assert resolved.lag == 32 and resolved.sink == 4  # from the operator file, not lagkv's own defaults
    assert raw.headers[APPLIED] == resolved.to_header()
    ext = kv_usage(raw.parse().usage)
    assert ext["applied"] == resolved.to_header()
    assert ext["compressions"] == 1 and 0 < ext["tokens_kept"] < 600 and ext["blocks_freed"] > 0


def test_decode_recompress_bounds_a_one_shot_policys_long_output(server):
    """``decode=recompress``: snapkv cuts its generated tokens back to the prompt budget as they
    pass a page, and says so (with the interval the server's floor filled in); the same request
    without it compresses once."""
    from tests.server.conftest import BLOCK_SIZE

    runs = {}
    for seed, extra in ((5, "; decode=recompress"), (6, "")):
        raw = server.client().completions.with_raw_response.create(
            model=server.model, prompt=prompt_ids(500, seed=seed), max_tokens=3 * BLOCK_SIZE, temperature=0,
            extra_headers={HEADER: "snapkv; ratio=0.25" + extra},
        )
        runs[extra] = (raw.headers[APPLIED], kv_usage(raw.parse().usage))
    (applied, ext), (_, once) = runs["; decode=recompress"], runs[""]
    assert applied == f"policy=snapkv; ratio=0.25; interval={DEFAULT_MIN_INTERVAL}; decode=recompress" == ext["applied"]
    assert once["compressions"] == 1 and ext["compressions"] >= 2
    # back to the prompt's budget (within a page) after evicting generated tokens too
    assert abs(ext["tokens_kept"] - once["tokens_kept"]) < BLOCK_SIZE
    assert ext["tokens_evicted"] > once["tokens_evicted"] and ext["kept_fraction"] < once["kept_fraction"]


def test_prefill_block_is_applied_and_keeps_what_end_keeps_for_a_prompt_of_one_chunk(server):
    """A 500-token prompt is one prefill chunk here: ``prefill=block`` compresses once, at its end,
    as ``prefill=end`` does, and the applied header says which was asked."""
    runs = {}
    for prefill in ("block", "end"):
        raw = server.client().completions.with_raw_response.create(
            model=server.model, prompt=prompt_ids(500, seed=9), max_tokens=4, temperature=0,
            extra_headers={HEADER: f"snapkv; ratio=0.25; prefill={prefill}"},
        )
        runs[prefill] = (raw.headers[APPLIED], raw.parse())
    (applied, block), (_, end) = runs["block"], runs["end"]
    assert applied == "policy=snapkv; ratio=0.25; prefill=block" == kv_usage(block.usage)["applied"]
    assert numbers(kv_usage(block.usage)) == numbers(kv_usage(end.usage))
    assert kv_usage(block.usage)["compressions"] == 1
    assert block.choices[0].text == end.choices[0].text


# ---------------------------------------------------------------------------- streaming


@pytest.mark.parametrize("include_usage", [False, True])
def test_chat_stream_final_chunk_carries_the_numbers(server, include_usage):
    client = server.client()
    messages = [{"role": "user", "content": chat_text(300, seed=5)}]
    prompt = client.chat.completions.create(model=server.model, messages=messages, max_tokens=1).usage.prompt_tokens
    raw = client.chat.completions.with_raw_response.create(
        model=server.model, messages=messages, max_tokens=5, temperature=0, stream=True,
        stream_options={"include_usage": True} if include_usage else None,
        extra_headers={HEADER: "streamingllm; ratio=0.25"},
    )
    assert raw.headers[APPLIED] == "policy=streamingllm; ratio=0.25"
    chunks = list(raw.parse())
    *body, final = chunks
    if include_usage:
        assert final.choices == [] and final.usage.prompt_tokens == prompt
        ext = kv_usage(final.usage)
    else:
        assert final.choices[0].finish_reason is not None
        ext = final.model_extra["kv_compression"]
    assert all("kv_compression" not in (c.model_extra or {}) and c.usage is None for c in body)
    assert ext["applied"] == "policy=streamingllm; ratio=0.25" and ext["prompt_tokens"] == prompt
    assert numbers(ext) == equal_budget_numbers(prompt, 0.25)
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) >= 1  # text still streams


def test_completion_stream_of_two_prompts_sums_both(server):
    lengths = (500, 900)
    stream = server.client().completions.create(
        model=server.model, prompt=[prompt_ids(n, seed=6 + n) for n in lengths], max_tokens=3,
        temperature=0, stream=True, stream_options={"include_usage": True},
        extra_body={"kv_compression": {"policy": "knorm", "ratio": 0.5}},
    )
    final = list(stream)[-1]
    ext = kv_usage(final.usage)
    per_prompt = [equal_budget_numbers(n, 0.5) for n in lengths]
    assert ext["prompt_tokens"] == sum(lengths) == final.usage.prompt_tokens
    assert numbers(ext) == {k: sum(p[k] for p in per_prompt) for k in NUMBERS}
    assert ext["kept_fraction"] == pytest.approx(sum(p["tokens_kept"] for p in per_prompt) / sum(lengths))


# ---------------------------------------------------------------------------- concurrency


MIXED = [("streamingllm", 0.25), ("snapkv", 0.5), ("h2o", 0.5), ("knorm", 0.5), ("sagekv", 0.25),
         ("streamingllm", 0.5), ("full", None), ("snapkv", 0.25)]


def test_mixed_policies_concurrently_each_get_their_own(server):
    client = server.client()

    def run(case: tuple[int, tuple[str, float | None]]):
        i, (policy, ratio) = case
        header = policy if ratio is None else f"policy={policy}; ratio={ratio}"
        prompt = 500 + 61 * i
        raw = client.completions.with_raw_response.create(
            model=server.model, prompt=prompt_ids(prompt, seed=100 + i), max_tokens=6, temperature=0,
            extra_headers={HEADER: header},
        )
        return prompt, raw.headers[APPLIED], kv_usage(raw.parse().usage)

    with ThreadPoolExecutor(len(MIXED)) as pool:
        results = list(pool.map(run, enumerate(MIXED)))
    for (policy, ratio), (prompt, applied, ext) in zip(MIXED, results):
        if ratio is None:
            assert applied == "none" == ext["applied"]
            assert numbers(ext) == uncompressed(prompt)
        else:
            assert applied == f"policy={policy}; ratio={ratio:g}" == ext["applied"]
            assert ext["policy"] == policy
            assert numbers(ext) == equal_budget_numbers(prompt, ratio)


# ---------------------------------------------------------------------------- errors


ERRORS = {
    "unknown policy": ({HEADER: "policy=magic"}, {}, "X-KV-Compression.policy", "streamingllm"),
    "non-numeric": ({HEADER: "streamingllm; ratio=abc"}, {}, "X-KV-Compression.ratio", "(0, 1]"),
    "above range": ({HEADER: "streamingllm; ratio=1.5"}, {}, "X-KV-Compression.ratio", "(0, 1]"),
    "outside bounds": ({HEADER: "streamingllm; ratio=0.01"}, {}, "X-KV-Compression.ratio", "[0.05, 1]"),
    "unknown key": ({HEADER: "streamingllm; colour=red"}, {}, "X-KV-Compression.colour", "ratio"),
    "disallowed policy": ({HEADER: "policy=entropy"}, {}, "X-KV-Compression.policy", "lagkv"),
    "needs a profile": ({HEADER: "policy=razor"}, {}, "X-KV-Compression.policy", "streamingllm"),
    "malformed header": ({HEADER: "streamingllm; ratio"}, {}, "X-KV-Compression", "key=value"),
    "header too long": ({HEADER: "snapkv; " + "x" * MAX_HEADER_LENGTH}, {}, "X-KV-Compression",
                        f"at most {MAX_HEADER_LENGTH} characters"),
    "body value": ({}, {"kv_compression": {"policy": "snapkv", "ratio": "half"}}, "kv_compression.ratio",
                   "(0, 1]"),
    "body not an object": ({}, {"kv_compression": "snapkv"}, "kv_compression", '"policy"'),
    "xargs value": ({}, {"vllm_xargs": {"kvcomp_policy": "h2o", "kvcomp_window": -1}},
                    "vllm_xargs.kvcomp_window", "integer in [0,"),
    "xargs disallowed": ({}, {"vllm_xargs": {"kvcomp_policy": "entropy"}}, "vllm_xargs.kvcomp_policy",
                         "lagkv"),
    "recompress a context": ({HEADER: "snapkv; decode=recompress; scope=context; context_tokens=4"}, {},
                             "X-KV-Compression.decode", "keep"),
    "stream on a scoring policy": ({HEADER: "snapkv; prefill=stream"}, {}, "X-KV-Compression.prefill", "end, block"),
    "block on a streaming policy": ({HEADER: "streamingllm; prefill=block"}, {}, "X-KV-Compression.prefill",
                                    "end, stream"),
    "sources disagree": ({HEADER: "snapkv; ratio=0.5"}, {"kv_compression": {"policy": "snapkv", "ratio": 0.25}},
                         "kv_compression", "one source"),
}


@pytest.mark.parametrize("case", ERRORS)
def test_bad_input_is_a_400_that_names_the_field_and_never_reaches_the_engine(server, case):
    headers, body, param, allowed = ERRORS[case]
    before = metric(scrape(server), "vllm:prompt_tokens_total")
    with pytest.raises(openai.BadRequestError) as caught:
        server.client().chat.completions.create(
            model=server.model, messages=[{"role": "user", "content": "hello"}], max_tokens=2,
            extra_headers=headers, extra_body=body,
        )
    error = caught.value.response.json()
    assert set(error) == {"error"}
    assert set(error["error"]) == {"message", "type", "param", "code"}
    assert error["error"]["type"] == "BadRequestError" and error["error"]["code"] == 400
    assert error["error"]["param"] == param
    assert error["error"]["message"].startswith(param + ": ")
    assert allowed in error["error"]["message"]
    assert metric(scrape(server), "vllm:prompt_tokens_total") == before


def test_other_routes_refuse_compression_settings_and_pass_everything_else(server):
    import httpx

    with httpx.Client(base_url=server.url, timeout=30) as http:
        plain = http.post("/tokenize", json={"model": server.model, "prompt": "hello world"})
        refused = http.post("/tokenize", json={"model": server.model, "prompt": "hello world"},
                            headers={HEADER: "snapkv; ratio=0.5"})
        refused_xargs = http.post("/v1/messages/count_tokens", json={
            "model": server.model, "messages": [{"role": "user", "content": "hello"}],
            "vllm_xargs": {"kvcomp_policy": "snapkv"}})
    assert plain.status_code == 200 and plain.json()["count"] > 0
    assert APPLIED not in plain.headers
    assert refused.status_code == 400 and refused.json()["error"]["param"] == HEADER
    assert "/v1/chat/completions" in refused.json()["error"]["message"]
    assert refused_xargs.status_code == 400 and refused_xargs.json()["error"]["param"] == "vllm_xargs"
