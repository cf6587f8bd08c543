"""Scheduler half of the kvcomp connector (engine-core process).

It learns each request's spec from ``sampling_params.extra_args``, keeps compressed requests out
of the prefix cache (unique salt, no prefix reads: their blocks are rewritten in place), tells
the worker which rows to watch every step, and frees the leading blocks the worker reports as
dead — only after the worker confirmed the compaction.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from vllm_kvcomp.engine.metadata import (
    CompressionEvent,
    ScheduledRequest,
    StepMetadata,
    WorkerReport,
)
from vllm_kvcomp.spec import CompressionSpec, SpecError

logger = logging.getLogger(__name__)


@dataclass
class RequestStats:
    """What happened to one request, returned in its ``kv_transfer_params['kvcomp']``."""

    spec: CompressionSpec
    prompt_len: int
    compressions: int = 0
    tokens_kept: int = 0  # kept tokens of the largest (layer, head) after the last compression
    tokens_evicted: int = 0  # summed over layers, heads and compressions
    blocks_freed: int = 0
    seconds: float = 0.0
    preemptions: int = 0

    def as_params(self) -> dict[str, Any]:
        return {
            "applied": self.spec.to_header(),
            "policy": self.spec.policy,
            "prompt_tokens": self.prompt_len,
            "compressions": self.compressions,
            "tokens_kept": self.tokens_kept,
            "tokens_evicted": self.tokens_evicted,
            "blocks_freed": self.blocks_freed,
            "compression_seconds": round(self.seconds, 6),
            "preemptions": self.preemptions,
        }


@dataclass
class KVCompScheduler:
    """Scheduler-side bookkeeping. ``kv_cache_manager`` is bound by vLLM after construction."""

    block_size: int
    kv_cache_manager: Any = None
    requests: dict[str, RequestStats] = field(default_factory=dict)
    freed: dict[str, int] = field(default_factory=dict)  # req_id -> leading columns freed
    dropped: list[str] = field(default_factory=list)
    events: list[CompressionEvent] = field(default_factory=list)
    blocks_freed_total: int = 0
    preemptions: int = 0

    # ------------------------------------------------------------------ admission
    def on_new_request(self, request) -> None:
        try:
            spec = CompressionSpec.from_xargs(request.sampling_params.extra_args if request.sampling_params else None)
        except SpecError as err:  # the server validates first; direct engine users get a log line
            logger.error("request %s: invalid kv compression spec ignored: %s", request.request_id, err)
            return
        if spec is None or not spec.compresses:
            return
        self.requests[request.request_id] = RequestStats(spec=spec, prompt_len=request.num_prompt_tokens)
        # Compaction rewrites this request's blocks in place: keep them out of everyone's prefix
        # cache (unique salt chains into every block hash) and never read cached prefixes.
        request.cache_salt = f"kvcomp:{request.request_id}"
        request.block_hashes = []
        request.update_block_hashes()
        request.skip_reading_prefix_cache = True

    # ------------------------------------------------------------------ per step
    def build_meta(self, scheduler_output) -> StepMetadata:
        meta = StepMetadata(dropped=self.dropped)
        self.dropped = []
        for rid in scheduler_output.preempted_req_ids or ():
            stats = self.requests.get(rid)
            if stats is not None:  # recompute rebuilds full KV: start over on both sides
                meta.dropped.append(rid)
                self.freed.pop(rid, None)
                stats.preemptions += 1
                self.preemptions += 1
        computed = {r.req_id: r.num_computed_tokens for r in scheduler_output.scheduled_new_reqs}
        cached = scheduler_output.scheduled_cached_reqs
        computed.update(zip(cached.req_ids, cached.num_computed_tokens))
        for rid, num_scheduled in scheduler_output.num_scheduled_tokens.items():
            stats = self.requests.get(rid)
            if stats is None:
                continue
            block_ids = list(self.kv_cache_manager.get_block_ids(rid)[0])
            pos = computed[rid]
            meta.requests.append(
                ScheduledRequest(
                    req_id=rid,
                    spec=stats.spec.to_dict(),
                    prompt_len=stats.prompt_len,
                    num_computed=pos,
                    num_scheduled=num_scheduled,
                    block_ids=block_ids,
                    first_slot=block_ids[pos // self.block_size] * self.block_size + pos % self.block_size,
                )
            )
        return meta

    # ------------------------------------------------------------------ worker confirmations
    def on_worker_report(self, report: WorkerReport | None) -> None:
        if report is None:
            return
        manager = self.kv_cache_manager.coordinator.single_type_managers[0]
        for rid, columns in report.freeable_blocks.items():
            stats = self.requests.get(rid)
            if stats is None or rid not in manager.req_to_blocks:
                continue  # finished or preempted meanwhile: its blocks were freed already
            before = self.freed.get(rid, 0)
            if columns > before:
                manager._remove_blocks_in_range(rid, before, columns)
                self.freed[rid] = columns
                stats.blocks_freed += columns - before
                self.blocks_freed_total += columns - before
        for event in report.events:
            stats = self.requests.get(event.req_id)
            if stats is not None:
                stats.compressions += 1
                stats.tokens_kept = event.tokens_after
                stats.tokens_evicted += event.tokens_evicted
                stats.seconds += event.seconds
            self.events.append(event)

    def on_finished(self, request) -> dict[str, Any] | None:
        stats = self.requests.pop(request.request_id, None)
        self.freed.pop(request.request_id, None)
        if stats is None:
            return None
        self.dropped.append(request.request_id)
        return {"kvcomp": stats.as_params()}

    def take_events(self) -> list[CompressionEvent]:
        events, self.events = self.events, []
        return events
