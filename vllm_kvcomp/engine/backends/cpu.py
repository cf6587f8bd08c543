"""CPU attention backend: vLLM's ``CPU_ATTN`` plus kvcomp's per-request hooks.

Rows of requests that evicted tokens are recomputed exactly over each (layer, head)'s kept
tokens by the worker (torch, fp32, compensation token merged by log-sum-exp). So that the
parent kernel does not also attend over their stale full-length context, those rows are trimmed
for it to the last block (block table shifted, ``seq_lens`` cut) with scheduler metadata rebuilt
once per step. Requests without a spec, or that kept everything, are untouched.
"""

from __future__ import annotations

import dataclasses

import torch
from vllm import _custom_ops as ops
from vllm import envs
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadata,
)

from vllm_kvcomp.engine.plugin import active_worker


class KVCompCPUAttentionImpl(CPUAttentionBackendImpl):
    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None) -> torch.Tensor:
        worker = active_worker()
        if worker is None or attn_metadata is None or not worker.step:
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output, output_scale,
                                   output_block_scale)
        kernel_metadata = self._trimmed(worker, layer, query.dtype, attn_metadata)
        out = super().forward(layer, query, key, value, kv_cache, kernel_metadata, output, output_scale,
                              output_block_scale)
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

    def _trimmed(self, worker, layer, dtype: torch.dtype, meta: CPUAttentionMetadata) -> CPUAttentionMetadata:
        """``meta`` with recomputed rows cut to the block of their first new token (cached per step)."""
        cached = worker.step_cache.get(id(meta))
        if cached is not None:
            return cached
        rows = worker.rows_to_recompute(meta.query_start_loc, meta.slot_mapping)
        trimmed = meta
        if rows:
            seq_lens, table = meta.seq_lens.clone(), meta.block_table.clone()
            starts = meta.query_start_loc
            bs = worker.block_size
            for row in rows:
                first_new = int(meta.seq_lens[row]) - int(starts[row + 1] - starts[row])
                skip = first_new // bs
                table[row, : table.shape[1] - skip] = meta.block_table[row, skip:].clone()
                seq_lens[row] -= skip * bs
            schedule = ops.cpu_attn_get_scheduler_metadata(
                num_reqs=starts.numel() - 1, num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
                head_dim=self.head_size, seq_lens=seq_lens, dtype=dtype, query_start_loc=starts,
                causal=meta.causal, sliding_window_size=self.sliding_window, isa=layer.isa,
                enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV, dynamic_causal=meta.dynamic_causal,
                kv_cache_dtype=self.kv_cache_dtype,
            )
            trimmed = dataclasses.replace(meta, seq_lens=seq_lens, block_table=table, scheduler_metadata=schedule,
                                          max_seq_len=int(seq_lens.max()))
        worker.step_cache[id(meta)] = trimmed
        return trimmed


class KVCompCPUAttentionBackend(CPUAttentionBackend):
    @staticmethod
    def get_impl_cls() -> type[KVCompCPUAttentionImpl]:
        return KVCompCPUAttentionImpl
