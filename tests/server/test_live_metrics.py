"""Live server: the ``vllm:kvcomp_*`` series move by what known requests did."""

from __future__ import annotations

import pytest

from tests.server.conftest import equal_budget_numbers, metric, poll_metrics, prompt_ids, scrape

pytestmark = pytest.mark.server

HEADER = "X-KV-Compression"
POLL_S = 15


def wait_until(server, check):
    """Scrape until ``check(samples)`` holds (stats reach the API server step by step)."""
    return poll_metrics(server, check, timeout=POLL_S)


def test_counters_and_histograms_move_by_the_expected_amounts(server):
    requests = [("streamingllm", 0.25, 800), ("streamingllm", 0.5, 640), ("sagekv", 0.25, 700), ("full", None, 500)]
    client = server.client()
    before = scrape(server)
    for i, (policy, ratio, prompt) in enumerate(requests):
        header = policy if ratio is None else f"policy={policy}; ratio={ratio}"
        client.completions.create(model=server.model, prompt=prompt_ids(prompt, seed=200 + i), max_tokens=3,
                                  temperature=0, extra_headers={HEADER: header})
    expected: dict[str, dict[str, float]] = {}
    for policy, ratio, prompt in requests:
        if ratio is None:
            continue
        numbers = equal_budget_numbers(prompt, ratio)
        sums = expected.setdefault(policy, dict.fromkeys(("requests", "blocks", "evicted", "ratio_sum"), 0.0))
        sums["requests"] += 1
        sums["blocks"] += numbers["blocks_freed"]
        sums["evicted"] += numbers["tokens_evicted"]
        sums["ratio_sum"] += numbers["tokens_kept"] / prompt

    def delta(samples, name, policy):
        return metric(samples, name, policy=policy) - metric(before, name, policy=policy)

    after = wait_until(server, lambda s: all(
        delta(s, "vllm:kvcomp_requests_compressed_total", p) >= e["requests"] for p, e in expected.items()))
    for policy, sums in expected.items():
        assert delta(after, "vllm:kvcomp_requests_compressed_total", policy) == sums["requests"]
        assert delta(after, "vllm:kvcomp_blocks_freed_total", policy) == sums["blocks"] > 0
        assert delta(after, "vllm:kvcomp_tokens_evicted_total", policy) == sums["evicted"]
        assert delta(after, "vllm:kvcomp_compression_seconds_count", policy) == sums["requests"]
        assert delta(after, "vllm:kvcomp_compression_seconds_sum", policy) > 0
        assert delta(after, "vllm:kvcomp_achieved_ratio_count", policy) == sums["requests"]
        assert delta(after, "vllm:kvcomp_achieved_ratio_sum", policy) == pytest.approx(sums["ratio_sum"])
    assert delta(after, "vllm:kvcomp_requests_compressed_total", "full") == 0
    labelled = [labels for (name, labels) in after if name == "vllm:kvcomp_blocks_freed_total"]
    assert all(dict(labels)["model_name"] == server.model for labels in labelled)


def test_saved_blocks_gauge_follows_a_running_request(server):
    """The gauge holds a decoding request's freed blocks and drops back when it is aborted. The
    request asks for far more tokens than the poll needs (the tiny model decodes 120 tokens in under a
    second on a quiet machine, faster than a poll under load), so it is still running when the gauge is
    read; closing the stream aborts it."""
    prompt = 900
    freed = equal_budget_numbers(prompt, 0.25)["blocks_freed"]
    assert metric(wait_until(server, lambda s: metric(s, "vllm:kvcomp_saved_blocks") == 0),
                  "vllm:kvcomp_saved_blocks") == 0
    stream = server.client().completions.create(
        model=server.model, prompt=prompt_ids(prompt, seed=300), max_tokens=3000, temperature=0, stream=True,
        extra_headers={HEADER: "snapkv; ratio=0.25"}, extra_body={"ignore_eos": True},  # no recompression
    )
    try:
        chunks = iter(stream)
        next(chunks)  # the prompt is in (and compressed): decoding goes on
        running = wait_until(server, lambda s: metric(s, "vllm:kvcomp_saved_blocks") == freed)
        still_decoding = next(chunks).choices[0].finish_reason is None
    finally:
        stream.close()  # the client goes away: vLLM aborts the request
    assert metric(running, "vllm:kvcomp_saved_blocks", engine="0") == freed > 0
    assert still_decoding
    done = wait_until(server, lambda s: metric(s, "vllm:kvcomp_saved_blocks") == 0)
    assert metric(done, "vllm:kvcomp_saved_blocks") == 0
