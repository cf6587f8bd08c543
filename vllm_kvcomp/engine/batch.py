"""One step's plan for the layers: which batch rows are ours, the queries every layer captures,
and the compressed rows' virtual sequences (page tables, lengths, query layout), made once per
step on the host and sent in one transfer (:mod:`~vllm_kvcomp.engine.staging`), so that no layer
reads anything back from the device or copies from pageable host memory.

Which rows belong to which request comes from the model runner's batch order (its request ids in
row order, told to the worker before the forward: :meth:`KVCompWorker.set_batch`) and the
scheduler's token counts, never from device tensors.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from vllm_kvcomp.engine.cache import SequenceCompensation
from vllm_kvcomp.engine.pages import NO_PAGE, RequestPages
from vllm_kvcomp.engine.staging import HostStaging
from vllm_kvcomp.engine.state import QueryWindow


@dataclass
class Row:
    """A tracked request's batch row: its query tokens ``[lo, hi)``."""

    index: int
    req_id: str
    lo: int
    hi: int


def batch_rows(order: Sequence[str], num_scheduled: Mapping[str, int], tracked: Mapping[str, object]) -> list[Row]:
    """The rows of ``tracked`` requests in a batch of requests ``order`` (row order), each
    computing ``num_scheduled[req_id]`` tokens (host data only)."""
    rows, lo = [], 0
    for index, rid in enumerate(order):
        hi = lo + num_scheduled[rid]
        if rid in tracked:
            rows.append(Row(index, rid, lo, hi))
        lo = hi
    return rows


def contiguous_decode(rows: list[Row], heads: int) -> slice | None:
    """The slice of ``query.view(-1, G, D)`` that the rows' sequences read, when it is one run:
    one query per row and adjacent rows (decode), sequence (row, head) = row.lo * heads + head."""
    if not rows or any(r.hi - r.lo != 1 for r in rows) or any(b.lo != a.hi for a, b in itertools.pairwise(rows)):
        return None
    return slice(rows[0].lo * heads, rows[-1].hi * heads)


@dataclass
class Capture:
    """A request whose queries of positions ``[start, start + count)`` (query rows from ``lo``)
    every layer captures this step, at ``offset`` in the step's capture buffer; pushed into its
    window after the forward. ``truncate``: the window forgets positions from there first (the
    step recomputes them: rolled-back drafts)."""

    window: QueryWindow
    lo: int
    count: int
    start: int
    drafts: int
    truncate: int
    offset: int = 0


class StepCapture:
    """Every layer's queries of the step's :class:`Capture` rows, gathered into one buffer
    ``[T, L, H_q, D]`` (one copy per layer whatever the batch), pushed into the requests' windows
    once the forward is done (one copy per request per step)."""

    def __init__(self) -> None:
        self._buffer: torch.Tensor | None = None
        self.captures: list[Capture] = []
        self.source: torch.Tensor | slice | None = None  # query rows, in capture order
        self.rows = 0

    def plan(self, captures: list[Capture]) -> torch.Tensor | None:
        """Lay the captures out; returns the host index of their query rows (None: a slice, or none)."""
        self.captures, offset = captures, 0
        for c in captures:
            c.offset, offset = offset, offset + c.count
        self.rows = offset
        if not captures:
            self.source = None
            return None
        if all(b.lo == a.lo + a.count for a, b in itertools.pairwise(captures)):
            self.source = slice(captures[0].lo, captures[0].lo + offset)
            return None
        return torch.cat([torch.arange(c.lo, c.lo + c.count) for c in captures])

    def layer(self, layer: int, num_layers: int, query: torch.Tensor) -> None:
        """Capture this layer's rows of ``query`` [T, H_q, D]."""
        if not self.rows:
            return
        buffer, shape = self._buffer, (num_layers, *query.shape[1:])
        if buffer is None or buffer.shape[0] < self.rows or buffer.shape[1:] != shape \
                or buffer.dtype != query.dtype or buffer.device != query.device:
            buffer = self._buffer = query.new_empty((max(self.rows, 2 * (0 if buffer is None else buffer.shape[0])),
                                                     *shape))
        buffer[: self.rows, layer] = query[self.source]

    def push(self) -> None:
        """Hand every capture its rows (all layers) once the forward is done."""
        for c in self.captures:
            c.window.truncate(c.truncate)
            c.window.push(self._buffer[c.offset : c.offset + c.count], c.start, c.drafts)
        self.captures, self.rows, self.source = [], 0, None


