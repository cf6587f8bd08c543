"""CUDA FlashAttention backend: vLLM's ``FLASH_ATTN`` plus kvcomp's per-step hook (see ``common``).

Trimmed rows drop FA3's ahead-of-time scheduler metadata (it was planned for the old lengths);
FlashAttention then plans inside the call. Full CUDA graphs never run this Python, which is why
the connector asks vLLM for PIECEWISE graphs (attention runs eagerly between graph pieces).
"""

from __future__ import annotations

import dataclasses

import torch

from vllm_kvcomp.engine.backends.common import KVCompAttentionMixin
from vllm_kvcomp.vllm_compat import (
    FlashAttentionBackend,
    FlashAttentionImpl,
    FlashAttentionMetadata,
)


class KVCompFlashAttentionImpl(KVCompAttentionMixin, FlashAttentionImpl):
    def with_lengths(self, layer, dtype: torch.dtype, meta: FlashAttentionMetadata, seq_lens: torch.Tensor,
                     block_table: torch.Tensor) -> FlashAttentionMetadata:
        return dataclasses.replace(meta, seq_lens=seq_lens, block_table=block_table, scheduler_metadata=None)


class KVCompFlashAttentionBackend(FlashAttentionBackend):
    @staticmethod
    def get_impl_cls() -> type[KVCompFlashAttentionImpl]:
        return KVCompFlashAttentionImpl
