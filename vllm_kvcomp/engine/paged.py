"""The one interface between the worker and a backend's paged KV layout.

A layout wraps one layer's cache (vLLM's logical ``[num_blocks, H_kv, block_size, 2*D]`` tensor,
whatever its physical packing) and moves tokens by *logical slot*: slot ``i`` of a request lives
in block ``block_table[i // bs]`` at offset ``i % bs``. Implementations: ``cpu_layout`` (vLLM's
CPU kernels) and ``flash_layout`` (FlashAttention / Triton on CUDA).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from vllm_kvcomp.policies.base import Compensation

Tensors = tuple[torch.Tensor, torch.Tensor]


class PagedKV(ABC):
    block_size: int
    device: torch.device = torch.device("cpu")

    def _locate(self, block_table: torch.Tensor, slots: torch.Tensor) -> Tensors:
        """(block ids, offsets) [S] of logical ``slots`` [S], on the cache's device."""
        slots = slots.to(self.device)
        return block_table.to(self.device)[slots // self.block_size].long(), slots % self.block_size

    @abstractmethod
    def read(self, block_table: torch.Tensor, slots: torch.Tensor) -> Tensors:
        """All heads at logical ``slots`` [S] -> keys, values [S, H_kv, D] (cache's device)."""

    @abstractmethod
    def read_head(self, block_table: torch.Tensor, head: int, slots: torch.Tensor) -> Tensors:
        """One head at logical ``slots`` [S] -> keys, values [S, D] (copies)."""

    @abstractmethod
    def write_head(self, block_table: torch.Tensor, head: int, slots: torch.Tensor, keys: torch.Tensor,
                   values: torch.Tensor) -> None:
        """Write keys/values [S, D] of one head to logical ``slots`` [S]."""

    def decode(self, q: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor, starts: torch.Tensor,
               compensation: list[Compensation | None], scale: float) -> torch.Tensor | None:
        """Attention of one query per row, q [R, H_q, D], over each head's live suffix
        ``[starts[r, h], seq_lens[r])`` plus the row's compensation token (eq. 5) -> out
        [R, H_q, D]; None where the layout has no batched path (the worker then recomputes
        each row in torch from :meth:`read`)."""
        return None