@dataclass
class PagedBatch:
    """This step's virtual sequences of compressed rows, sequence s = (row, head) in row order."""

    tables: torch.Tensor  # [L, S, W] int32 page ids (device)
    lengths: torch.Tensor  # [L, S] int32 (device)
    query_start: torch.Tensor  # [S + 1] int32 query rows of each sequence in the gathered queries (device)
    query_rows: list[int]  # [S] the same, on the host
    gather: torch.Tensor | slice  # [T_seq] index into query.view(-1, G, D) (token * H_kv + head),
    # or the slice it equals when contiguous (one query per row, adjacent rows: a view, no copy)
    requests: list  # [R] CompressedRequest
    compensation: list  # per layer: SequenceCompensation | None (None: no sequence has a token)
    memos: list[dict[str, object]]  # per layer; one dict shared by the layers with equal lengths (PagedCache.attend)
    observe: torch.Tensor | None  # [L, S] int64 rows the kernel sums attention into (0 = none); None: no sequence


class StepTables:
    """The compressed rows' page tables ``[L, S, W]`` on the device, kept between steps.

    While the same requests are the compressed rows, in the same order, with the same packed
    pages, a step only writes the tail pages that came in since (a decode step crossing into a
    new block: one page per (layer, head) of that request), sent with the step's plan; anything
    else (a request joins or leaves, a compaction, a table wider than the buffer) rebuilds them
    from the host tables. The width has room to grow (:data:`SLACK`)."""

    SLACK = 16  # pages of room past the widest table at a rebuild

    def __init__(self, num_layers: int, device: torch.device):
        self.num_layers = num_layers
        self.device = device
        self.tables: torch.Tensor | None = None  # [L, S, W_cap] int32
        self.base: torch.Tensor | None = None  # [L, S] int64: each head's length less its request's length
        self.base_host = torch.zeros(num_layers, 0, dtype=torch.long)  # the same on the host
        self.groups: list[int] = []  # per layer: the first layer whose heads are all as long
        self._members: list[tuple[RequestPages, tuple[int, ...]]] = []
        self.rebuilds = 0  # whole-table sends (tests count them)

    def update(self, members: list[tuple[RequestPages, list[int], int]]) -> tuple[torch.Tensor | None, ...]:
        """Bring the tables to ``members`` (pages, block ids, length) in row order; returns the
        host tensors to send: (flat indices, page ids) of a partial update, or (tables, base)
        of a rebuild, the other pair None (all four None: nothing changed). :meth:`apply`
        takes them on the device."""
        current = [(p, p.tail_blocks(ids, end)) for p, ids, end in members]
        partial = self._appended(current)
        self._members = current
        if partial is not None:
            return (*partial, None, None)
        tables = [p.tables(ids, end) for p, ids, end in members]
        width = max((t.shape[2] for t in tables), default=0) + self.SLACK
        padded = [torch.nn.functional.pad(t, (0, width - t.shape[2]), value=NO_PAGE) for t in tables]
        joined = torch.cat(padded, dim=1) if padded else torch.zeros(self.num_layers, 0, width, dtype=torch.long)
        base = [p.lengths(0) for p, _, _ in members]  # lengths(seq_len) = lengths(0) + seq_len
        base = torch.cat(base, dim=1) if base else torch.zeros(self.num_layers, 0, dtype=torch.long)
        first: dict[tuple[int, ...], int] = {}
        self.groups = [first.setdefault(tuple(row), layer) for layer, row in enumerate(base.tolist())]
        self.base_host = base
        self.rebuilds += 1
        return None, None, joined.to(torch.int32), base

    def _appended(self, current: list[tuple[RequestPages, tuple[int, ...]]]) -> tuple[torch.Tensor | None, ...] | None:
        """(flat indices, page ids) of the tail pages that came in since the last step, (None,
        None) when none did; None when the tables must be rebuilt."""
        if self.tables is None or len(current) != len(self._members):
            return None
        _, sequences, width = self.tables.shape
        index, pages = [], []
        for r, ((p, tail), (old, old_tail)) in enumerate(zip(current, self._members)):
            if p is not old or tail[: len(old_tail)] != old_tail:
                return None
            if len(tail) == len(old_tail):
                continue
            heads = p.counts.shape[1]
            rows = torch.arange(self.num_layers).view(-1, 1) * sequences + r * heads + torch.arange(heads)  # [L, H]
            for i in range(len(old_tail), len(tail)):  # a new tail block: each head's column counts + i
                if int(p.counts.max()) + i >= width:
                    return None
                index.append((rows * width + p.counts + i).flatten())
                pages.append(p.geometry.page_ids(torch.tensor([tail[i]]))[..., 0].flatten())
        if not index:
            return None, None
        return torch.cat(index), torch.cat(pages).to(torch.int32)

    def apply(self, index: torch.Tensor | None, pages: torch.Tensor | None, tables: torch.Tensor | None,
              base: torch.Tensor | None) -> None:
        """Take :meth:`update`'s tensors, now on the device (copied out of the staging ring)."""
        if tables is not None:
            self.tables, self.base = tables.clone(), base.clone()
        elif index is not None:
            self.tables.view(-1).index_copy_(0, index, pages)


