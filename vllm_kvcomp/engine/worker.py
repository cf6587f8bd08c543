"""Worker half of the kvcomp connector: window capture, attention over packed pages, compaction.

Each request's state moves through :mod:`~vllm_kvcomp.engine.lifecycle` (the diagram is there).

Per step: ``bind`` receives the scheduler's :class:`StepMetadata`; every attention layer calls
:meth:`KVCompWorker.after_attention` (from the backend subclass) to capture window queries (while
a compression can still read them: until the first, or for policies that recompress) and to
attend the rows of compressed requests over their packed pages (one kernel call per layer);
``finish_step`` (from ``wait_for_save``, after the whole forward) moves the lifecycles on: a
completed prompt is compressed when the next step binds, ``prefill=stream`` chunks and due decode
recompressions right away (after a step that verified speculative draft tokens, at the next
bind, over the confirmed tokens). The platform only enters through the :class:`PagedCache` of
the KV buffer.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from vllm_kvcomp.engine.batch import (
    Capture,
    CompensationPlan,
    PagedBatch,
    Row,
    StepCapture,
    StepPlan,
    StepTables,
    batch_rows,
    contiguous_decode,
    send_plan,
)
from vllm_kvcomp.engine.cache import AttentionVariant, LayerReader, PagedCache, right_aligned
from vllm_kvcomp.engine.lifecycle import Phase
from vllm_kvcomp.engine.metadata import (
    CompressionEvent,
    ScheduledRequest,
    StepMetadata,
    WorkerReport,
)
from vllm_kvcomp.engine.offload import CompressionOffload, Decision
from vllm_kvcomp.engine.pages import Move, RequestPages
from vllm_kvcomp.engine.staging import HostStaging, to_device
from vllm_kvcomp.engine.state import CompressedRequest, ObservedAttention, QueryWindow
from vllm_kvcomp.params import SpecError
from vllm_kvcomp.policies.base import (
    ONE_RANK,
    Deferred,
    LayerKV,
    Ranks,
    RequestState,
    out_proj_heads,
)
from vllm_kvcomp.spec import CompressionSpec

logger = logging.getLogger(__name__)

PolicyBuilder = Callable[[CompressionSpec], object]
NO_OUT_PROJ = "the engine read no output projection (o_proj)"


def allocation_failure(err: BaseException) -> bool:
    """Whether ``err`` is an allocator's refusal (the device's or the host's), not a bug."""
    if isinstance(err, (torch.OutOfMemoryError, MemoryError)):
        return True
    text = str(err)
    return isinstance(err, RuntimeError) and ("out of memory" in text or "can't allocate memory" in text)


def failure_kind(err: BaseException) -> str | None:
    """How a compression that raised ``err`` before its first write fails without harm: "error"
    (a ``ValueError``: a bug, not bad input), "memory" (:func:`allocation_failure`); None: any
    other error is a bug that propagates."""
    if isinstance(err, ValueError):
        return "error"
    return "memory" if allocation_failure(err) else None


@dataclass
class CompactionPlan:
    """A compression decided and planned, nothing written yet (:meth:`KVCompWorker._plan_compaction`)."""

    move: Move | None  # None: every head kept everything and no token was made
    pages: RequestPages | None  # the request's pages after the move (None: unchanged)
    columns: dict[int, int]  # copy-on-compress: block-table column -> the spare written there
    longest_base: int  # the longest head over every rank after it, less the request's length
    event: CompressionEvent


