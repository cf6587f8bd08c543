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
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from vllm_kvcomp.engine.cache import AttentionVariant, PagedCache, SequenceCompensation
from vllm_kvcomp.engine.lifecycle import Phase
from vllm_kvcomp.engine.metadata import (
    CompressionEvent,
    ScheduledRequest,
    StepMetadata,
    WorkerReport,
)
from vllm_kvcomp.engine.pages import RequestPages
from vllm_kvcomp.engine.state import CompressedRequest, ObservedAttention, QueryWindow
from vllm_kvcomp.params import SpecError
from vllm_kvcomp.policies.base import ONE_RANK, LayerKV, Ranks, RequestState, out_proj_heads
from vllm_kvcomp.spec import CompressionSpec

logger = logging.getLogger(__name__)

PolicyBuilder = Callable[[CompressionSpec], object]
NO_OUT_PROJ = "the engine read no output projection (o_proj)"


@dataclass
class Row:
    """A tracked request's batch row: its query tokens ``[lo, hi)``."""

    index: int
    req_id: str
    lo: int
    hi: int


@dataclass
class Capture:
    """A row whose query tokens ``[lo, hi)`` (positions from ``start``, the last ``drafts`` of
    them draft tokens) every layer pushes into its request's window of that layer."""

    windows: list[QueryWindow]
    lo: int
    hi: int
    start: int
    drafts: int


@dataclass
class PagedBatch:
    """This step's virtual sequences of compressed rows, sequence s = (row, head) in row order."""

    tables: torch.Tensor  # [L, S, W] int32 page ids
    lengths: torch.Tensor  # [L, S] int32
    query_start: torch.Tensor  # [S + 1] int32 query rows of each sequence in the gathered queries
    gather: torch.Tensor | slice  # [T_seq] index into query.view(-1, G, D) (token * H_kv + head),
    # or the slice it equals when contiguous (one query per row, adjacent rows: a view, no copy)
    requests: list[CompressedRequest]
    compensation: list[SequenceCompensation | None]  # per layer; None: no sequence has a token
    memos: list[dict[str, object]]  # per layer; one dict shared by the layers with equal lengths (PagedCache.attend)
    observe: torch.Tensor | None  # [L, S] int64 rows the kernel sums attention into (0 = none); None: no sequence


@dataclass
class TableLayout:
    """The page tables of a step's compressed requests (in row order) as the kernel reads them,
    kept while every request's table is the same tensor (:meth:`RequestPages.tables` builds a
    new one only when its pages or tail blocks change: once a block in decode)."""

    tables: list[torch.Tensor]  # each request's [L, H, W_r]
    device_tables: torch.Tensor  # [L, S, W] int32 on the cache's device, sequence s = (request, head)
    base: torch.Tensor  # [L, S] int64: each head's length less its request's length
    groups: list[int]  # per layer: the first layer whose heads are all as long (kernel schedules shared)

    @classmethod
    def of(cls, tables: list[torch.Tensor], requests: list[CompressedRequest], num_layers: int,
           device: torch.device) -> TableLayout:
        width = max((t.shape[2] for t in tables), default=0)
        padded = [torch.nn.functional.pad(t, (0, width - t.shape[2])) for t in tables]
        joined = torch.cat(padded, dim=1) if padded else torch.zeros(num_layers, 0, 1, dtype=torch.long)
        base = [s.pages.lengths(0) for s in requests]  # lengths(seq_len) = lengths(0) + seq_len
        base = torch.cat(base, dim=1) if base else torch.zeros(num_layers, 0, dtype=torch.long)
        first: dict[tuple[int, ...], int] = {}
        groups = [first.setdefault(tuple(row), layer) for layer, row in enumerate(base.tolist())]
        return cls(list(tables), joined.to(device, torch.int32), base, groups)

    def holds(self, tables: list[torch.Tensor]) -> bool:
        return len(tables) == len(self.tables) and all(a is b for a, b in zip(tables, self.tables))


