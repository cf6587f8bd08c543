"""CUDA Triton backend: vLLM's ``TRITON_ATTN`` plus kvcomp's per-step hook (see ``common``).

The unified Triton kernel reads ``seq_lens`` and the block table per row; its 2D/3D split and
softmax scratch buffers do not depend on the lengths, so only those two fields change.
"""

from __future__ import annotations

import dataclasses

import torch

from vllm_kvcomp.engine.backends.common import KVCompAttentionMixin
from vllm_kvcomp.vllm_compat import (
    TritonAttentionBackend,
    TritonAttentionImpl,
    TritonAttentionMetadata,
)


class KVCompTritonAttentionImpl(KVCompAttentionMixin, TritonAttentionImpl):
    def with_lengths(self, layer, dtype: torch.dtype, meta: TritonAttentionMetadata, seq_lens: torch.Tensor,
                     block_table: torch.Tensor) -> TritonAttentionMetadata:
        return dataclasses.replace(meta, seq_lens=seq_lens, block_table=block_table)


class KVCompTritonAttentionBackend(TritonAttentionBackend):
    @staticmethod
    def get_impl_cls() -> type[KVCompTritonAttentionImpl]:
        return KVCompTritonAttentionImpl