class KVCompWorker:
    """Worker-side state for every tracked request of this worker."""

    def __init__(self, block_size: int, policy_builder: PolicyBuilder, ranks: Ranks = ONE_RANK):
        self.block_size = block_size
        self.build_policy = policy_builder
        self.ranks = ranks  # tensor-parallel ranks: policies decide over every rank's heads
        self.layer_index: dict[str, int] = {}  # compressed layers' cache names -> 0..L-1
        self.model_layers: list[int] = []
        self.num_model_layers = 0
        self.cache: PagedCache | None = None
        self.requests: dict[str, CompressedRequest] = {}
        self.step: dict[str, ScheduledRequest] = {}
        self._order: tuple[list[str], Mapping[str, int]] | None = None  # this step's batch (set_batch)
        self._plan: StepPlan | None = None  # this step's plan, made at its first layer
        self.capture = StepCapture()  # the queries this step's layers capture
        self.staging: HostStaging | None = None  # made with the cache (its device)
        self.tables: StepTables | None = None  # compressed rows' page tables, kept between steps
        self._compensation_plan: CompensationPlan | None = None
        self.trimmed: list[tuple[object, object]] = []  # this step's (vLLM metadata, its trimmed copy)
        self._report = WorkerReport()
        self.variants: list[AttentionVariant] = []  # per compressed layer, as vLLM's kernel attends it
        self.unavailable: str | None = None  # this engine cannot compress (told to the scheduler)
        self.out_proj: list[torch.Tensor] = []  # per compressed layer: W_o per query head [H_q, D, hidden]
        self.no_out_proj: str | None = NO_OUT_PROJ  # why there is none: policies that read it are refused
        #: called with every compression's event as it is made (``vllm-kvcomp bench stall`` times
        #: steps by them); the scheduler hears of it through the step's report either way
        self.listeners: list[Callable[[CompressionEvent], None]] = []
        #: when a compression decided off the step is packed (:mod:`~vllm_kvcomp.engine.offload`):
        #: None at the first bind after it is made, k > 0 at the k-th bind after its launch
        self.lag: int | None = None
        self.offload: CompressionOffload | None = None  # made with the cache; None: inside the step

    # ------------------------------------------------------------------ setup
    def register(
        self,
        kv_caches: dict[str, torch.Tensor],
        layer_index: dict[str, int],
        cache_cls: Callable[[list[torch.Tensor]], PagedCache],
        variants: dict[str, AttentionVariant],
        num_model_layers: int | None = None,
        out_proj: dict[str, torch.Tensor] | str | None = None,
    ) -> None:
        """Page the compressed layers' caches with ``cache_cls`` (the platform's :class:`PagedCache`).

        ``layer_index`` gives each cache's model layer (policies and calibration profiles count
        layers of the model, of which a hybrid model compresses only some); ``variants`` how each
        layer attends (scale, soft-capping, sinks), read once from its vLLM attention impl;
        ``out_proj`` each layer's output-projection weight [hidden, H_q·D] (this rank's heads), read
        once from the loaded model, or why there is none (policies that read it are then refused)."""
        order = sorted(kv_caches, key=lambda n: layer_index[n])
        self.layer_index = {name: i for i, name in enumerate(order)}
        self.model_layers = [layer_index[name] for name in order]
        self.num_model_layers = num_model_layers or max(self.model_layers) + 1
        self.cache = cache_cls([kv_caches[name] for name in order])
        self.variants = [variants[name] for name in order]
        self.staging = HostStaging(self.cache.device)
        self.configure_offload(self.lag)
        logger.info("vllm-kvcomp: compressions are decided %s", "inside the step" if self.offload is None else
                    "off the step and packed " + ("when ready" if self.lag is None else f"{self.lag} steps later"))
        self.tables = StepTables(self.num_layers, self.cache.device)
        if isinstance(out_proj, dict):  # views of the model's weights, no copy
            self.out_proj, self.no_out_proj = [out_proj_heads(out_proj[n], self.cache.head_dim) for n in order], None
        else:
            self.out_proj, self.no_out_proj = [], out_proj or NO_OUT_PROJ
        self._report = WorkerReport(unavailable=self.unavailable)

    def configure_offload(self, lag: int | None) -> None:
        """``compression_lag`` (:func:`~vllm_kvcomp.engine.offload.parse_lag`): 0 decides and packs
        inside the step; so does a tensor-parallel engine (its policies' collectives run in the step)."""
        self.lag = lag
        inside = lag == 0 or self.ranks.size > 1
        if self.offload is not None and inside:
            self.offload.close()
        if self.cache is not None:
            self.offload = None if inside else (self.offload or CompressionOffload(self.cache.device))

    @property
    def num_layers(self) -> int:
        return self.cache.geometry.num_layers

    @property
    def num_kv_heads(self) -> int:
        return self.cache.geometry.num_kv_heads

    def disable(self, reason: str) -> None:
        """Compress nothing on this engine; every report tells the scheduler why."""
        logger.warning("vllm-kvcomp: compression is unavailable on this engine: %s", reason)
        self.unavailable = reason
        self.requests.clear()
        self.clear_step()

    # ------------------------------------------------------------------ per step
    def bind(self, meta: StepMetadata) -> None:
        if self.unavailable is not None:
            return
        for rid in meta.dropped:
            state = self.requests.pop(rid, None)
            if state is not None and state.pending is not None:  # never wrote to the cache
                state.pending.cancel()
        self.step = {r.req_id: r for r in meta.requests}
        self._plan = None
        self.trimmed = []
        for r in meta.requests:
            if r.req_id not in self.requests:
                self.requests[r.req_id] = self._new_state(r)
            state = self.requests[r.req_id]
            life = state.lifecycle
            if life.block_override:
                r.block_ids = [life.block_override.get(col, block) for col, block in enumerate(r.block_ids)]
            # The prompt-end compression runs here, before this step's forward, not after the
            # forward that completed the prompt: the first token leaves first (TTFT), and the
            # next token attends the compressed cache exactly as it would have.
            # After a speculative step only the confirmed tokens count (r.num_computed): the
            # rejected drafts' keys are overwritten by this step (and _compress drops their queries).
            if life.phase is Phase.COMPRESSING:
                self._switch_if_ready(r.req_id, state, r)
            elif life.compression_pending and not self._waits_for_spares(state, r):
                if state.decided is not None:  # decided off the step, then waited for spares
                    self._switch(r.req_id, state, r, state.decided, r.num_computed)
                else:
                    end = min(life.prompt_end, r.num_computed)  # postponed while decoding speculatively
                    self._compress(r.req_id, state, r, end, decode=False)
            elif life.deferred_check():
                self._recompress_if_due(r.req_id, state, r, r.num_computed)
        if self.offload is not None:  # on the host, the decision under way gets this step's slice
            self.offload.step()

    def _new_state(self, r: ScheduledRequest) -> CompressedRequest:
        """State for a new request; a spec that cannot be built (e.g. a missing calibration
        profile) is logged and the request is served uncompressed rather than failing the engine."""
        try:
            spec = CompressionSpec.from_mapping(r.spec)
            policy = self.build_policy(spec)
            if policy.NEEDS_OUT_PROJ and self.no_out_proj is not None:
                raise SpecError("policy", f"{spec.policy} reads each layer's output projection, which this engine "
                                f"cannot: {self.no_out_proj}")
        except ValueError as err:  # SpecError and ProfileError are ValueErrors
            logger.error("request %s served without compression: %s", r.req_id, err)
            self._report.uncompressed[r.req_id] = str(err)
            spec = CompressionSpec()
            policy = spec.build_policy()
        w, context = policy.queries_needed(), policy.context_end(r.prompt_len)
        limit = context if policy.scope == "context" else None
        # the kernel sums attention as the layer attends: a plain softmax, what the policy scores
        plain = all(v.softcap == 0.0 and v.sinks is None for v in self.variants)
        observes = policy.OBSERVES_ATTENTION and plain and self.cache.observes(1, [1])
        return CompressedRequest(
            spec=spec,
            policy=policy,
            pages=RequestPages(self.cache.geometry),
            policy_state=RequestState(prompt_len=context, ranks=self.ranks),
            window=QueryWindow(w, limit),
            compensation=[None] * self.num_layers,
            observed=ObservedAttention() if observes else None,
        )

    def set_batch(self, order: Sequence[str], num_scheduled: Mapping[str, int]) -> None:
        """This step's batch as the model runner laid it out: request ids in row order and each
        one's scheduled tokens (host data, told before the forward: :mod:`~vllm_kvcomp.engine.batch`)."""
        self._order = (list(order), num_scheduled)

    def _step_plan(self, group: int) -> StepPlan:
        """This step's plan (made at its first attention layer, then reused by every layer):
        which rows are ours, what every layer captures, the compressed rows' sequences; its host
        tensors reach the device in one staged transfer."""
        plan = self._plan
        if plan is not None:
            return plan
        if self._order is None:
            raise RuntimeError("vllm-kvcomp: the model runner did not report this step's batch order "
                               "(KVCompWorker.set_batch); this vLLM model runner is not supported")
        rows = batch_rows(*self._order, self.step)
        compressed = [r for r in rows if self.requests[r.req_id].compressed]
        heads = self.num_kv_heads
        contiguous = contiguous_decode(compressed, heads)
        tables, ends, counts, gather, requests = [], [], [], [], []
        for row in compressed:
            sched, state = self.step[row.req_id], self.requests[row.req_id]
            end = sched.num_computed + sched.num_scheduled
            tables.append((state.pages, sched.block_ids, end))
            ends.append(end)
            if contiguous is None:
                tokens = torch.arange(row.lo, row.hi)
                gather.append((tokens.view(1, -1) * heads + torch.arange(heads).view(-1, 1)).flatten())
            counts.extend([row.hi - row.lo] * heads)
            requests.append(state)
        index, pages, full, base = self.tables.update(tables)
        ends_host = torch.tensor(ends, dtype=torch.long).repeat_interleave(heads)  # [S] each sequence's request's length
        lengths_host = self.tables.base_host + ends_host  # [L, S]
        compensation = self._compensation(requests)
        observe = self._observe(requests, group, counts, lengths_host, ends)
        capture_rows = self.capture.plan(self._captures(rows))  # after _observe: it may stop observing
        sent = send_plan(
            self.staging, recompute=torch.tensor([r.index for r in compressed], dtype=torch.long),
            capture=capture_rows, ends=ends_host, query_start=torch.cumsum(torch.tensor([0, *counts]), 0).to(torch.int32),
            gather=None if contiguous is not None or not gather else torch.cat(gather),
            table_index=index, table_pages=pages, tables=full, base=base, observe=observe,
            comp_keys=compensation.unsent[0], comp_values=compensation.unsent[1], comp_counts=compensation.unsent[2],
        )
        self.tables.apply(sent["table_index"], sent["table_pages"], sent["tables"], sent["base"])
        compensation.received((sent["comp_keys"], sent["comp_values"], sent["comp_counts"]))
        if sent["capture"] is not None:
            self.capture.source = sent["capture"]
        memos: dict[int, dict[str, object]] = {}
        batch = PagedBatch(
            tables=self.tables.tables, lengths=(self.tables.base + sent["ends"]).to(torch.int32),
            query_start=sent["query_start"], query_rows=counts,
            gather=contiguous if contiguous is not None else sent["gather"], requests=requests,
            compensation=compensation.layers(counts, lengths_host, self.block_size),
            memos=[memos.setdefault(first, {}) for first in self.tables.groups], observe=sent["observe"],
        )
        self._plan = plan = StepPlan(rows, [r.index for r in compressed], sent["recompute"], batch)
        return plan

    def rows_to_recompute(self, group: int) -> tuple[list[int], torch.Tensor]:
        """Rows this worker attends itself in every layer (their request reads packed pages): on
        the host and on the device."""
        plan = self._step_plan(group)
        return plan.recomputed, plan.recompute_index

    # ------------------------------------------------------------------ attention
    def after_attention(self, layer_name: str, query: torch.Tensor, output: torch.Tensor) -> None:
        """Capture window queries and attend compressed rows (query/output [T, H_q, D])."""
        layer = self.layer_index.get(layer_name)
        if not self.step or layer is None:  # another KV-cache group's layer (e.g. sliding window)
            return
        group = query.shape[1] // self.num_kv_heads
        batch = self._step_plan(group).batch
        self.capture.layer(layer, self.num_layers, query)
        if batch.requests:
            flat_q, flat_out = query.reshape(-1, group, query.shape[2]), output.view(-1, group, output.shape[2])
            out = self.cache.attend(flat_q[batch.gather], batch.tables[layer], batch.lengths[layer],
                                    batch.query_start, self.variants[layer], batch.compensation[layer],
                                    batch.memos[layer], None if batch.observe is None else batch.observe[layer],
                                    batch.query_rows)
            flat_out[batch.gather] = out.to(output.dtype)

    def _captures(self, rows: list[Row]) -> list[Capture]:
        """The rows whose queries this step's layers capture (:meth:`CompressedRequest.captures`):
        of each, the rows its window would keep (:meth:`QueryWindow.wanted`)."""
        plan = []
        for row in rows:
            state, sched = self.requests[row.req_id], self.step[row.req_id]
            end = sched.num_computed + sched.num_scheduled
            window = state.window
            if window is None or not window.size or not state.captures(end, sched.draft_tokens):
                continue
            first, count = window.wanted(sched.num_computed, row.hi - row.lo, sched.draft_tokens)
            if count:
                plan.append(Capture(window, row.lo + first, count, sched.num_computed + first, sched.draft_tokens,
                                    truncate=sched.num_computed))
        return plan

    def _observe(self, requests: list[CompressedRequest], group: int, query_rows: list[int],
                 lengths: torch.Tensor, ends: list[int]) -> torch.Tensor | None:
        """[L, S] int64 (host): the rows each sequence's attention is summed into this step (0 =
        none; :class:`ObservedAttention`), or None where no request observes. A request the
        kernel cannot observe this step (not one query row, or the C kernel does not attend) is
        observed no more until its next compression (its window captures the queries from this step on)."""
        if not any(state.observed is not None and state.observed.active for state in requests):
            return None
        heads, kernel = self.num_kv_heads, self.cache.observes(group, query_rows)
        parts, any_active = [], False
        for r, (state, end) in enumerate(zip(requests, ends)):
            observed = state.observed
            if observed is not None and observed.active and (not kernel or query_rows[r * heads] != 1):
                observed.active = False
            if observed is None or not observed.active:
                parts.append(torch.zeros(self.num_layers, heads, dtype=torch.int64))
            else:
                parts.append(observed.addresses(lengths[:, r * heads : (r + 1) * heads], self.cache.device))
                observed.through, any_active = end - 1, True  # this step's query
        return torch.cat(parts, dim=1) if any_active else None  # none: the kernel may not be the C one

    def _compensation(self, requests: list[CompressedRequest]) -> CompensationPlan:
        """The compensation tokens of the step's sequences (:class:`CompensationPlan`), made
        again only when a request's tokens or the compressed rows changed."""
        key = tuple((id(state), state.compensation_version) for state in requests)
        plan = self._compensation_plan
        if plan is None or plan.key != key:
            every = [v.sinks is not None for v in self.variants]
            plan = self._compensation_plan = CompensationPlan(key, requests, self.num_kv_heads, self.cache.head_dim,
                                                              every)
        return plan

    # ------------------------------------------------------------------ after the forward
    def finish_step(self) -> None:
        """Mark requests whose prefill just completed (compressed when the next step binds);
        compress those whose ``prefill=stream`` / ``block`` chunk left a head over its budget or
        whose decode recompression is due. The queries the layers captured reach the windows first.
        No collective: every rank knows the longest head of every rank (``longest_base``)."""
        self.capture.push()
        for rid, sched in self.step.items():
            state = self.requests.get(rid)
            if state is None or not state.spec.compresses:
                continue
            end = sched.num_computed + sched.num_scheduled
            policy, life = state.policy, state.lifecycle
            live = state.longest_base + end  # over every rank's heads
            if life.phase is Phase.COMPRESSING or state.decided is not None:
                continue  # decoding while its compression is decided, or packed at a later bind
            if life.phase is not Phase.DECODE:
                if end >= sched.prompt_len:
                    life.prompt_complete(end)  # compressed when the next step binds (see bind)
                elif policy.compresses_in_prefill:
                    if state.policy_state.budget is None:  # the whole prompt's, not this chunk's
                        state.policy_state.budget = policy.prefill_budget(sched.prompt_len)
                    if policy.stream_due(state.policy_state, live):
                        self._compress(rid, state, sched, end, decode=False)
                continue
            drafts = sched.draft_tokens > 0  # speculative decoding: the sampler may reject some
            life.decoded(drafts=drafts and policy.recompresses)
            if not drafts:
                state.live = (end, live)
                self._recompress_if_due(rid, state, sched, end, live)

    def _recompress_if_due(self, rid: str, state: CompressedRequest, sched: ScheduledRequest, end: int,
                           live: int | None = None) -> None:
        """Decode recompression at ``end`` tokens if the policy says it is due (``live``: the
        longest head over every rank)."""
        policy = state.policy
        if not policy.recompresses:
            return
        if live is None:
            live = state.longest_base + end
        if policy.due(state.policy_state, live, state.lifecycle.steps_since):
            self._compress(rid, state, sched, end, decode=True)

    def _layer_inputs(self, state: CompressedRequest, block_ids: torch.Tensor, end: int, decode: bool,
                      policy_state: RequestState, pause: Callable[[], None] | None = None) -> list[LayerKV]:
        """Every layer's live K/V, right-aligned per head as policies expect: K/V and queries on
        the cache's device (policies score there and select on the host; reading a 32K-token
        request of an 8B model back to the host cost 2.8 s on an H100, docs/results/gpu_decide.md),
        lengths and positions on the host. At a decode recompression the attention of the queries
        the kernel observed too (``LayerKV.observed``), and nothing read back when it observed
        every one since the last compression."""
        tables, lengths = state.pages.tables(block_ids, end), state.pages.lengths(end)  # [L, H, W], [L, H]
        n = int(lengths.max())
        observed = state.observed if decode and state.observed is not None and state.observed.through >= 0 else None
        if observed is not None:  # its rows as long as the heads (as they are after any observed step)
            observed.reserve(lengths, self.cache.device)
        every = observed is not None and observed.through == end - 1
        reads = state.policy.reads_cache(policy_state) and not every
        if reads:  # a head's virtual sequence is its table's pages in order: read whole pages, one gather
            # per layer when a policy asks for it (a cell-by-cell gather of heads of unequal lengths
            # cost ~3x as much per cell); one layer's K+V held at a time
            reader = LayerReader(self.cache, to_device(tables, self.cache.device), lengths, state.policy.READS_VALUES,
                                 pause)
        else:  # positions suffice (Policy.reads_cache): keys of the right shape, NaN, nothing read
            unread = torch.full((1, 1, 1), float("nan"), dtype=self.cache.dtype, device=self.cache.device)
        every_position = state.pages.positions(end)  # [L, H, n], right-aligned like the K/V
        inputs = []
        for layer, width in enumerate(lengths.amax(dim=1).tolist()):
            positions = every_position[layer, :, n - width :].contiguous()
            window = state.window
            queries = None if window.queries is None else window.queries[:, layer].transpose(0, 1)
            if reads:
                shape = (lengths.shape[1], width, self.cache.head_dim)
                keys = Deferred(functools.partial(reader.part, layer, 0), shape)
                values = Deferred(functools.partial(reader.part, layer, 1), shape) if reader.values else None
            else:
                keys, values = unread.expand(lengths.shape[1], width, self.cache.head_dim), None
            seen = None
            if observed is not None:  # virtual order, like the pages: right-aligned as the keys
                seen = right_aligned(observed.sums[layer, :, :n].unsqueeze(-1), lengths[layer], width).squeeze(-1)
            inputs.append(LayerKV(  # layers by model index
                keys=keys, values=values, observed=seen, observed_through=-1 if observed is None else observed.through,
                layer=self.model_layers[layer], num_layers=self.num_model_layers, lengths=lengths[layer],
                positions=positions, queries=queries,
                query_positions=window.positions, scale=self.variants[layer].scale,
                out_proj=self.out_proj[layer] if state.policy.NEEDS_OUT_PROJ else None,
            ))
        return inputs

    def _compression_failed(self, rid: str, state: CompressedRequest, err: BaseException, kind: str) -> None:
        """The compression stopped before its first write (a bug: ``kind`` "error"; the allocator
        had no memory for it: "memory"): the request's pages and policy state are as they were (a
        decision works on a copy of the state wherever it is read again).
        Before the first compaction it is served uncompressed and its result says why; after it,
        it keeps what it holds and the next due recompression tries again. Counted in the report."""
        logger.error("request %s: compression failed (%s): %s", rid, kind, err)
        self._report.copied.pop(rid, None)  # no spare was written: they all go back
        self._report.failed[rid] = kind
        state.pending = state.decided = None
        if not state.pages.compressed:
            what = "no memory for the compression" if kind == "memory" else "compression failed"
            self._report.uncompressed[rid] = f"{what}: {err}"
            state.spec = CompressionSpec()
            state.policy = state.spec.build_policy()
            state.observed = None
        state.lifecycle.compressed()

    @staticmethod
    def _copies(state: CompressedRequest, sched: ScheduledRequest) -> bool:
        """Whether this compaction must not write into the request's own blocks (copy-on-compress:
        its prompt blocks may be cached or shared; later compactions only touch private ones)."""
        return sched.copy_on_compress and not state.pages.compressed

    def _waits_for_spares(self, state: CompressedRequest, sched: ScheduledRequest) -> bool:
        """A postponed copy-on-compress compaction waits until the scheduler sends enough spares."""
        return self._copies(state, sched) and len(sched.spares) < state.lifecycle.spares_needed

    def _compress(self, rid: str, state: CompressedRequest, sched: ScheduledRequest, end: int, decode: bool) -> None:
        """Compress at ``end`` tokens: off the step (:mod:`~vllm_kvcomp.engine.offload`) for the
        prompt end and decode recompressions when the engine offloads, else decided and packed
        here (:meth:`_switch`)."""
        state.live = None  # the heads' lengths change
        state.window.truncate(end)  # queries of rolled-back draft tokens (a no-op otherwise)
        if self.offload is not None and state.lifecycle.phase in (Phase.PROMPT_END, Phase.DECODE):
            self._launch(rid, state, copy.copy(sched), end, decode, torch.tensor(sched.block_ids, dtype=torch.long))
            return
        started = time.perf_counter()
        # decided into a copy where a failure or a postponement reads the state again (before
        # the first compaction a failure serves the request uncompressed: it is not read again)
        keep = state.pages.compressed or self._copies(state, sched)
        try:
            decision = self.decide(state, torch.tensor(sched.block_ids, dtype=torch.long), end, decode,
                                   copy.deepcopy(state.policy_state) if keep else state.policy_state)
        except (ValueError, RuntimeError, MemoryError) as err:  # nothing was moved yet: keep serving
            if (kind := failure_kind(err)) is None:
                raise
            self._compression_failed(rid, state, err, kind)
            return
        self._switch(rid, state, sched, decision, end, started)

    def _launch(self, rid: str, state: CompressedRequest, sched: ScheduledRequest, end: int, decode: bool,
                block_ids: torch.Tensor) -> None:
        """Decide off the step over frozen copies of what the step goes on changing (the query
        window, the observed attention, the policy state); the request decodes meanwhile."""
        frozen = dataclasses.replace(  # the pages' own copy: their cached tables are rebuilt by the step
            state, pages=copy.copy(state.pages), window=state.window.frozen(),
            policy_state=copy.deepcopy(state.policy_state),
            observed=None if state.observed is None else state.observed.frozen())
        state.pending = self.offload.launch(lambda: self._decide_and_pack(frozen, sched, block_ids, end, decode))
        state.lifecycle.launched()

    def _decide_and_pack(self, frozen: CompressedRequest, sched: ScheduledRequest, block_ids: torch.Tensor,
                         end: int, decode: bool) -> Decision:
        """Off the step: the decision, and its packing planned where the spares it was sent suffice
        (the switch then only moves the cells)."""
        decision = self.decide(frozen, block_ids, end, decode, frozen.policy_state, pause=self.offload.checkpoint)
        self.offload.checkpoint()
        mine = self._spares_needed(frozen, decision) if self._copies(frozen, sched) else 0
        if mine <= len(sched.spares):  # as _plan_compaction picks them (one rank: no collective)
            destination = self._last_spares(sched, mine)
            decision.packing = (tuple(destination), *self._pack(frozen, block_ids, decision, destination))
        return decision

    @property
    def in_flight(self) -> int:
        """Compressions being decided off the step now."""
        return sum(1 for state in self.requests.values() if state.pending is not None)

    def _switch_if_ready(self, rid: str, state: CompressedRequest, sched: ScheduledRequest) -> None:
        """bind while COMPRESSING: pack the decision if it is made (or, at a fixed lag's last
        step, once it is), at the tokens the cache holds now."""
        waited, pending = state.lifecycle.waited(), state.pending
        if not pending.done() if self.lag is None else waited < self.lag:
            return
        started, state.pending = time.perf_counter(), None
        try:
            decision = self.offload.result(pending)
        except (ValueError, RuntimeError, MemoryError) as err:  # the decision's: nothing was written
            if (kind := failure_kind(err)) is None:
                raise
            self._compression_failed(rid, state, err, kind)
            return
        self.offload.adopt(decision, self.cache.device)
        self._switch(rid, state, sched, decision, sched.num_computed, started)

    def decide(self, state: CompressedRequest, block_ids: torch.Tensor, end: int, decode: bool,
               policy_state: RequestState, pause: Callable[[], None] | None = None) -> Decision:
        """The policy's selection at ``end`` tokens, deciding into ``policy_state``. Reads the
        cache, writes nothing (safe off the step: see :mod:`~vllm_kvcomp.engine.offload`);
        ``pause`` is called before each layer it reads (off the step: a slice's end)."""
        if not decode:
            state.policy.start_prefill_compression(policy_state)  # prefill=block: decides afresh
        inputs = self._layer_inputs(state, block_ids, end, decode, policy_state, pause)
        policy_state.page_quantum = (self.block_size, end % self.block_size)
        selections = [sel.cpu() for sel in state.policy.decide(inputs, policy_state)]
        before = torch.stack([kv.valid_lengths() for kv in inputs])  # [L, H]
        kept = [[idx - (kv.num_slots - int(before[layer, h])) for h, idx in enumerate(sel.indices)]
                for layer, (kv, sel) in enumerate(zip(inputs, selections))]
        return Decision(end, decode, kept, before, [sel.compensation for sel in selections], policy_state)

    def _switch(self, rid: str, state: CompressedRequest, sched: ScheduledRequest, decision: Decision, now: int,
                started: float | None = None) -> None:
        """Pack ``decision`` at ``now`` tokens (its kept cells and every token since it) and move
        the lifecycle on; postponed instead (the lifecycle waits for spares, the decision kept)
        when copy-on-compress got too few spares. Everything that allocates runs before the
        first write to the cache; a failure there leaves the request as it was."""
        started = time.perf_counter() if started is None else started
        try:
            plan = self._plan_compaction(rid, state, sched, decision, now)
            if plan is None:  # postponed: waits for spares (decided again then, unless off the step)
                state.decided = decision if self.offload is not None else None
                return
            if plan.move is not None:
                self.cache.move(plan.move)  # its temporaries are allocated before its first write
        except (ValueError, RuntimeError, MemoryError) as err:  # nothing was moved yet: keep serving
            if (kind := failure_kind(err)) is None:
                raise
            self._compression_failed(rid, state, err, kind)
            return
        state.decided = None
        if plan.pages is not None:
            state.pages = plan.pages
            state.lifecycle.block_override.update(plan.columns)
        self._report.freeable_blocks[rid] = state.pages.first_live_col  # 0: natural layout (for other ranks)
        for layer, comp in enumerate(decision.compensations):
            if comp is not None:  # the policy folds earlier entries in if it wants
                state.compensation[layer] = comp
        state.compensation_version += any(c is not None for c in decision.compensations)
        state.policy_state = decision.policy_state
        state.lifecycle.compressed()
        state.longest_base = plan.longest_base
        if state.observed is not None:  # the policy holds what was observed, by position
            state.observed.restart(now)
        if state.lifecycle.phase is Phase.DECODE and not state.reads_queries:  # no later decision
            state.window.release()  # reads what the window holds now (prefill chunks may)
        state.policy_state.compressions += 1
        in_step = time.perf_counter() - started
        event = dataclasses.replace(plan.event, seconds=decision.seconds + in_step, step_seconds=in_step,
                                    num_tokens=decision.end, switched=now)
        self._report.events.append(event)
        for listen in self.listeners:
            listen(event)

    def _plan_compaction(self, rid: str, state: CompressedRequest, sched: ScheduledRequest, decision: Decision,
                         now: int) -> CompactionPlan | None:
        """What :meth:`_switch` writes at ``now`` tokens: the moves and the new pages of
        ``decision`` (its kept cells packed as at its decision point; every token since stays in
        place as the tail), the event, the longest head over every rank; None when
        copy-on-compress must wait for more spares (the scheduler is told). Writes nothing to
        the cache; reuses the packing planned off the step when it planned the same one."""
        destination, columns = [], {}
        if self._copies(state, sched):
            mine = self._spares_needed(state, decision)
            needed = int(self.ranks.reduce(mine, max))  # every rank postpones, or none
            if needed > len(sched.spares):
                state.lifecycle.await_spares(needed)
                self._report.spares_needed[rid] = needed
                return None
            destination = self._last_spares(sched, mine)
            growth = decision.end // self.block_size
            columns = self._report.copied[rid] = {growth - mine + i: block for i, block in enumerate(destination)}
        planned = decision.packing
        move, pages = planned[1:] if planned is not None and planned[0] == tuple(destination) else \
            self._pack(state, torch.tensor(sched.block_ids, dtype=torch.long), decision, destination)
        longest = int(self.ranks.reduce(int((pages or state.pages).lengths(0).max()), max))  # over every rank
        since = now - decision.end
        before, after = decision.before + since, decision.counts() + since
        event = CompressionEvent(
            req_id=rid, policy=state.spec.policy, tokens_before=int(before.max()), tokens_after=int(after.max()),
            tokens_evicted=int((before - after).sum()), tokens_total=int(before.sum()), num_heads=before.numel(),
            num_tokens=now, seconds=0.0, decode=decision.decode)
        return CompactionPlan(move, pages, columns, longest, event)

    def _spares_needed(self, state: CompressedRequest, decision: Decision) -> int:
        """Blocks a copy-on-compress packing of ``decision`` writes (0: it keeps everything)."""
        return state.pages.blocks_needed(decision.kept, decision.end) if decision.compacts else 0

    @staticmethod
    def _last_spares(sched: ScheduledRequest, count: int) -> list[int]:
        """The spares a packing into ``count`` blocks writes: the last ones (last spare = last column)."""
        return sched.spares[len(sched.spares) - count :]

    @staticmethod
    def _pack(state: CompressedRequest, block_ids: torch.Tensor, decision: Decision,
              destination: list[int]) -> tuple[Move | None, RequestPages | None]:
        """The moves and pages of ``decision`` packed at its decision point (none: it keeps
        everything and makes no token); reads the pages, writes nothing."""
        if not decision.compacts:
            return None, None
        return state.pages.compact(decision.kept, block_ids, decision.end, destination or None)

    def take_report(self) -> WorkerReport | None:
        report, self._report = self._report, WorkerReport(unavailable=self.unavailable)
        if not (report.freeable_blocks or report.events or report.copied or report.spares_needed
                or report.unavailable or report.uncompressed or report.failed):
            return None
        return report

    def clear_step(self) -> None:
        self.step = {}
        self._order = None
        self._plan = None
        self.capture.plan([])
        self.trimmed = []
