"""The Prometheus series without vLLM: fed connector stats and finished results by hand."""

from __future__ import annotations

from functools import partial
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from vllm_kvcomp.server import metrics
from vllm_kvcomp.server.metrics import KVCompPromMetrics


@pytest.fixture
def registry(monkeypatch) -> CollectorRegistry:
    monkeypatch.setattr(metrics, "_active", None)
    return CollectorRegistry()


def build(registry: CollectorRegistry) -> KVCompPromMetrics:
    types = {cls: partial(cls, registry=registry) for cls in (Counter, Gauge, Histogram)}
    config = SimpleNamespace(kv_transfer_config=None, model_config=SimpleNamespace(served_model_name="tiny"))
    return KVCompPromMetrics(config, types, ["model_name", "engine"], {0: ["tiny", "0"], 1: ["tiny", "1"]})


def event(policy: str, before: int, after: int, seconds: float) -> dict:
    return {"req_id": "r", "policy": policy, "tokens_before": before, "tokens_after": after,
            "tokens_evicted": (before - after) * 6, "tokens_total": before * 6, "seconds": seconds, "decode": False}


def value(registry: CollectorRegistry, name: str, **labels: str) -> float:
    return registry.get_sample_value(name, labels) or 0.0


def test_step_stats_feed_the_event_series_and_the_gauge(registry):
    series = build(registry)
    series.observe({"events": [event("snapkv", 100, 25, 0.02), event("snapkv", 200, 100, 0.004),
                               event("h2o", 64, 16, 0.3)], "saved_blocks": 7}, engine_idx=1)
    snap = {"model_name": "tiny", "engine": "1", "policy": "snapkv"}
    assert value(registry, "vllm:kvcomp_tokens_evicted_total", **snap) == (75 + 100) * 6
    assert value(registry, "vllm:kvcomp_compression_seconds_count", **snap) == 2
    assert value(registry, "vllm:kvcomp_compression_seconds_sum", **snap) == pytest.approx(0.024)
    assert value(registry, "vllm:kvcomp_achieved_ratio_sum", **snap) == pytest.approx(0.75)
    assert value(registry, "vllm:kvcomp_achieved_ratio_bucket", **snap, le="0.25") == 1
    assert value(registry, "vllm:kvcomp_achieved_ratio_bucket", **snap, le="0.5") == 2
    assert value(registry, "vllm:kvcomp_tokens_evicted_total", model_name="tiny", engine="1", policy="h2o") == 48 * 6
    assert value(registry, "vllm:kvcomp_saved_blocks", model_name="tiny", engine="1") == 7
    assert value(registry, "vllm:kvcomp_tokens_evicted_total", model_name="tiny", engine="0", policy="snapkv") == 0
    series.observe({"events": [], "saved_blocks": 0}, engine_idx=1)
    assert value(registry, "vllm:kvcomp_saved_blocks", model_name="tiny", engine="1") == 0


def test_finished_requests_feed_the_request_series(registry):
    build(registry)
    result = {"policy": "lagkv", "compressions": 1, "blocks_freed": 9}
    metrics.observe_finished(result)
    metrics.observe_finished({**result, "blocks_freed": 3})
    metrics.observe_finished({**result, "compressions": 0, "blocks_freed": 0})  # finished before compressing
    labels = {"model_name": "tiny", "policy": "lagkv"}
    assert value(registry, "vllm:kvcomp_requests_compressed_total", **labels) == 2
    assert value(registry, "vllm:kvcomp_blocks_freed_total", **labels) == 12


def test_without_prometheus_finished_requests_are_ignored(registry):
    metrics.observe_finished({"policy": "lagkv", "compressions": 1, "blocks_freed": 9})
    assert list(registry.collect()) == []
