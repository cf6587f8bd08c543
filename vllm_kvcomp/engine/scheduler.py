"""Scheduler half of the kvcomp connector (engine-core process); its side of each request's
lifecycle is in :mod:`~vllm_kvcomp.engine.lifecycle`.

It learns each request's spec from ``sampling_params.extra_args``, tells the worker which rows
to watch every step, and frees the leading blocks the worker reports as dead — only after the
worker confirmed the compaction.

Prefix caching (copy-on-compress, docs/engine.md): a request compressed at the end of its prompt
reads cached prompt blocks like any other (its hit stops before the policy's observation
window); once its prompt is cached, none of its later blocks are hashed; its first compaction
packs into fresh *spare* blocks sent with the step that completes the prompt, which then replace
the prompt blocks in its table (those go back to the pool still cached, contents unchanged).
Requests compressing during prefill, and hybrid models, are salted out of the cache instead.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from vllm_kvcomp import vllm_compat
from vllm_kvcomp.engine import blocks
from vllm_kvcomp.engine.lifecycle import SpareState
from vllm_kvcomp.engine.metadata import (
    CompressionEvent,
    ScheduledRequest,
    StepMetadata,
    WorkerReport,
)
from vllm_kvcomp.params import SpecError
from vllm_kvcomp.policies.base import Policy
from vllm_kvcomp.spec import CompressionSpec

logger = logging.getLogger(__name__)


@dataclass
class RequestStats:
    """What happened to one request, returned in its ``kv_transfer_params['kvcomp']``.

    After the last compression: ``tokens_kept`` is the mean kept tokens per (layer, KV head)
    (page-rounded, what is held), ``kept_max_head`` the largest head, ``kept_fraction`` the kept
    (layer, head, token) cells over what the full cache holds at that length (≤ 1). Before any:
    the prompt, 1.0.
    """

    spec: CompressionSpec
    prompt_len: int
    peak_tokens: int | None = None  # prefill=stream: tokens' worth of blocks the request holds at most
    unavailable: str | None = None  # why this engine serves the request uncompressed (None: it compresses)
    compressions: int = 0
    tokens_kept: int | None = None
    kept_max_head: int | None = None
    kept_fraction: float = 1.0
    tokens_evicted: int = 0  # summed over layers, heads and compressions
    blocks_freed: int = 0
    seconds: float = 0.0
    preemptions: int = 0
    failed_compressions: int = 0  # compressions that stopped before writing (no memory, a bug)

    def record(self, event: CompressionEvent) -> None:
        kept = event.tokens_total - event.tokens_evicted
        self.compressions += 1
        self.tokens_kept = round(kept / max(event.num_heads, 1))
        self.kept_max_head = event.tokens_after
        full = event.num_heads * max(event.num_tokens, event.switched)  # the tokens when packed
        self.kept_fraction = kept / full if full else 1.0
        self.tokens_evicted += event.tokens_evicted
        self.seconds += event.seconds

    def as_params(self) -> dict[str, Any]:
        if self.unavailable is not None:  # what ran, what was asked, and why they differ
            return {"applied": "none", "policy": "full", "requested": self.spec.to_header(),
                    "reason": self.unavailable, "prompt_tokens": self.prompt_len, "compressions": 0,
                    "tokens_kept": self.prompt_len, "kept_max_head": self.prompt_len, "kept_fraction": 1.0,
                    "tokens_evicted": 0, "blocks_freed": 0, "compression_seconds": 0.0,
                    "preemptions": self.preemptions, "compression_failures": self.failed_compressions}
        return {
            "applied": self.spec.to_header(),
            "policy": self.spec.policy,
            "prompt_tokens": self.prompt_len,
            "compressions": self.compressions,
            "tokens_kept": self.prompt_len if self.tokens_kept is None else self.tokens_kept,
            "kept_max_head": self.prompt_len if self.kept_max_head is None else self.kept_max_head,
            "kept_fraction": round(self.kept_fraction, 6),
            "tokens_evicted": self.tokens_evicted,
            "blocks_freed": self.blocks_freed,
            "compression_seconds": round(self.seconds, 6),
            "preemptions": self.preemptions,
            "compression_failures": self.failed_compressions,
        }


@dataclass
class CopyOnCompress:
    """Scheduler state of a request that shares the prefix cache (see the module docstring)."""

    hit_cap: int  # most prompt tokens read from the prefix cache: the policy's query window is computed
    kept_bound: int | None  # mean kept tokens per head after the prompt, if the policy bounds it
    spares: list[Any] = field(default_factory=list)  # vLLM blocks sent to the worker, not yet placed
    held: list[Any] = field(default_factory=list)  # spares the table could not take (freed at the end)
    needed: int = 0  # spares the worker asked for (a postponed compaction)
    state: SpareState = SpareState.NONE

    def release(self, kv_cache_manager) -> None:
        vllm_compat.release_blocks(kv_cache_manager, self.spares + self.held)
        self.spares, self.held = [], []


def _streams(spec: CompressionSpec) -> bool:
    """Whether the request compresses after every prefill chunk (``prefill=stream`` or ``block``)."""
    return spec.to_dict().get("prefill") in ("stream", "block")


@dataclass
class KVCompScheduler:
    """Scheduler-side bookkeeping. ``kv_cache_manager`` is bound by vLLM after construction."""

    block_size: int
    chunk_tokens: int = 2048  # most prompt tokens one step prefills (max_num_batched_tokens)
    group: int = 0  # the KV-cache group we compress (full attention); others stay vLLM's
    unavailable: str | None = None  # why this engine cannot compress (None: it can)
    policy_builder: Callable[[CompressionSpec], Policy] = CompressionSpec.build_policy  # the worker's (profiles)
    num_heads: int | None = None  # (layer, KV head) pairs a rank compresses; None under tensor parallelism
    async_scheduling: bool = False  # step t+1 is scheduled before step t's report is read
    kv_cache_manager: Any = None
    requests: dict[str, RequestStats] = field(default_factory=dict)
    freed: dict[str, int] = field(default_factory=dict)  # req_id -> leading columns freed
    dropped: list[str] = field(default_factory=list)
    events: list[CompressionEvent] = field(default_factory=list)
    finished: list[dict[str, Any]] = field(default_factory=list)  # results since the last stats
    failures: list[dict[str, str]] = field(default_factory=list)  # failed compressions since the last stats
    preemptions: int = 0
    copy_on_compress: bool = False  # prefix caching on a model we can share it on
    cow: dict[str, CopyOnCompress] = field(default_factory=dict)
    reserved_bytes: int = 0  # a worker's memory outside the KV pool, bounded at start-up (engine/memory.py)

    # ------------------------------------------------------------------ admission
    def on_new_request(self, request) -> None:
        try:
            spec = CompressionSpec.from_xargs(request.sampling_params.extra_args if request.sampling_params else None)
        except SpecError as err:  # the server validates first; direct engine users get a log line
            logger.error("request %s: invalid kv compression spec ignored: %s", request.request_id, err)
            return
        peak = self._peak_tokens(spec, request.num_prompt_tokens) if spec is not None and spec.compresses else None
        if not self._can_ever_fit(request, peak):
            logger.error("request %s: its %d-token prompt can never fit the KV cache (%d tokens) without "
                         "prefill=stream; aborted", request.request_id, request.num_prompt_tokens,
                         self._pool_tokens())
            vllm_compat.abort_on_arrival(request)
            return
        if spec is None or not spec.compresses:
            return
        if self.unavailable is not None:  # followed only to say so in its result
            self.requests[request.request_id] = RequestStats(spec=spec, prompt_len=request.num_prompt_tokens,
                                                             unavailable=self.unavailable)
            return
        self.requests[request.request_id] = RequestStats(spec=spec, prompt_len=request.num_prompt_tokens,
                                                         peak_tokens=peak)
        if self.copy_on_compress and not _streams(spec):  # compacted once: may share the prefix cache
            policy = self._policy(request.request_id, spec)
            self.cow[request.request_id] = CopyOnCompress(
                hit_cap=max(policy.context_end(request.num_prompt_tokens) - policy.queries_needed(), 0),
                kept_bound=policy.held_bound(request.num_prompt_tokens, self.num_heads))
            return
        # Compaction rewrites this request's blocks in place (after every prefill=stream chunk, or
        # when copy-on-compress is off): keep them out of everyone's prefix cache (unique salt
        # chains into every block hash) and never read cached prefixes.
        vllm_compat.salt_out_of_prefix_cache(request, f"kvcomp:{request.request_id}")

    def _policy(self, req_id: str, spec: CompressionSpec) -> Policy:
        """The request's policy as the worker builds it (calibration profile bound); a profile
        that cannot be loaded is the worker's to report, here the plain policy bounds nothing."""
        try:
            return self.policy_builder(spec)
        except ValueError as err:
            logger.warning("request %s: %s", req_id, err)
            return spec.build_policy()

    def _pool_tokens(self) -> int:
        return blocks.pool_tokens(self.kv_cache_manager, self.block_size)

    def _can_ever_fit(self, request, peak_tokens: int | None) -> bool:
        """False for a request that would wait forever: only possible when the operator let
        max_model_len exceed the KV cache (``--allow-prompts-beyond-kv-cache``)."""
        if self.kv_cache_manager is None:
            return True
        need = request.num_prompt_tokens + 1 if peak_tokens is None else min(peak_tokens, request.num_prompt_tokens + 1)
        return need <= self._pool_tokens()

    def _peak_tokens(self, spec: CompressionSpec, prompt_len: int) -> int | None:
        """For ``prefill=stream``: what the request holds at most while its prompt is prefilled
        (kept tokens per head, a page of rounding, one chunk — two under async scheduling, where
        the next chunk is allocated before the last one's compaction is reported —, a page of
        growth), else None."""
        if not _streams(spec):
            return None
        bound = spec.build_policy().streaming_bound(prompt_len)
        chunks = 2 if self.async_scheduling else 1
        return None if bound is None else bound + chunks * self.chunk_tokens + 2 * self.block_size

    def bind(self, kv_cache_manager) -> None:
        """Start scheduling with vLLM's cache manager: admit streaming requests by their peak."""
        self.kv_cache_manager = kv_cache_manager
        vllm_compat.admit_by(kv_cache_manager, self.admission)
        self.copy_on_compress = self.unavailable is None and blocks.copy_on_compress_supported(kv_cache_manager)
        if self.copy_on_compress:
            vllm_compat.cap_prefix_cache_hits(kv_cache_manager, self.cache_hit_cap)

    def disable(self, reason: str) -> None:
        """Serve every request uncompressed from now on (the worker cannot compress): each tracked
        request's result says so; copy-on-compress spares go back."""
        logger.warning("vllm-kvcomp: requests are served uncompressed: %s", reason)
        self.unavailable = reason
        for stats in self.requests.values():
            stats.unavailable = reason
        for cow in self.cow.values():
            cow.release(self.kv_cache_manager)
        self.cow.clear()
        self.copy_on_compress = False

    def cache_hit_cap(self, request) -> int | None:
        """Most prefix-cache tokens a request may read: a compressed one computes its observation
        window itself (the tokens before the end of what it compresses: the prompt, or with
        ``scope=context`` the context)."""
        cow = self.cow.get(request.request_id)
        return None if cow is None else cow.hit_cap

    def admission(self, request) -> bool | None:
        """A ``prefill=stream`` request is admitted when its bounded peak fits (None: vLLM's rule)."""
        stats = self.requests.get(request.request_id)
        if stats is None or stats.peak_tokens is None:
            return None
        return blocks.room_for(self.kv_cache_manager, request.request_id, request.num_tokens, stats.peak_tokens)

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
                cow = self.cow.get(rid)
                if cow is not None:
                    cow.release(self.kv_cache_manager)
                    self.cow[rid] = CopyOnCompress(hit_cap=cow.hit_cap, kept_bound=cow.kept_bound)
        computed = {r.req_id: r.num_computed_tokens for r in scheduler_output.scheduled_new_reqs}
        cached = scheduler_output.scheduled_cached_reqs
        computed.update(zip(cached.req_ids, cached.num_computed_tokens))
        for rid, num_scheduled in scheduler_output.num_scheduled_tokens.items():
            stats = self.requests.get(rid)
            if stats is None or stats.unavailable is not None:
                continue
            block_ids = vllm_compat.request_block_ids(self.kv_cache_manager, rid, self.group)
            pos = computed[rid]
            scheduled = ScheduledRequest(
                req_id=rid,
                spec=stats.spec.to_dict(),
                prompt_len=stats.prompt_len,
                num_computed=pos,
                num_scheduled=num_scheduled,
                block_ids=block_ids,
            )
            cow = self.cow.get(rid)
            if cow is not None and cow.state is not SpareState.SETTLED and pos + num_scheduled >= stats.prompt_len:
                self._send_spares(rid, cow, scheduled, pos + num_scheduled)
            meta.requests.append(scheduled)
        if meta.requests:  # Model Runner V2 then tells the worker the batch order before the forward
            scheduler_output.has_sync_kv_loads = True
        return meta

    def _send_spares(self, rid: str, cow: CopyOnCompress, scheduled: ScheduledRequest, end: int) -> None:
        """The step that completes the prompt: stop hashing the request's blocks (its prompt's
        are cached by now) and send spares for its first compaction (as many as the policy's
        bound, or the worker's count, asks). If the pool is short, the request's own columns the
        compaction may write leave the prefix cache and it packs in place; if another request
        shares one of them, the worker waits for spares."""
        if cow.state is SpareState.NONE:
            vllm_compat.stop_hashing(self.kv_cache_manager, rid)
            cow.state = SpareState.SENT
        columns = end // self.block_size
        bound = columns if cow.kept_bound is None else min(columns, -(-cow.kept_bound // self.block_size) + 1)
        need = max(bound, cow.needed)
        more = blocks.new_blocks(self.kv_cache_manager, need - len(cow.spares))
        if more is None and blocks.make_private(self.kv_cache_manager, rid, columns - need, columns, self.group):
            cow.release(self.kv_cache_manager)
            cow.state = SpareState.SETTLED  # in place, as without prefix caching
            return
        cow.spares.extend(more or [])
        scheduled.copy_on_compress = True
        scheduled.spares = [vllm_compat.block_id(block) for block in cow.spares]

    # ------------------------------------------------------------------ worker confirmations
    def on_worker_report(self, report: WorkerReport | None) -> None:
        if report is None:
            return
        if report.unavailable is not None and self.unavailable is None:
            self.disable(report.unavailable)
        for rid, reason in report.uncompressed.items():
            self._serve_uncompressed(rid, reason)
        for rid, kind in report.failed.items():
            stats = self.requests.get(rid)
            if stats is not None:
                stats.failed_compressions += 1
                self.failures.append({"policy": stats.spec.policy, "reason": kind})
        for rid, needed in report.spares_needed.items():
            if rid in self.cow:
                self.cow[rid].needed = needed
        for rid, columns in report.copied.items():
            self._place_spares(rid, columns, report.freeable_blocks.get(rid, 0))
        for rid, columns in report.freeable_blocks.items():
            stats = self.requests.get(rid)
            if stats is None or not vllm_compat.holds_blocks(self.kv_cache_manager, rid, self.group):
                continue  # finished or preempted meanwhile: its blocks were freed already
            before = self.freed.get(rid, 0)
            if columns > before:
                vllm_compat.free_blocks(self.kv_cache_manager, rid, before, columns, self.group)
                self.freed[rid] = columns
                stats.blocks_freed += columns - before
        for event in report.events:
            stats = self.requests.get(event.req_id)
            if stats is not None:
                stats.record(event)
            self.events.append(event)

    def _serve_uncompressed(self, rid: str, reason: str) -> None:
        """The worker serves ``rid`` uncompressed: its result says why, its spares go back."""
        stats = self.requests.get(rid)
        if stats is not None and stats.unavailable is None:
            stats.unavailable = reason
        cow = self.cow.pop(rid, None)
        if cow is not None:
            cow.release(self.kv_cache_manager)

    def _place_spares(self, rid: str, columns: dict[int, int], freeable: int) -> None:
        """The first compaction packed into spares for ``columns``: they replace the request's
        prompt blocks there (released, still cached); unused spares go back. If some rank still
        reads those columns in place (it kept everything), the spares are held to the end."""
        cow = self.cow.get(rid)
        if cow is None or cow.state is SpareState.SETTLED or not vllm_compat.holds_blocks(
                self.kv_cache_manager, rid, self.group):
            return
        cow.state = SpareState.SETTLED
        by_id = {vllm_compat.block_id(block): block for block in cow.spares}
        used = {col: by_id[block] for col, block in columns.items()}
        if used and freeable < min(used):
            cow.held = list(used.values())
        else:
            blocks.install_blocks(self.kv_cache_manager, rid, used, self.group)
        cow.spares = [block for block in cow.spares if vllm_compat.block_id(block) not in set(columns.values())]
        vllm_compat.release_blocks(self.kv_cache_manager, cow.spares)
        cow.spares = []

    def on_finished(self, request) -> dict[str, Any] | None:
        stats = self.requests.pop(request.request_id, None)
        self.freed.pop(request.request_id, None)
        cow = self.cow.pop(request.request_id, None)
        if cow is not None:
            cow.release(self.kv_cache_manager)
        if stats is None:
            return None
        self.dropped.append(request.request_id)
        result = stats.as_params()
        self.finished.append(result)
        return {"kvcomp": result}

    def take_stats(self) -> dict[str, Any]:
        """Events and finished results since the last call, plus the current gauges (metrics.py)."""
        events, self.events = self.events, []
        finished, self.finished = self.finished, []
        failures, self.failures = self.failures, []
        return {"events": [dataclasses.asdict(e) for e in events], "finished": finished, "failures": failures,
                "gauges": self.gauges()}

    def gauges(self) -> dict[str, int]:
        """Blocks freed early, held, and that would be held uncompressed, over running tracked
        requests; the bytes a worker reserves outside the KV pool."""
        held = uncompressed = 0
        for rid, stats in self.requests.items():
            if stats.unavailable is None and vllm_compat.holds_blocks(self.kv_cache_manager, rid, self.group):
                columns = len(vllm_compat.request_block_ids(self.kv_cache_manager, rid, self.group))
                uncompressed += columns
                held += columns - self.freed.get(rid, 0)
        return {"saved_blocks": sum(self.freed.values()), "held_blocks": held,
                "uncompressed_blocks": uncompressed, "reserved_bytes": self.reserved_bytes}
