"""What the engine measures, and the Prometheus series it becomes (as vLLM's connectors keep
their stats next to the connector).

Data path (vLLM's own connector-stats route, no side channel): every engine step the scheduler
half returns :class:`KVCompStats` from ``get_kv_connector_stats``; vLLM ships them to the API
server, whose Prometheus logger calls :meth:`KVCompPromMetrics.observe` with the engine index.
A stats payload is ``{"events": [CompressionEvent as dict], "finished": [RequestStats params],
"failures": [{"policy", "reason"}], "gauges": {name: value}}``; the server only exports what it receives.

Series (labels ``model_name``, ``engine`` as vLLM's own; per-policy series add ``policy``):

- ``vllm:kvcomp_requests_compressed_total`` finished requests compressed at least once
- ``vllm:kvcomp_blocks_freed_total``        KV blocks those requests gave back early
- ``vllm:kvcomp_tokens_evicted_total``      evicted (layer, head, token) cells
- ``vllm:kvcomp_compression_seconds``       histogram, time of one compression
- ``vllm:kvcomp_achieved_ratio``            histogram, kept / live tokens of one compression
- ``vllm:kvcomp_compression_failures_total`` compressions that stopped before writing, by ``reason``
  (``memory``: the allocator refused; ``error``): the request was left as it was, the engine serves on
- ``vllm:kvcomp_saved_blocks``              gauge, blocks currently freed early
- ``vllm:kvcomp_held_blocks``               gauge, blocks held by running compressed requests
- ``vllm:kvcomp_uncompressed_blocks``       gauge, blocks the same requests would hold uncompressed
- ``vllm:kvcomp_reserved_bytes``            gauge, a worker's memory outside the KV pool, bounded at
  start-up (``engine/memory.py``)
"""

from __future__ import annotations

import dataclasses
from typing import Any

from vllm_kvcomp.vllm_compat import KVConnectorPromMetrics, KVConnectorStats

SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
RATIO_BUCKETS = (0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
#: gauge name -> help text; the scheduler reports each one every step
GAUGES = {
    "saved_blocks": "KV-cache blocks currently freed early by compression of running requests.",
    "held_blocks": "KV-cache blocks held by running compressed requests.",
    "uncompressed_blocks": "KV-cache blocks the running compressed requests would hold uncompressed.",
    "reserved_bytes": "Bytes a worker may hold outside the KV pool for compression, bounded at start-up "
                      "(on a GPU taken from the KV budget).",
}


@dataclasses.dataclass
class KVCompStats(KVConnectorStats):
    """One or more steps' compression events, finished requests and the latest gauges."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVCompStats:
        merged = {key: [*self.data.get(key, ()), *other.data.get(key, ())]
                  for key in ("events", "finished", "failures")}
        merged["gauges"] = {**self.data.get("gauges", {}), **other.data.get("gauges", {})}
        return KVCompStats(data=merged)

    def reduce(self) -> dict[str, int | float]:
        events = self.data.get("events", [])
        return {
            "compressions": len(events),
            "tokens_evicted": sum(e["tokens_evicted"] for e in events),
            "finished": len(self.data.get("finished", ())),
            "failures": len(self.data.get("failures", ())),
            **self.data.get("gauges", {}),
        }

    def is_empty(self) -> bool:
        return not any(self.data.get(key) for key in ("events", "finished", "failures", "gauges"))


class KVCompPromMetrics(KVConnectorPromMetrics):
    """The kvcomp series, registered with the metric classes vLLM hands in."""

    def __init__(self, vllm_config: Any, metric_types: dict[type, type], labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        by_policy = [*labelnames, "policy"]
        self.requests_compressed = self._counter_cls(
            name="vllm:kvcomp_requests_compressed",
            documentation="Finished requests whose KV cache was compressed at least once.",
            labelnames=by_policy,
        )
        self.blocks_freed = self._counter_cls(
            name="vllm:kvcomp_blocks_freed",
            documentation="KV-cache blocks returned to the pool early by compression (finished requests).",
            labelnames=by_policy,
        )
        self.tokens_evicted = self._counter_cls(
            name="vllm:kvcomp_tokens_evicted",
            documentation="Evicted KV entries, counted per (layer, KV head, token).",
            labelnames=by_policy,
        )
        self.compression_seconds = self._histogram_cls(
            name="vllm:kvcomp_compression_seconds",
            documentation="Time of one compression of one request (all layers).",
            labelnames=by_policy,
            buckets=SECONDS_BUCKETS,
        )
        self.achieved_ratio = self._histogram_cls(
            name="vllm:kvcomp_achieved_ratio",
            documentation="Kept / live (layer, head, token) cells of one compression.",
            labelnames=by_policy,
            buckets=RATIO_BUCKETS,
        )
        self.compression_failures = self._counter_cls(
            name="vllm:kvcomp_compression_failures",
            documentation="Compressions that stopped before writing (reason memory: the allocator refused; error); "
                          "the request was left as it was.",
            labelnames=[*by_policy, "reason"],
        )
        self.gauges = {
            name: self._gauge_cls(name=f"vllm:kvcomp_{name}", documentation=text, labelnames=labelnames,
                                  multiprocess_mode="mostrecent")
            for name, text in GAUGES.items()
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        """Record the events, finished requests and gauges one engine reported."""
        labels = self.per_engine_labelvalues[engine_idx]
        for event in transfer_stats_data.get("events", ()):
            policy = event["policy"]
            self.tokens_evicted.labels(*labels, policy).inc(event["tokens_evicted"])
            self.compression_seconds.labels(*labels, policy).observe(event["seconds"])
            if event["tokens_total"] > 0:
                kept = event["tokens_total"] - event["tokens_evicted"]
                self.achieved_ratio.labels(*labels, policy).observe(kept / event["tokens_total"])
        for failure in transfer_stats_data.get("failures", ()):
            self.compression_failures.labels(*labels, failure["policy"], failure["reason"]).inc()
        for result in transfer_stats_data.get("finished", ()):
            if result.get("compressions", 0) > 0:
                self.requests_compressed.labels(*labels, result["policy"]).inc()
            self.blocks_freed.labels(*labels, result["policy"]).inc(result.get("blocks_freed", 0))
        for name, value in transfer_stats_data.get("gauges", {}).items():
            if name in self.gauges:
                self.gauges[name].labels(*labels).set(value)
