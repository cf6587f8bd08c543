"""Worker half of the kvcomp connector: window capture, compaction, per-head attention state.

Per step: ``bind`` receives the scheduler's :class:`StepMetadata`; every attention layer calls
:meth:`KVCompWorker.after_attention` (from the backend subclass) to capture window queries and
to recompute the rows of compressed requests over their kept tokens; ``finish_step`` (from
``wait_for_save``, after the whole forward) runs the policies and compacts the paged KV.
The platform only enters through the :class:`PagedKV` layout of each layer's cache (CPU: torch
recomputation; GPU: the per-head decode kernel of :mod:`vllm_kvcomp.ops`); policies score on the
host.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from vllm_kvcomp.engine.metadata import (
    CompressionEvent,
    ScheduledRequest,
    StepMetadata,
    WorkerReport,
)
from vllm_kvcomp.engine.paged import PagedKV
from vllm_kvcomp.engine.state import CompressedRequest, QueryWindow
from vllm_kvcomp.policies.base import LayerKV, RequestState, Selection
from vllm_kvcomp.policies.compensation import attention_with_lse, compensation_lse, merge_partials
from vllm_kvcomp.spec import CompressionSpec

logger = logging.getLogger(__name__)

PolicyBuilder = Callable[[CompressionSpec], object]


class KVCompWorker:
    """Worker-side state for every tracked request of this worker."""

    def __init__(self, block_size: int, policy_builder: PolicyBuilder):
        self.block_size = block_size
        self.build_policy = policy_builder
        self.layer_index: dict[str, int] = {}
        self.paged: list[PagedKV] = []
        self.requests: dict[str, CompressedRequest] = {}
        self.step: dict[str, ScheduledRequest] = {}
        self._slot_to_req: dict[int, str] = {}
        self._rows: list[tuple[int, str, int, int]] | None = None  # (row, req_id, first, end token) tracked
        self.step_cache: dict[int, object] = {}  # backend-derived per-step objects, e.g. trimmed metadata
        self._report = WorkerReport()
        self.scale: float | None = None
        self.num_kv_heads = 0

    # ------------------------------------------------------------------ setup
    def register(
        self,
        kv_caches: dict[str, torch.Tensor],
        layer_index: dict[str, int],
        layout: Callable[[torch.Tensor], PagedKV],
    ) -> None:
        """Wrap every layer's cache with ``layout`` (the platform's :class:`PagedKV` class)."""
        order = sorted(kv_caches, key=lambda n: layer_index[n])
        self.layer_index = {name: i for i, name in enumerate(order)}
        self.paged = [layout(kv_caches[name]) for name in order]
        self.num_kv_heads = kv_caches[order[0]].shape[1]

    # ------------------------------------------------------------------ per step
    def bind(self, meta: StepMetadata) -> None:
        for rid in meta.dropped:
            self.requests.pop(rid, None)
        self.step = {r.req_id: r for r in meta.requests}
        self._slot_to_req = {r.first_slot: r.req_id for r in meta.requests}
        self._rows = None
        self.step_cache = {}
        for r in meta.requests:
            if r.req_id not in self.requests:
                self.requests[r.req_id] = self._new_state(r)

    def _new_state(self, r: ScheduledRequest) -> CompressedRequest:
        """State for a new request; a spec that cannot be built (e.g. a missing calibration
        profile) is logged and the request is served uncompressed rather than failing the engine."""
        try:
            spec = CompressionSpec.from_mapping(r.spec)
            policy = self.build_policy(spec)
        except ValueError as err:  # SpecError and ProfileError are ValueErrors
            logger.error("request %s served without compression: %s", r.req_id, err)
            spec = CompressionSpec()
            policy = spec.build_policy()
        num_layers = len(self.paged)
        w = policy.queries_needed()
        return CompressedRequest(
            spec=spec,
            policy=policy,
            policy_state=RequestState(prompt_len=r.prompt_len),
            num_layers=num_layers,
            num_kv_heads=self.num_kv_heads,
            windows=[QueryWindow(w) for _ in range(num_layers)],
            compensation=[None] * num_layers,
        )

    def tracked_rows(
        self, query_start_loc: torch.Tensor, slot_mapping: torch.Tensor
    ) -> list[tuple[int, str, int, int]]:
        """(row, req_id, first token, end token) of tracked requests' batch rows, found by the
        slot of each row's first new token (one host read per step, cached)."""
        if self._rows is None:
            rows = []
            if self._slot_to_req:
                bounds = query_start_loc.tolist()
                first_slots = slot_mapping[query_start_loc[:-1].long()].tolist()
                for row, slot in enumerate(first_slots):
                    rid = self._slot_to_req.get(int(slot))
                    if rid is not None:
                        rows.append((row, rid, bounds[row], bounds[row + 1]))
            self._rows = rows
        return self._rows

    # ------------------------------------------------------------------ attention
    def after_attention(
        self,
        layer_name: str,
        query: torch.Tensor,
        output: torch.Tensor,
        query_start_loc: torch.Tensor,
        seq_lens: torch.Tensor,
        block_table: torch.Tensor,
        slot_mapping: torch.Tensor,
        scale: float,
    ) -> None:
        """Capture window queries and recompute compressed rows (query/output [T, H_q, D])."""
        if not self.step:
            return
        layer = self.layer_index[layer_name]
        self.scale = scale
        evicted = []
        for row, rid, lo, hi in self.tracked_rows(query_start_loc, slot_mapping):
            state, sched = self.requests[rid], self.step[rid]
            window = state.windows[layer]
            if window.size:
                window.push(query[lo:hi], torch.arange(sched.num_computed, sched.num_computed + (hi - lo)))
            if state.evicted:
                evicted.append((row, lo, hi, state))
        if evicted:
            self._attend_rows(layer, evicted, query, output, seq_lens, block_table, scale)

    def _attend_rows(
        self,
        layer: int,
        rows: list[tuple[int, int, int, CompressedRequest]],
        query: torch.Tensor,
        output: torch.Tensor,
        seq_lens: torch.Tensor,
        block_table: torch.Tensor,
        scale: float,
    ) -> None:
        """Overwrite ``output`` rows of evicted requests with exact attention over kept tokens: one
        kernel call for all one-token rows where the layout has ``decode``, else torch per row."""
        if all(hi - lo == 1 for _, lo, hi, _ in rows):
            device = query.device
            token = torch.tensor([lo for _, lo, _, _ in rows], device=device)
            row = torch.tensor([r for r, _, _, _ in rows], device=device)
            starts = torch.stack([state.starts[layer] for *_, state in rows])
            comp = [state.compensation[layer] for *_, state in rows]
            out = self.paged[layer].decode(query[token], block_table[row], seq_lens[row], starts, comp, scale)
            if out is not None:
                output[token] = out.to(output.dtype)
                return
        for r, lo, hi, state in rows:
            out = self._attend(state, layer, query[lo:hi], block_table[r], int(seq_lens[r]), scale)
            output[lo:hi] = out.to(output.dtype)

    def rows_to_recompute(self, query_start_loc: torch.Tensor, slot_mapping: torch.Tensor) -> list[int]:
        """Rows whose attention this worker recomputes in every layer (their request evicted)."""
        return [row for row, rid, _, _ in self.tracked_rows(query_start_loc, slot_mapping) if self.requests[rid].evicted]

    def _attend(
        self, state: CompressedRequest, layer: int, q: torch.Tensor, table: torch.Tensor, seq_len: int, scale: float
    ) -> torch.Tensor:
        """Exact attention of q [n, H_q, D] over each head's live suffix (+ compensation)."""
        device = q.device
        starts = state.starts[layer].to(device)
        lo = int(starts.min())
        slots = torch.arange(lo, seq_len, device=device)
        keys, values = self.paged[layer].read(table, slots)  # [S, H_kv, D]
        group = q.shape[1] // keys.shape[1]
        keys = keys.repeat_interleave(group, dim=1)
        values = values.repeat_interleave(group, dim=1)
        n = q.shape[0]
        head_start = starts.repeat_interleave(group).view(-1, 1, 1)  # [H_q, 1, 1]
        q_pos = torch.arange(seq_len - n, seq_len, device=device).view(1, -1, 1)
        mask = (slots.view(1, 1, -1) >= head_start) & (slots.view(1, 1, -1) <= q_pos)
        out, lse = attention_with_lse(q, keys, values, scale, mask)
        comp = state.compensation[layer]
        if comp is not None:
            k_hat = comp.keys.to(device).repeat_interleave(group, dim=0)
            v_hat = comp.values.to(device).repeat_interleave(group, dim=0)
            counts = comp.counts.to(device).repeat_interleave(group)
            comp_out = v_hat.unsqueeze(0).expand(n, -1, -1).to(out.dtype)
            out, _ = merge_partials(out, lse, comp_out, compensation_lse(q, k_hat, counts, scale))
        return out

    # ------------------------------------------------------------------ after the forward
    def finish_step(self) -> None:
        """Compress requests whose prefill just completed or whose decode recompression is due."""
        for rid, sched in self.step.items():
            state = self.requests.get(rid)
            if state is None or not state.spec.compresses:
                continue
            end = sched.num_computed + sched.num_scheduled
            if not state.compressed:
                if end >= sched.prompt_len:
                    self._compress(rid, state, sched, end, decode=False)
                continue
            state.steps_since += 1
            policy = state.policy
            if policy.RECOMPRESSES and policy.due(state.policy_state, self._max_live(state, end), state.steps_since):
                self._compress(rid, state, sched, end, decode=True)

    @staticmethod
    def _max_live(state: CompressedRequest, end: int) -> int:
        return int((end - state.starts).max())

    def _layer_input(self, state: CompressedRequest, layer: int, table: torch.Tensor, end: int) -> LayerKV:
        starts = state.starts[layer] if state.compressed else torch.zeros(state.num_kv_heads, dtype=torch.long)
        lo = int(starts.min())
        keys, values = self.paged[layer].read(table, torch.arange(lo, end))  # [S, H, D]
        lengths = end - starts
        positions = torch.full((state.num_kv_heads, end - lo), -1, dtype=torch.long)
        for h in range(state.num_kv_heads):
            live = state.live_positions(layer, h, end)
            positions[h, end - lo - live.numel() :] = live
        window = state.windows[layer]
        queries = None if window.queries is None else window.queries.transpose(0, 1).cpu()
        return LayerKV(  # policies score on the host (a no-op copy on CPU)
            keys=keys.transpose(0, 1).cpu(),
            values=values.transpose(0, 1).cpu(),
            layer=layer,
            num_layers=state.num_layers,
            lengths=lengths,
            positions=positions,
            queries=queries,
            query_positions=window.positions,
            scale=self.scale,
        )

    def _compress(self, rid: str, state: CompressedRequest, sched: ScheduledRequest, end: int, decode: bool) -> None:
        started = time.perf_counter()
        table = torch.tensor(sched.block_ids, dtype=torch.long)
        inputs = [self._layer_input(state, layer, table, end) for layer in range(state.num_layers)]
        selections: list[Selection] = state.policy.select(inputs, state.policy_state)
        before = torch.stack([kv.valid_lengths() for kv in inputs])  # [L, H]
        starts = torch.empty(state.num_layers, state.num_kv_heads, dtype=torch.long)
        kept_positions: list[list[torch.Tensor]] = []
        for layer, (kv, sel) in enumerate(zip(inputs, selections)):
            lo = end - kv.num_slots
            layer_pos = []
            for h, idx in enumerate(sel.indices):
                k = idx.numel()
                src = idx + lo
                dst = torch.arange(end - k, end)
                if not torch.equal(src, dst):
                    keys, values = self.paged[layer].read_head(table, h, src)  # copies
                    self.paged[layer].write_head(table, h, dst, keys, values)
                starts[layer, h] = end - k
                layer_pos.append(kv.slot_positions()[h, idx])
            kept_positions.append(layer_pos)
            if sel.compensation is not None:  # the policy folds earlier entries in if it wants
                state.compensation[layer] = sel.compensation
        state.starts = starts
        state.kept_positions = kept_positions
        state.compact_end = end
        state.steps_since = 0
        state.policy_state.compressions += 1
        state.freeable_blocks = int(starts.min()) // self.block_size
        self._report.freeable_blocks[rid] = state.freeable_blocks
        after = end - starts
        self._report.events.append(
            CompressionEvent(
                req_id=rid,
                policy=state.spec.policy,
                tokens_before=int(before.max()),
                tokens_after=int(after.max()),
                tokens_evicted=int((before - after).sum()),
                tokens_total=int(before.sum()),
                seconds=time.perf_counter() - started,
                decode=decode,
            )
        )

    def take_report(self) -> WorkerReport | None:
        report, self._report = self._report, WorkerReport()
        if not report.freeable_blocks and not report.events:
            return None
        return report

    def clear_step(self) -> None:
        self.step = {}
        self._slot_to_req = {}
        self._rows = None
        self.step_cache = {}