def _right_aligned(read: torch.Tensor, lengths: torch.Tensor, width: int) -> torch.Tensor:
    """[H, width, D] of one layer's heads read left-aligned ``read`` [H, S, D] (head h's
    ``lengths[h]`` cells first), right-aligned with zeros on the left. A view when every head
    is ``width`` long, else one row gather."""
    if bool((lengths == width).all()):
        return read[:, :width]
    heads, cells, dim = read.shape
    virtual = torch.arange(width) - (width - lengths.unsqueeze(1))  # [H, width]; < 0: padding
    rows = (torch.arange(heads).unsqueeze(1) * cells + virtual.clamp(min=0)).flatten().to(read.device)
    out = read.reshape(-1, dim).index_select(0, rows)
    out.index_fill_(0, torch.nonzero(virtual.flatten() < 0).flatten().to(read.device), 0)
    return out.view(heads, width, dim)


def _contiguous(rows: list[Row], heads: int) -> slice | None:
    """The slice of ``query.view(-1, G, D)`` that the rows' sequences read, when it is one run:
    one query per row and adjacent rows (decode), sequence (row, head) = row.lo * heads + head.
    From the rows' bounds alone (host ints: no tensor is read)."""
    if not rows or any(r.hi - r.lo != 1 for r in rows) or any(b.lo != a.hi for a, b in itertools.pairwise(rows)):
        return None
    return slice(rows[0].lo * heads, rows[-1].hi * heads)


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
        self._slot_to_req: dict[int, str] = {}
        self._rows: list[Row] | None = None
        self._captures: list[Capture] | None = None
        self._batch: PagedBatch | None = None
        self._layout: TableLayout | None = None  # the last step's compressed page tables
        self.trimmed: list[tuple[object, object]] = []  # this step's (vLLM metadata, its trimmed copy)
        self._report = WorkerReport()
        self.variants: list[AttentionVariant] = []  # per compressed layer, as vLLM's kernel attends it
        self.unavailable: str | None = None  # this engine cannot compress (told to the scheduler)
        self.out_proj: list[torch.Tensor] = []  # per compressed layer: W_o per query head [H_q, D, hidden]
        self.no_out_proj: str | None = NO_OUT_PROJ  # why there is none: policies that read it are refused

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
        if isinstance(out_proj, dict):  # views of the model's weights, no copy
            self.out_proj, self.no_out_proj = [out_proj_heads(out_proj[n], self.cache.head_dim) for n in order], None
        else:
            self.out_proj, self.no_out_proj = [], out_proj or NO_OUT_PROJ
        self._report = WorkerReport(unavailable=self.unavailable)

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
            self.requests.pop(rid, None)
        self.step = {r.req_id: r for r in meta.requests}
        self._slot_to_req = {r.first_slot: r.req_id for r in meta.requests}
        self._rows = None
        self._captures = None
        self._batch = None
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
            if life.compression_pending and not self._waits_for_spares(state, r):
                end = min(life.prompt_end, r.num_computed)  # postponed while decoding speculatively
                self._compress(r.req_id, state, r, end, decode=False)
            elif life.deferred_check():
                self._recompress_if_due(r.req_id, state, r, r.num_computed)

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
            windows=[QueryWindow(w, limit) for _ in range(self.num_layers)],
            compensation=[None] * self.num_layers,
            observed=ObservedAttention() if observes else None,
        )

    def tracked_rows(self, query_start_loc: torch.Tensor, slot_mapping: torch.Tensor) -> list[Row]:
        """Batch rows of tracked requests, found by the slot of each row's first new token (one
        host read per step, cached)."""
        if self._rows is None:
            rows = []
            if self._slot_to_req:
                bounds = query_start_loc.tolist()
                first_slots = slot_mapping[query_start_loc[:-1].long()].tolist()
                for row, slot in enumerate(first_slots):
                    rid = self._slot_to_req.get(int(slot))
                    if rid is not None:
                        rows.append(Row(row, rid, bounds[row], bounds[row + 1]))
            self._rows = rows
        return self._rows

    def rows_to_recompute(self, query_start_loc: torch.Tensor, slot_mapping: torch.Tensor) -> list[int]:
        """Rows this worker attends itself in every layer (their request reads packed pages)."""
        return [r.index for r in self.tracked_rows(query_start_loc, slot_mapping) if self.requests[r.req_id].compressed]

    # ------------------------------------------------------------------ attention
    def after_attention(self, layer_name: str, query: torch.Tensor, output: torch.Tensor,
                        query_start_loc: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Capture window queries and attend compressed rows (query/output [T, H_q, D])."""
        layer = self.layer_index.get(layer_name)
        if not self.step or layer is None:  # another KV-cache group's layer (e.g. sliding window)
            return
        rows = self.tracked_rows(query_start_loc, slot_mapping)
        group = query.shape[1] // self.num_kv_heads
        if self._batch is None:  # first: it tells which requests' attention the kernel cannot observe
            self._batch = self._paged_batch([r for r in rows if self.requests[r.req_id].compressed], group)
        batch = self._batch
        if self._captures is None:
            self._captures = self._capture_plan(rows)
        for capture in self._captures:
            capture.windows[layer].push(query[capture.lo : capture.hi], capture.start, capture.drafts)
        if batch.requests:
            flat_q, flat_out = query.reshape(-1, group, query.shape[2]), output.view(-1, group, output.shape[2])
            out = self.cache.attend(flat_q[batch.gather], batch.tables[layer], batch.lengths[layer],
                                    batch.query_start, self.variants[layer], batch.compensation[layer],
                                    batch.memos[layer], None if batch.observe is None else batch.observe[layer])
            flat_out[batch.gather] = out.to(output.dtype)

    def _capture_plan(self, rows: list[Row]) -> list[Capture]:
        """The rows whose queries this step's layers capture (:meth:`CompressedRequest.captures`),
        made once per step so that each layer only copies."""
        plan = []
        for row in rows:
            state, sched = self.requests[row.req_id], self.step[row.req_id]
            end = sched.num_computed + sched.num_scheduled
            if state.windows and state.windows[0].size and state.captures(end, sched.draft_tokens):
                plan.append(Capture(state.windows, row.lo, row.hi, sched.num_computed, sched.draft_tokens))
        return plan

    def _paged_batch(self, rows: list[Row], group: int) -> PagedBatch:
        """Page tables, query layout, compensation tokens and observed rows of this step's compressed rows
        (built once per step, on the host, so that the layers read nothing back; the index
        tensors in the kernels' int32, so that no layer converts them). The tables are reused
        from the last step while no request's changed (:class:`TableLayout`)."""
        heads = self.num_kv_heads
        contiguous = _contiguous(rows, heads)
        tables, ends, counts, gather, requests = [], [], [], [], []
        for row in rows:
            sched, state = self.step[row.req_id], self.requests[row.req_id]
            end = sched.num_computed + sched.num_scheduled
            tables.append(state.pages.tables(sched.block_ids, end))  # [L, H, W], the same tensor until it changes
            ends.append(end)
            if contiguous is None:
                tokens = torch.arange(row.lo, row.hi)
                gather.append((tokens.view(1, -1) * heads + torch.arange(heads).view(-1, 1)).flatten())
            counts.extend([row.hi - row.lo] * heads)
            requests.append(state)
        layout = self._layout
        if layout is None or not layout.holds(tables):
            layout = self._layout = TableLayout.of(tables, requests, self.num_layers, self.cache.device)
        device = self.cache.device
        all_lengths = layout.base + torch.tensor(ends, dtype=torch.long).repeat_interleave(heads)  # [L, S]
        memos: dict[int, dict[str, object]] = {}
        return PagedBatch(
            tables=layout.device_tables,
            lengths=all_lengths.to(device, torch.int32),
            query_start=torch.cumsum(torch.tensor([0, *counts]), 0).to(device, torch.int32),
            gather=contiguous or (torch.cat(gather) if gather else torch.zeros(0, dtype=torch.long)).to(device),
            requests=requests,
            compensation=self._compensation(requests, counts, all_lengths),
            memos=[memos.setdefault(first, {}) for first in layout.groups],
            observe=self._observe(requests, group, counts, all_lengths, ends),
        )

    def _observe(self, requests: list[CompressedRequest], group: int, query_rows: list[int],
                 lengths: torch.Tensor, ends: list[int]) -> torch.Tensor | None:
        """[L, S] int64: the rows each sequence's attention is summed into this step (0 = none;
        :class:`ObservedAttention`), or None where no request observes. A request the kernel cannot
        observe this step (not one query row, or the C kernel does not attend) is observed no more
        until its next compression (its window captures the queries from this step on)."""
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

    def _compensation(self, requests: list[CompressedRequest], query_rows: list[int],
                      lengths: torch.Tensor) -> list[SequenceCompensation | None]:
        """Per layer, the sequences' compensation tokens (count 0 = none) and which need a merge;
        None where no sequence does (no token, no sinks)."""
        every = [v.sinks is not None for v in self.variants]
        if not any(every) and all(c is None for state in requests for c in state.compensation):
            return [None] * self.num_layers
        shape = (self.num_layers, len(requests), self.num_kv_heads)
        k_hat, counts = torch.zeros(*shape, self.cache.head_dim), torch.zeros(shape)
        v_hat = torch.zeros_like(k_hat)
        for r, state in enumerate(requests):
            for layer, comp in enumerate(state.compensation):
                if comp is not None:
                    k_hat[layer, r], v_hat[layer, r], counts[layer, r] = comp.keys, comp.values, comp.counts
        return SequenceCompensation.plan(k_hat.flatten(1, 2), v_hat.flatten(1, 2), counts.flatten(1), query_rows,
                                         lengths, self.block_size, self.cache.device, every)

    # ------------------------------------------------------------------ after the forward
    def finish_step(self) -> None:
        """Mark requests whose prefill just completed (compressed when the next step binds);
        compress those whose ``prefill=stream`` / ``block`` chunk left a head over its budget or
        whose decode recompression is due."""
        for rid, sched in self.step.items():
            state = self.requests.get(rid)
            if state is None or not state.spec.compresses:
                continue
            end = sched.num_computed + sched.num_scheduled
            policy, life = state.policy, state.lifecycle
            live = int(self.ranks.reduce(int(state.pages.lengths(end).max()), max))  # over every rank's heads
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
        longest head over every rank, read here when not given)."""
        policy = state.policy
        if not policy.recompresses:
            return
        if live is None:
            live = int(self.ranks.reduce(int(state.pages.lengths(end).max()), max))
        if policy.due(state.policy_state, live, state.lifecycle.steps_since):
            self._compress(rid, state, sched, end, decode=True)

    def _layer_inputs(self, state: CompressedRequest, block_ids: torch.Tensor, end: int,
                      decode: bool) -> list[LayerKV]:
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
        reads = state.policy.reads_cache(state.policy_state) and not every
        if reads:  # a head's virtual sequence is its table's pages in order: read whole pages, one gather
            # (a cell-by-cell gather of heads of unequal lengths cost ~3x as much per cell)
            full_k, full_v = self.cache.read_pages(tables.to(self.cache.device), state.policy.READS_VALUES)  # [L, H, W·bs, D]
        else:  # positions suffice (Policy.reads_cache): keys of the right shape, NaN, nothing read
            unread = torch.full((1, 1, 1), float("nan"), dtype=self.cache.dtype, device=self.cache.device)
        every_position = state.pages.positions(end)  # [L, H, n], right-aligned like the K/V
        inputs = []
        for layer, width in enumerate(lengths.amax(dim=1).tolist()):
            positions = every_position[layer, :, n - width :].contiguous()
            window = state.windows[layer]
            queries = None if window.queries is None else window.queries.transpose(0, 1)
            if reads:
                keys, values = (None if x is None else _right_aligned(x[layer], lengths[layer], width)
                                for x in (full_k, full_v))
            else:
                keys, values = unread.expand(lengths.shape[1], width, self.cache.head_dim), None
            seen = None
            if observed is not None:  # virtual order, like the pages: right-aligned as the keys
                seen = _right_aligned(observed.sums[layer, :, :n].unsqueeze(-1), lengths[layer], width).squeeze(-1)
            inputs.append(LayerKV(  # layers by model index
                keys=keys, values=values, observed=seen, observed_through=-1 if observed is None else observed.through,
                layer=self.model_layers[layer], num_layers=self.num_model_layers, lengths=lengths[layer],
                positions=positions, queries=queries,
                query_positions=window.positions, scale=self.variants[layer].scale,
                out_proj=self.out_proj[layer] if state.policy.NEEDS_OUT_PROJ else None,
            ))
        return inputs

    def _compression_failed(self, rid: str, state: CompressedRequest, err: ValueError) -> None:
        """The policy could not decide or its pages could not be packed (nothing moved): before
        the first compaction the request is served uncompressed and its result says why; after
        it, it keeps what it holds and the next due recompression tries again."""
        logger.error("request %s: compression failed: %s", rid, err)
        if not state.pages.compressed:
            self._report.uncompressed[rid] = f"compression failed: {err}"
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
        """Select and pack, and move the lifecycle on; postponed instead (the lifecycle waits for
        spares) when copy-on-compress got too few spares: the policy state is rolled back and the
        scheduler told how many to send."""
        started = time.perf_counter()
        state.live = None  # the heads' lengths change
        if not decode:
            state.policy.start_prefill_compression(state.policy_state)  # prefill=block: decides afresh
        for window in state.windows:  # queries of rolled-back draft tokens (a no-op otherwise)
            window.truncate(end)
        copies = self._copies(state, sched)
        snapshot = copy.deepcopy(state.policy_state) if copies else None
        block_ids = torch.tensor(sched.block_ids, dtype=torch.long)
        inputs = self._layer_inputs(state, block_ids, end, decode)
        state.policy_state.page_quantum = (self.block_size, end % self.block_size)
        try:
            selections = [sel.cpu() for sel in state.policy.decide(inputs, state.policy_state)]
        except ValueError as err:  # a bug, not bad input: nothing was moved yet, keep serving
            self._compression_failed(rid, state, err)
            return
        before = torch.stack([kv.valid_lengths() for kv in inputs])  # [L, H]
        kept = [[idx - (kv.num_slots - int(before[layer, h])) for h, idx in enumerate(sel.indices)]
                for layer, (kv, sel) in enumerate(zip(inputs, selections))]
        after = torch.tensor([[len(idx) for idx in layer] for layer in kept])
        compensations = [sel.compensation for sel in selections]
        compacts = bool((after < before).any()) or any(c is not None for c in compensations)
        destination, columns = None, {}
        if copies:
            mine = state.pages.blocks_needed(kept, end) if compacts else 0
            needed = int(self.ranks.reduce(mine, max))  # every rank postpones, or none
            if needed > len(sched.spares):
                state.policy_state = snapshot
                state.lifecycle.await_spares(needed)
                self._report.spares_needed[rid] = needed
                return
            destination = sched.spares[len(sched.spares) - mine :]  # last spare = last column
            growth = end // self.block_size
            columns = {growth - mine + i: block for i, block in enumerate(destination)}
            self._report.copied[rid] = columns
        if compacts:
            try:
                move, pages = state.pages.compact(kept, block_ids, end, destination)
            except ValueError as err:  # a bug, not bad input: nothing was moved yet, keep serving
                self._report.copied.pop(rid, None)  # no spare was written: they all go back
                self._compression_failed(rid, state, err)
                return
            self.cache.move(move)
            state.pages = pages
            state.lifecycle.block_override.update(columns)
        self._report.freeable_blocks[rid] = state.pages.first_live_col  # 0: natural layout (for other ranks)
        for layer, comp in enumerate(compensations):
            if comp is not None:  # the policy folds earlier entries in if it wants
                state.compensation[layer] = comp
        state.lifecycle.compressed()
        if state.observed is not None:  # the policy holds what was observed, by position
            state.observed.restart(end)
        state.policy_state.compressions += 1
        self._report.events.append(CompressionEvent(
            req_id=rid, policy=state.spec.policy, tokens_before=int(before.max()), tokens_after=int(after.max()),
            tokens_evicted=int((before - after).sum()), tokens_total=int(before.sum()), num_heads=before.numel(),
            num_tokens=end,
            seconds=time.perf_counter() - started, decode=decode,
        ))

    def take_report(self) -> WorkerReport | None:
        report, self._report = self._report, WorkerReport(unavailable=self.unavailable)
        if not (report.freeable_blocks or report.events or report.copied or report.spares_needed
                or report.unavailable or report.uncompressed):
            return None
        return report

    def clear_step(self) -> None:
        self.step = {}
        self._slot_to_req = {}
        self._rows = None
        self._captures = None
        self._batch = None
        self.trimmed = []
