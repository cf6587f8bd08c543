"""The engine's stats and their Prometheus series, without vLLM: stats fed by hand."""

from __future__ import annotations

from functools import partial
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from vllm_kvcomp.engine.metrics import GAUGES, KVCompPromMetrics, KVCompStats


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


def build(registry: CollectorRegistry) -> KVCompPromMetrics:
    types = {cls: partial(cls, registry=registry) for cls in (Counter, Gauge, Histogram)}
    config = SimpleNamespace(kv_transfer_config=None, model_config=SimpleNamespace(served_model_name="tiny"))
    return KVCompPromMetrics(config, types, ["model_name", "engine"], {0: ["tiny", "0"], 1: ["tiny", "1"]})


def event(policy: str, before: int, after: int, seconds: float) -> dict:
    return {"req_id": "r", "policy": policy, "tokens_before": before, "tokens_after": after,
            "tokens_evicted": (before - after) * 6, "tokens_total": before * 6, "num_heads": 6, "num_tokens": before,
            "seconds": seconds, "decode": False}


def value(registry: CollectorRegistry, name: str, **labels: str) -> float:
    return registry.get_sample_value(name, labels) or 0.0


def test_step_stats_feed_the_event_series_and_the_gauges(registry):
    series = build(registry)
    gauges = {"saved_blocks": 7, "held_blocks": 5, "uncompressed_blocks": 12}
    series.observe({"events": [event("snapkv", 100, 25, 0.02), event("snapkv", 200, 100, 0.004),
                               event("h2o", 64, 16, 0.3)], "gauges": gauges}, engine_idx=1)
    snap = {"model_name": "tiny", "engine": "1", "policy": "snapkv"}
    assert value(registry, "vllm:kvcomp_tokens_evicted_total", **snap) == (75 + 100) * 6
    assert value(registry, "vllm:kvcomp_compression_seconds_count", **snap) == 2
    assert value(registry, "vllm:kvcomp_compression_seconds_sum", **snap) == pytest.approx(0.024)
    assert value(registry, "vllm:kvcomp_achieved_ratio_sum", **snap) == pytest.approx(0.75)
    assert value(registry, "vllm:kvcomp_achieved_ratio_bucket", **snap, le="0.25") == 1
    assert value(registry, "vllm:kvcomp_achieved_ratio_bucket", **snap, le="0.5") == 2
    assert value(registry, "vllm:kvcomp_tokens_evicted_total", model_name="tiny", engine="1", policy="h2o") == 48 * 6
    for name, number in gauges.items():
        assert value(registry, f"vllm:kvcomp_{name}", model_name="tiny", engine="1") == number
    assert value(registry, "vllm:kvcomp_tokens_evicted_total", model_name="tiny", engine="0", policy="snapkv") == 0
    series.observe({"events": [], "gauges": dict.fromkeys(GAUGES, 0)}, engine_idx=1)
    assert value(registry, "vllm:kvcomp_saved_blocks", model_name="tiny", engine="1") == 0


def test_finished_requests_feed_the_request_series_of_their_engine(registry):
    series = build(registry)
    result = {"policy": "lagkv", "compressions": 1, "blocks_freed": 9}
    finished = [result, {**result, "blocks_freed": 3}, {**result, "compressions": 0, "blocks_freed": 0}]
    series.observe({"finished": finished}, engine_idx=0)
    series.observe({"finished": [result]}, engine_idx=1)
    labels = {"model_name": "tiny", "engine": "0", "policy": "lagkv"}
    assert value(registry, "vllm:kvcomp_requests_compressed_total", **labels) == 2
    assert value(registry, "vllm:kvcomp_blocks_freed_total", **labels) == 12
    assert value(registry, "vllm:kvcomp_requests_compressed_total", **{**labels, "engine": "1"}) == 1


def test_failed_compressions_are_counted_by_policy_and_reason(registry):
    series = build(registry)
    failures = [{"policy": "h2o", "reason": "memory"}, {"policy": "h2o", "reason": "memory"},
                {"policy": "snapkv", "reason": "error"}]
    series.observe({"failures": failures}, engine_idx=0)
    labels = {"model_name": "tiny", "engine": "0"}
    assert value(registry, "vllm:kvcomp_compression_failures_total", **labels, policy="h2o", reason="memory") == 2
    assert value(registry, "vllm:kvcomp_compression_failures_total", **labels, policy="snapkv", reason="error") == 1


def test_stats_aggregate_across_steps_and_keep_the_latest_gauges():
    a = KVCompStats(data={"events": [event("snapkv", 10, 5, 0.1)], "finished": [], "gauges": {"held_blocks": 3}})
    b = KVCompStats(data={"events": [], "finished": [{"policy": "snapkv"}], "gauges": {"held_blocks": 2},
                          "failures": [{"policy": "h2o", "reason": "memory"}]})
    merged = a.aggregate(b)
    assert merged.reduce() == {"compressions": 1, "tokens_evicted": 30, "finished": 1, "failures": 1, "held_blocks": 2}
    assert not merged.is_empty()
    assert not KVCompStats(data={"failures": [{"policy": "h2o", "reason": "memory"}]}).is_empty()
    assert KVCompStats(data={}).is_empty()
