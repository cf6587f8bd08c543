"""Worker-side state of one compressed request: its policy, query windows and packed pages."""

from __future__ import annotations

import dataclasses
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from vllm_kvcomp.engine.lifecycle import Lifecycle, Phase
from vllm_kvcomp.engine.offload import Decision
from vllm_kvcomp.engine.pages import RequestPages
from vllm_kvcomp.policies.base import Compensation, Policy, RequestState
from vllm_kvcomp.spec import CompressionSpec


@dataclass
class QueryWindow:
    """Rolling buffer of the last ``size`` queries of one layer: ``queries`` [w, H_q, D] and
    ``positions`` [w]; with ``limit`` only those of positions before it (``scope=context``: the
    context's own). Queries of draft tokens a speculative step may still reject are held beyond
    the ``size`` (rolled back with :meth:`truncate`), so a rejection never shortens the window.
    Held positions are consecutive, ending at ``end``; bookkeeping stays on the host (no reads of
    device tensors: it runs inside every layer).

    The rows live in a preallocated buffer, held at ``[_start, _stop)``: a decode step's push is
    one copy into the next free rows; when the buffer is full, the rows still wanted move to its
    front (one copy per ``size`` pushes). :attr:`queries` is a view of it, valid until the next
    push (the engine reads it at once, inside a compression)."""

    size: int
    limit: int | None = None
    end: int = 0  # one past the last held position
    _buffer: torch.Tensor | None = None  # [capacity, H_q, D]
    _start: int = 0
    _stop: int = 0

    @property
    def held(self) -> int:
        return self._stop - self._start

    @property
    def queries(self) -> torch.Tensor | None:
        if not self.held:
            return None
        return self._buffer[max(self._start, self._stop - self.size) : self._stop]

    @property
    def positions(self) -> torch.Tensor | None:
        """[w] int64 positions of :attr:`queries` (consecutive, ending at ``end``; made on read)."""
        if not self.held:
            return None
        return torch.arange(self.end - min(self.size, self.held), self.end)

    def push(self, queries: torch.Tensor, start: int, drafts: int = 0) -> None:
        """Append queries [n, H_q, D] of positions ``start..start+n-1``, the last ``drafts`` of
        them draft tokens; held queries at or after ``start`` are dropped first (a speculative
        step's rejected drafts, computed again)."""
        n, buffer, keep = queries.shape[0], self._buffer, self.size + drafts
        if (start == self.end and buffer is not None and n <= keep <= buffer.shape[0]
                and self._stop + n <= buffer.shape[0]
                and (self.limit is None or start + n <= self.limit)):  # a decode step: one copy
            buffer[self._stop : self._stop + n] = queries
            self._stop += n
            self._start = max(self._start, self._stop - keep)
            self.end += n
            return
        if self.size <= 0:
            return
        self.truncate(start)
        if self.limit is not None:
            if start >= self.limit:
                return
            n = min(n, self.limit - start)
            queries = queries[:n]
        if start != self.end:  # not consecutive: start over
            self._start = self._stop = 0
        new = queries[-keep:]  # a view of vLLM's buffer, copied below
        carried = min(self.held, keep - new.shape[0])  # held rows still wanted after this push
        if buffer is None or buffer.shape[0] < keep or buffer.shape[1:] != new.shape[1:] \
                or buffer.dtype != new.dtype or buffer.device != new.device:
            buffer = new.new_empty((2 * keep, *new.shape[1:]))
            if carried:
                buffer[:carried] = self._buffer[self._stop - carried : self._stop]
            self._buffer, self._start, self._stop = buffer, 0, carried
        elif self._stop + new.shape[0] > buffer.shape[0]:  # full: the wanted rows to the front
            buffer[:carried] = buffer[self._stop - carried : self._stop].clone()
            self._start, self._stop = 0, carried
        buffer[self._stop : self._stop + new.shape[0]] = new
        self._stop += new.shape[0]
        self._start = self._stop - min(keep, self._stop - self._start)
        self.end = start + n

    def wanted(self, start: int, n: int, drafts: int = 0) -> tuple[int, int]:
        """Which of ``n`` queries of positions ``start..`` a :meth:`push` would keep: (first, count)
        (the last ``size + drafts`` of those before ``limit``); the capture copies only those."""
        if self.size <= 0:
            return 0, 0
        if self.limit is not None:
            n = max(0, min(n, self.limit - start))
        count = min(n, self.size + drafts)
        return n - count, count

    def frozen(self) -> QueryWindow:
        """A copy holding only :attr:`queries` (its own rows): what a compression decided off
        the step reads while this window goes on capturing."""
        queries = self.queries
        if queries is None:
            return QueryWindow(self.size, self.limit, self.end)
        return dataclasses.replace(self, _buffer=queries.clone(), _start=0, _stop=queries.shape[0])

    def release(self) -> None:
        """Give the rows back (a compressed request whose next decision reads no queries, or
        none it has yet): a later :meth:`push` allocates them again."""
        self._buffer, self._start, self._stop = None, 0, 0

    def truncate(self, end: int) -> None:
        """Forget the queries of positions ``>= end`` (tokens the engine rolled back)."""
        if self.end <= end:
            return
        self._stop = max(self._start, self._stop - (self.end - end))
        self.end = end


