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
    """Rolling buffer of the last ``size`` queries of one layer: [w, H_q, D] + positions [w];
    with ``limit`` only those of positions before it (``scope=context``: the context's own)."""

    size: int
    limit: int | None = None
    queries: torch.Tensor | None = None
    positions: torch.Tensor | None = None

    def push(self, queries: torch.Tensor, positions: torch.Tensor) -> None:
        if self.size <= 0:
            return
        if self.limit is not None:
            if int(positions[0]) >= self.limit:
                return
            before = positions < self.limit
            queries, positions = queries[before], positions[before]
        if self.queries is not None:
            queries = torch.cat([self.queries, queries])
            positions = torch.cat([self.positions, positions])
        self.queries = queries[-self.size :].clone()
        self.positions = positions[-self.size :].clone()


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
