"""CPU attention backend: vLLM's ``CPU_ATTN`` plus kvcomp's per-step hook (see ``common``).

Trimmed rows need the CPU kernel's scheduler metadata rebuilt from the new lengths.
"""

from __future__ import annotations

import dataclasses

import torch

from vllm_kvcomp import vllm_compat
from vllm_kvcomp.engine.backends.common import KVCompAttentionMixin
from vllm_kvcomp.vllm_compat import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadata,
)


class KVCompCPUAttentionImpl(KVCompAttentionMixin, CPUAttentionBackendImpl):
    def with_lengths(self, layer, dtype: torch.dtype, meta: CPUAttentionMetadata, seq_lens: torch.Tensor,
                     block_table: torch.Tensor) -> CPUAttentionMetadata:
        starts = meta.query_start_loc
        schedule = vllm_compat.cpu_attention_schedule(
            num_reqs=starts.numel() - 1, num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
            head_dim=self.head_size, seq_lens=seq_lens, dtype=dtype, query_start_loc=starts,
            causal=meta.causal, sliding_window_size=self.sliding_window, isa=vllm_compat.cpu_attention_isa(layer),
            dynamic_causal=meta.dynamic_causal, kv_cache_dtype=self.kv_cache_dtype,
        )
        return dataclasses.replace(meta, seq_lens=seq_lens, block_table=block_table, scheduler_metadata=schedule,
                                   max_seq_len=int(seq_lens.max()))


class KVCompCPUAttentionBackend(CPUAttentionBackend):
    @staticmethod
    def get_impl_cls() -> type[KVCompCPUAttentionImpl]:
        return KVCompCPUAttentionImpl
