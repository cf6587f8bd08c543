"""Prometheus series of kvcomp, served by vLLM's ``/metrics`` in the API server process.

vLLM builds :class:`KVCompPromMetrics` through ``KVCompConnector.build_prom_metrics`` when it
sets up its Prometheus logger, and calls :meth:`~KVCompPromMetrics.observe` with the connector's
scheduler stats of every engine step (``{"events": [CompressionEvent as dict], "saved_blocks": n}``).
Per-request totals (blocks freed) exist only when a request finishes, so the result tap
(results.py) reports those through :func:`observe_finished`.

Series (labels ``model_name``, ``engine`` as vLLM's own, plus ``policy``):

- ``vllm:kvcomp_requests_compressed_total`` finished requests compressed at least once
- ``vllm:kvcomp_blocks_freed_total``        KV blocks those requests gave back early
- ``vllm:kvcomp_tokens_evicted_total``      evicted (layer, head, token) cells
- ``vllm:kvcomp_compression_seconds``       histogram, time of one compression
- ``vllm:kvcomp_achieved_ratio``            histogram, kept / before of one compression
- ``vllm:kvcomp_saved_blocks``              gauge, blocks currently freed early (no ``policy``)

The two per-request series carry ``model_name`` and ``policy`` only: a request's result does not
say which engine ran it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics

SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
RATIO_BUCKETS = (0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)

_active: KVCompPromMetrics | None = None


class KVCompPromMetrics(KVConnectorPromMetrics):
    """The kvcomp series, registered with the metric classes vLLM hands in."""

    def __init__(self, vllm_config: Any, metric_types: dict[type, type], labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        global _active
        engine_labels = [*labelnames, "policy"]
        request_labels = ["model_name", "policy"]
        self.model_name = vllm_config.model_config.served_model_name
        self.requests_compressed = self._counter_cls(
            name="vllm:kvcomp_requests_compressed",
            documentation="Finished requests whose KV cache was compressed at least once.",
            labelnames=request_labels,
        )
        self.blocks_freed = self._counter_cls(
            name="vllm:kvcomp_blocks_freed",
            documentation="KV-cache blocks returned to the pool early by compression (finished requests).",
            labelnames=request_labels,
        )
        self.tokens_evicted = self._counter_cls(
            name="vllm:kvcomp_tokens_evicted",
            documentation="Evicted KV entries, counted per (layer, KV head, token).",
            labelnames=engine_labels,
        )
        self.compression_seconds = self._histogram_cls(
            name="vllm:kvcomp_compression_seconds",
            documentation="Time of one compression of one request (all layers).",
            labelnames=engine_labels,
            buckets=SECONDS_BUCKETS,
        )
        self.achieved_ratio = self._histogram_cls(
            name="vllm:kvcomp_achieved_ratio",
            documentation="Kept / live tokens of the largest (layer, head) in one compression.",
            labelnames=engine_labels,
            buckets=RATIO_BUCKETS,
        )
        self.saved_blocks = self._gauge_cls(
            name="vllm:kvcomp_saved_blocks",
            documentation="KV-cache blocks currently freed early by compression of running requests.",
            labelnames=labelnames,
            multiprocess_mode="mostrecent",
        )
        _active = self

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        """Record one step's compression events and the saved-blocks gauge of ``engine_idx``."""
        labels = self.per_engine_labelvalues[engine_idx]
        for event in transfer_stats_data.get("events", ()):
            policy = event["policy"]
            self.tokens_evicted.labels(*labels, policy).inc(event["tokens_evicted"])
            self.compression_seconds.labels(*labels, policy).observe(event["seconds"])
            if event["tokens_before"] > 0:
                self.achieved_ratio.labels(*labels, policy).observe(event["tokens_after"] / event["tokens_before"])
        if "saved_blocks" in transfer_stats_data:
            self.saved_blocks.labels(*labels).set(transfer_stats_data["saved_blocks"])

    def observe_request(self, result: Mapping[str, Any]) -> None:
        """Record one finished compressed request (``RequestStats.as_params()``)."""
        if result.get("compressions", 0) > 0:
            self.requests_compressed.labels(self.model_name, result["policy"]).inc()
        self.blocks_freed.labels(self.model_name, result["policy"]).inc(result.get("blocks_freed", 0))


def observe_finished(result: Mapping[str, Any]) -> None:
    """Record a finished compressed request in this process's series (no-op without Prometheus)."""
    if _active is not None:
        _active.observe_request(result)

