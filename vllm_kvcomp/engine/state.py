"""Worker-side state of one compressed request: its policy, query windows and packed pages."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from vllm_kvcomp.engine.pages import RequestPages
from vllm_kvcomp.policies.base import Compensation, Policy, RequestState
from vllm_kvcomp.spec import CompressionSpec


@dataclass
class QueryWindow:
    """Rolling buffer of the last ``size`` queries of one layer: [w, H_q, D] + positions [w]."""

    size: int
    queries: torch.Tensor | None = None
    positions: torch.Tensor | None = None

    def push(self, queries: torch.Tensor, positions: torch.Tensor) -> None:
        if self.size <= 0:
            return
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
    steps_since: int = 0  # decode forwards since the last compression
    prompt_done: bool = False  # compressed at the end of the prompt (decode recompressions follow)
    prompt_end: int | None = None  # the prompt is in the cache up to here, its compression pending
    #: copy-on-compress: column -> spare block the first compaction packed into (the scheduler's
    #: block table says so too once it has processed the report; until then this is the truth)
    block_override: dict[int, int] = field(default_factory=dict)
    spares_needed: int = 0  # copy-on-compress postponed: wait until this many spares come

    @property
    def compressed(self) -> bool:
        """Whether the request's heads read packed pages (its attention is ours, not vLLM's)."""
        return self.pages.compressed
