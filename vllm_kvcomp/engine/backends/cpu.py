"""CPU attention backend: vLLM's ``CPU_ATTN`` plus kvcomp's per-request hooks.

The parent kernel runs for the whole batch; rows of compressed requests are then recomputed
exactly over each (layer, head)'s kept tokens by the worker (torch, fp32, with the compensation
token merged by log-sum-exp). Requests without a spec are untouched.
"""

from __future__ import annotations

import torch
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl

from vllm_kvcomp.engine.plugin import active_worker


class KVCompCPUAttentionImpl(CPUAttentionBackendImpl):
    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None) -> torch.Tensor:
        out = super().forward(layer, query, key, value, kv_cache, attn_metadata, output, output_scale,
                              output_block_scale)
        worker = active_worker()
        if worker is None or attn_metadata is None:
            return out
        n = attn_metadata.num_actual_tokens
        worker.after_attention(
            layer.layer_name,
            query[:n],
            output[:n],
            attn_metadata.query_start_loc,
            attn_metadata.seq_lens,
            attn_metadata.block_table,
            attn_metadata.slot_mapping,
            self.scale,
        )
        return out


class KVCompCPUAttentionBackend(CPUAttentionBackend):
    @staticmethod
    def get_impl_cls() -> type[KVCompCPUAttentionImpl]:
        return KVCompCPUAttentionImpl
