"""Worker-side state of one compressed request: its policy, query windows and packed pages."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from vllm_kvcomp.engine.lifecycle import Lifecycle
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
    device tensors: it runs inside every layer)."""

    size: int
    limit: int | None = None
    _queries: torch.Tensor | None = None  # [size + drafts, H_q, D], positions end - held .. end - 1
    end: int = 0  # one past the last held position

    @property
    def queries(self) -> torch.Tensor | None:
        return None if self._queries is None else self._queries[-self.size :]

    @property
    def positions(self) -> torch.Tensor | None:
        """[w] int64 positions of :attr:`queries` (consecutive, ending at ``end``; made on read)."""
        if self._queries is None:
            return None
        held = min(self.size, self._queries.shape[0])
        return torch.arange(self.end - held, self.end)

    def push(self, queries: torch.Tensor, start: int, drafts: int = 0) -> None:
        """Append queries [n, H_q, D] of positions ``start..start+n-1``, the last ``drafts`` of
        them draft tokens; held queries at or after ``start`` are dropped first (a speculative
        step's rejected drafts, computed again)."""
        if self.size <= 0:
            return
        self.truncate(start)
        n = queries.shape[0]
        if self.limit is not None:
            if start >= self.limit:
                return
            n = min(n, self.limit - start)
            queries = queries[:n]
        if self._queries is not None and start != self.end:  # not consecutive: start over
            self._queries = None
        keep = self.size + drafts
        queries = queries[-keep:]  # a view of vLLM's buffer
        if self._queries is not None:
            queries = torch.cat([self._queries, queries])[-keep:]  # a new tensor of ours (<= 2 keep rows)
        else:
            queries = queries.clone()
        self._queries, self.end = queries, start + n

    def truncate(self, end: int) -> None:
        """Forget the queries of positions ``>= end`` (tokens the engine rolled back)."""
        if self._queries is None or self.end <= end:
            return
        held = self._queries.shape[0] - (self.end - end)
        self.end = end
        self._queries = self._queries[:held] if held > 0 else None


@dataclass
class CompressedRequest:
    """Everything the worker keeps for one request with a compression spec."""

    spec: CompressionSpec
    policy: Policy
    pages: RequestPages
    policy_state: RequestState = field(default_factory=RequestState)
    windows: list[QueryWindow] = field(default_factory=list)
    compensation: list[Compensation | None] = field(default_factory=list)  # per layer
    lifecycle: Lifecycle = field(default_factory=Lifecycle)  # phase, pending compression point, spares

    @property
    def compressed(self) -> bool:
        """Whether the request's heads read packed pages (its attention is ours, not vLLM's)."""
        return self.pages.compressed

    @property
    def reads_queries(self) -> bool:
        """Whether a query captured now may still be read: until the first compression, and after
        it only by a policy that recompresses (the others' windows are never read again)."""
        return not self.pages.compressed or self.policy.recompresses
