"""Messages between the scheduler-side and worker-side halves of the kvcomp connector.

Scheduler -> worker (every step, :class:`StepMetadata`): the compressed/tracked requests
scheduled in this step, how to recognise their batch rows, their block ids, and which requests
were preempted or finished (their worker state must go).

Worker -> scheduler (:class:`WorkerReport`): per request, the number of leading block-table
columns whose blocks hold no live token any more (the scheduler frees them), plus the
compression events of the step for stats and metrics.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)


@dataclass
class ScheduledRequest:
    """One tracked request in this step (logical token counts, positional block ids)."""

    req_id: str
    spec: dict[str, Any]  # flat CompressionSpec.to_dict()
    prompt_len: int
    num_computed: int  # tokens in cache before this step
    num_scheduled: int  # tokens computed in this step
    block_ids: list[int]  # positional; freed columns hold the null block id
    first_slot: int  # physical slot of the first scheduled token: identifies the batch row


@dataclass
class StepMetadata(KVConnectorMetadata):
    requests: list[ScheduledRequest] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)  # preempted or finished: forget state


@dataclass
class CompressionEvent:
    """One compression of one request, for stats, usage and metrics."""

    req_id: str
    policy: str
    tokens_before: int  # live tokens of the largest (layer, head) before
    tokens_after: int  # kept tokens of the largest (layer, head)
    tokens_evicted: int  # summed over layers and heads
    tokens_total: int  # live (layer, head, token) cells before, summed
    seconds: float
    decode: bool


@dataclass
class WorkerReport(KVConnectorWorkerMetadata):
    freeable_blocks: dict[str, int] = field(default_factory=dict)  # req_id -> leading columns
    events: list[CompressionEvent] = field(default_factory=list)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> WorkerReport:
        if not isinstance(other, WorkerReport):
            return self
        merged = dict(self.freeable_blocks)
        for rid, n in other.freeable_blocks.items():
            merged[rid] = min(n, merged.get(rid, n))  # free only what every worker freed
        return WorkerReport(merged, self.events + other.events)
