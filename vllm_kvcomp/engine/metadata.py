"""Messages between the scheduler-side and worker-side halves of the kvcomp connector.

Scheduler -> worker (every step, :class:`StepMetadata`): the compressed/tracked requests
scheduled in this step (their batch rows come from the model runner's order, see
:mod:`~vllm_kvcomp.engine.batch`), their block ids, and which requests
were preempted or finished (their worker state must go).

Worker -> scheduler (:class:`WorkerReport`): per request, the number of leading block-table
columns whose blocks hold no live token any more (the scheduler frees them), the spare blocks
a copy-on-compress compaction wrote (the scheduler puts them into the block table), plus the
compression events of the step for stats and metrics.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from vllm_kvcomp.vllm_compat import KVConnectorMetadata, KVConnectorWorkerMetadata


@dataclass
class ScheduledRequest:
    """One tracked request in this step (logical token counts, positional block ids)."""

    req_id: str
    spec: dict[str, Any]  # flat CompressionSpec.to_dict()
    prompt_len: int
    num_computed: int  # tokens in cache before this step
    num_scheduled: int  # tokens computed in this step
    block_ids: list[int]  # positional; freed columns hold the null block id
    #: copy-on-compress (prefix caching on): the request's prompt blocks may be shared or cached, so
    #: its first compaction packs into ``spares`` (fresh blocks standing for the columns just
    #: below the compression point, last spare = last column), never into its own blocks
    copy_on_compress: bool = False
    spares: list[int] = field(default_factory=list)

    @property
    def draft_tokens(self) -> int:
        """Speculative draft tokens this step verifies (a decode step's tokens after the first;
        the sampler may reject them)."""
        return self.num_scheduled - 1 if self.num_computed >= self.prompt_len else 0


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
    num_heads: int  # (layer, KV head) pairs of this worker
    num_tokens: int  # logical length of the request at this compression's decision
    seconds: float  # deciding and packing it, wherever it ran
    decode: bool
    step_seconds: float = 0.0  # of ``seconds``, inside a step (all of it unless decided off the step)
    switched: int = -1  # logical length when its pages were packed (> num_tokens: decided off the step)


@dataclass
class WorkerReport(KVConnectorWorkerMetadata):
    freeable_blocks: dict[str, int] = field(default_factory=dict)  # req_id -> leading columns
    events: list[CompressionEvent] = field(default_factory=list)
    #: copy-on-compress settled: req_id -> {column: spare block id} the compaction wrote ({}: none)
    copied: dict[str, dict[int, int]] = field(default_factory=dict)
    #: copy-on-compress postponed: req_id -> spares the compaction needs (more than it was given)
    spares_needed: dict[str, int] = field(default_factory=dict)
    #: the worker cannot compress on this engine (backend, attention variant): why
    unavailable: str | None = None
    #: req_id -> why the worker serves that request uncompressed (a missing profile, a policy
    #: reading an output projection the model lacks)
    uncompressed: dict[str, str] = field(default_factory=dict)
    #: req_id -> a compression of that request that stopped before writing: "memory" (the
    #: allocator refused) or "error" (a bug); the request was left as it was
    failed: dict[str, str] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> WorkerReport:
        """One report for all tensor-parallel ranks: a block is free only if every rank freed it;
        a request's events of one step (one per rank, each over its own heads) become one."""
        if not isinstance(other, WorkerReport):
            return self
        merged = dict(self.freeable_blocks)
        for rid, n in other.freeable_blocks.items():
            merged[rid] = min(n, merged.get(rid, n))
        events = {e.req_id: e for e in self.events}
        for e in other.events:
            mine = events.get(e.req_id)
            events[e.req_id] = e if mine is None else dataclasses.replace(
                mine, tokens_before=max(mine.tokens_before, e.tokens_before),
                tokens_after=max(mine.tokens_after, e.tokens_after),
                tokens_evicted=mine.tokens_evicted + e.tokens_evicted, tokens_total=mine.tokens_total + e.tokens_total,
                num_heads=mine.num_heads + e.num_heads, seconds=max(mine.seconds, e.seconds),
                step_seconds=max(mine.step_seconds, e.step_seconds))
        copied = {rid: dict(cols) for rid, cols in self.copied.items()}
        for rid, cols in other.copied.items():
            copied.setdefault(rid, {}).update(cols)
        needed = dict(self.spares_needed)
        for rid, n in other.spares_needed.items():
            needed[rid] = max(n, needed.get(rid, n))
        return WorkerReport(merged, list(events.values()), copied, needed, self.unavailable or other.unavailable,
                            {**other.uncompressed, **self.uncompressed}, {**other.failed, **self.failed})