@dataclass
class ObservedAttention:
    """The attention each cell of a request's virtual sequences received from its decode queries
    since its last compression, as kvcomp's decode kernel (CPU or Triton) attended them (it adds each query's softmax
    weights, the mean over a KV head's query heads): ``sums`` [L, H, capacity] float32 on the
    cache's device, cell v of head h of layer l at ``[l, h, v]`` (virtual order, like its page
    table), of the queries through position ``through`` (-1: none; before the first compression
    the prompt's queries are the window's). ``active`` while the kernel observes each step: the
    first step it cannot (one of several query rows, e.g. with draft tokens) stops it until the
    next compression, and the window captures the queries from there on."""

    sums: torch.Tensor | None = None
    through: int = -1
    active: bool = False
    _addresses: torch.Tensor | None = field(default=None, repr=False)  # [L, H] int64, of the current sums

    #: capacity grows in steps of this many cells (a new buffer every 256 decode steps at most)
    GROWTH: ClassVar[int] = 256

    def reserve(self, lengths: torch.Tensor, device: torch.device) -> None:
        """Rows at least ``lengths`` [L, H] cells long (grown, the sums carried, when they are not)."""
        need = int(lengths.max())
        if self.sums is None or self.sums.shape[2] < need:
            grown = torch.zeros(*lengths.shape, -(-need // self.GROWTH) * self.GROWTH, dtype=torch.float32,
                                device=device)
            if self.sums is not None:
                grown[..., : self.sums.shape[2]] = self.sums
            self.sums, self._addresses = grown, None

    def addresses(self, lengths: torch.Tensor, device: torch.device) -> torch.Tensor:
        """[L, H] int64 address of every head's row, the rows at least ``lengths`` [L, H] cells long."""
        self.reserve(lengths, device)
        if self._addresses is None:
            rows = torch.arange(lengths.numel(), dtype=torch.int64).view(lengths.shape)
            self._addresses = self.sums.data_ptr() + rows * self.sums.shape[2] * self.sums.element_size()
        return self._addresses

    def frozen(self) -> ObservedAttention:
        """A copy with its own sums (a compression decided off the step reads them while the
        kernel goes on adding to these)."""
        sums = None if self.sums is None else self.sums.clone()
        return ObservedAttention(sums, self.through, self.active)

    def restart(self, end: int) -> None:
        """After a compression at ``end`` tokens: nothing observed since, every query from now on will be."""
        if self.sums is not None:
            self.sums.zero_()
        self.through, self.active = end - 1, True


@dataclass
class CompressedRequest:
    """Everything the worker keeps for one request with a compression spec."""

    spec: CompressionSpec
    policy: Policy
    pages: RequestPages
    policy_state: RequestState = field(default_factory=RequestState)
    #: the last queries of every layer (``[w, L, H_q, D]`` rows); None: the policy reads none
    window: QueryWindow | None = None
    compensation: list[Compensation | None] = field(default_factory=list)  # per layer
    compensation_version: int = 0  # counts the compressions that changed :attr:`compensation`
    lifecycle: Lifecycle = field(default_factory=Lifecycle)  # phase, pending compression point, spares
    #: (tokens, longest head over every rank) at the end of the last decode step; None after a
    #: compression (until the next decode step's end)
    live: tuple[int, int] | None = None
    #: the decode queries' attention the kernel sums for a policy with ``OBSERVES_ATTENTION``
    #: (None: the policy does not read it, or the engine's kernel cannot sum it)
    observed: ObservedAttention | None = None
    #: the longest head over every tensor-parallel rank less the request's length (0 until the
    #: first compaction), agreed at each compression: a step computes ``live`` with no collective
    longest_base: int = 0
    #: its compression being decided off the step (COMPRESSING), or one decided and waiting for
    #: copy-on-compress spares (:mod:`~vllm_kvcomp.engine.offload`)
    pending: Future | None = None  # of a Decision
    decided: Decision | None = None

    @property
    def compressed(self) -> bool:
        """Whether the request's heads read packed pages (its attention is ours, not vLLM's)."""
        return self.pages.compressed

    @property
    def reads_queries(self) -> bool:
        """Whether a query captured now may still be read: until the first compression, during
        the prefill of a ``prefill=block`` request (every chunk is scored with its own queries),
        and otherwise only by a policy that recompresses (the others' windows are never read
        again) while its next decision reads the cache (:meth:`~Policy.reads_cache`; one that
        reads no keys computes no attention: a window sliding past pinned tokens reads positions only)."""
        if not self.pages.compressed:
            return True
        if self.policy.prefill == "block" and self.lifecycle.phase is not Phase.DECODE:
            return True
        if self.observed is not None and self.observed.active:  # the kernel sums what the policy reads
            return False
        return self.policy.recompresses and self.policy.reads_cache(self.policy_state)

    def captures(self, end: int, drafts: int) -> bool:
        """Whether the queries of a step ending at ``end`` tokens are captured: while
        :attr:`reads_queries`, unless no recompression can read them. A window of ``size``
        queries read at the step ``j`` steps from now holds this step's only if ``j < size``; the
        policy's :meth:`~Policy.due` only grows with the tokens and the steps, so asking it about
        the step ``size - 1`` ahead tells whether any of them may be due (each step adds a token
        to every head). Captured always before the first compression, with draft tokens, and
        when the longest head is not known (the first step after a compression)."""
        if not self.reads_queries:
            return False
        if not self.pages.compressed or drafts or self.live is None or self.lifecycle.phase is Phase.COMPRESSING:
            return True
        size = self.window.size if self.window is not None else 0
        live = self.live[1] + end - self.live[0]
        return self.policy.due(self.policy_state, live + size - 1, self.lifecycle.steps_since + size)