def send_plan(staging: HostStaging, **host: torch.Tensor | None) -> dict[str, torch.Tensor | None]:
    """``host`` tensors on the device in one transfer, by name."""
    names = list(host)
    return dict(zip(names, staging.send(*(host[n] for n in names)), strict=True))


class CompensationPlan:
    """The step's compensation tokens (RazorAttention eq. 5) per (layer, sequence), made on the
    host when the compressed rows or their tokens change (a compression, a request joining or
    leaving) and kept on the device until then: :attr:`unsent` holds what the next transfer must
    carry, :meth:`received` keeps it."""

    def __init__(self, key: tuple, requests: list, num_kv_heads: int, head_dim: int, every: list[bool]):
        self.key, self.every = key, every
        shape = (len(every), len(requests), num_kv_heads)
        self.needed = any(every) or any(c is not None for state in requests for c in state.compensation)
        keys, counts = torch.zeros(*shape, head_dim), torch.zeros(shape)
        values = torch.zeros_like(keys)
        for r, state in enumerate(requests):
            for layer, comp in enumerate(state.compensation):
                if comp is not None:
                    keys[layer, r], values[layer, r], counts[layer, r] = comp.keys, comp.values, comp.counts
        self.counts = counts.flatten(1)  # [L, S] host
        self.present = (self.counts > 0) | torch.tensor(every).view(-1, 1)  # [L, S]: merges
        self.unsent = (keys.flatten(1, 2), values.flatten(1, 2), self.counts) if self.needed else (None, None, None)
        self.device: tuple[torch.Tensor, ...] | None = None

    def received(self, sent: tuple[torch.Tensor | None, ...]) -> None:
        """Keep the sent tensors on the device (out of the staging ring)."""
        if sent[0] is not None:
            self.device = tuple(t.clone() for t in sent)
            self.unsent = (None, None, None)

    def layers(self, query_rows: list[int], lengths: torch.Tensor, block_size: int) -> list[SequenceCompensation | None]:
        """Per layer, the sequences' tokens and which need a merge; None where no sequence does
        (no token, no sinks). ``lengths`` [L, S] on the host."""
        if not self.needed:
            return [None] * len(self.every)
        keys, values, counts = self.device
        return SequenceCompensation.schedule(keys, values, counts, self.present, query_rows, lengths, block_size)


@dataclass
class StepPlan:
    """What every layer of a step reads (:meth:`KVCompWorker._step_plan`)."""

    rows: list[Row]  # tracked requests' rows
    recomputed: list[int]  # rows of compressed requests (the worker attends them)
    recompute_index: torch.Tensor  # the same on the device
    batch: PagedBatch
