"""Worker-side state of one compressed request.

Slots are *logical* token indices (0 .. tokens in cache). After a compression of a request
holding ``end`` tokens, head h of layer l keeps ``k[l,h]`` tokens written right-aligned into
slots ``[end - k[l,h], end)``; decode tokens are appended after ``end`` as usual. So each
(layer, head) is live on the suffix ``[start[l,h], seq_len)``, and block-table columns before
``min(start) // block_size`` hold no live token: those blocks go back to vLLM's pool.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

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
    num_layers: int
    num_kv_heads: int
    policy_state: RequestState = field(default_factory=RequestState)
    windows: list[QueryWindow] = field(default_factory=list)
    # set by the first compression:
    starts: torch.Tensor | None = None  # [L, H_kv] first live logical slot per (layer, head)
    kept_positions: list[list[torch.Tensor]] | None = None  # [L][H] logical positions of kept slots
    compact_end: int = 0  # logical length at the last compression
    compensation: list[Compensation | None] = field(default_factory=list)
    steps_since: int = 0  # decode forwards since the last compression
    freeable_blocks: int = 0  # leading block-table columns with no live token

    @property
    def compressed(self) -> bool:
        return self.starts is not None

    @property
    def evicted(self) -> bool:
        """Whether any (layer, head) dropped a token: then every layer's attention is recomputed
        over the kept suffixes (if nothing was dropped, vLLM's kernel result is already exact)."""
        if self.starts is None:
            return False
        return bool(self.starts.max() > 0) or any(c is not None for c in self.compensation)

    def live_positions(self, layer: int, head: int, seq_len: int) -> torch.Tensor:
        """Logical positions of head ``head``'s live slots ``[start, seq_len)`` (ascending)."""
        if self.kept_positions is None:
            return torch.arange(seq_len)
        tail = torch.arange(self.compact_end, seq_len)
        return torch.cat([self.kept_positions[layer][head], tail])
