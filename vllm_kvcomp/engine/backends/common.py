"""What every kvcomp attention backend shares: the per-step hook around the parent kernel.

Rows of compressed requests are attended exactly by the worker (over each (layer, head)'s packed
pages, plus the compensation token). So that the parent kernel does not also attend over their
stale full-length context, those rows are trimmed for it to the block of their first new token:
block table shifted, ``seq_lens`` cut (its result for them is overwritten). The trimmed metadata is a copy, built once per step
(vLLM's persistent ``seq_lens`` and block tables are read by the sampler and other layers and are
never written). Requests without a spec, or that kept everything, are untouched. When every row of
the step is attended by the worker, the parent kernel is not called at all: the backends hooked
here write the KV cache in a separate op (``forward_includes_kv_cache_update`` False), so their
``forward`` only attends, and the worker overwrites every row's output anyway.

A backend mixes :class:`KVCompAttentionMixin` in front of vLLM's impl class and says in
:meth:`~KVCompAttentionMixin.with_lengths` how its metadata takes new lengths.
"""

from __future__ import annotations

import torch

from vllm_kvcomp.engine.plugin import active_worker


def trim_rows(
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    rows: torch.Tensor,
    block_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """New (seq_lens [B], block_table [B, W]) where each row in ``rows`` (an index on their
    device) starts at the block of its first new token: its table shifted left by ``skip``
    columns, its length cut by ``skip * block_size``. Inputs are not modified; device ops only
    (nothing read back, nothing copied from the host)."""
    seq_lens, table = seq_lens.clone(), block_table.clone()
    query_lens = query_start_loc[rows + 1] - query_start_loc[rows]
    skip = ((seq_lens[rows] - query_lens) // block_size).long()  # [R]
    width = table.shape[1]
    cols = torch.arange(width, device=table.device).unsqueeze(0) + skip.unsqueeze(1)  # [R, W]
    shifted = block_table[rows].gather(1, cols.clamp(max=width - 1))
    table[rows] = torch.where(cols < width, shifted, torch.zeros_like(shifted))
    seq_lens[rows] = seq_lens[rows] - (skip * block_size).to(seq_lens.dtype)
    return seq_lens, table


class KVCompAttentionMixin:
    """Put in front of a vLLM ``AttentionImpl`` (``class X(KVCompAttentionMixin, ParentImpl)``)."""

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None) -> torch.Tensor:
        worker = active_worker()
        if worker is None or attn_metadata is None or not worker.step or layer.layer_name not in worker.layer_index:
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output, output_scale,
                                   output_block_scale)
        if output_scale is not None or output_block_scale is not None:  # refused at start-up (support.py)
            raise RuntimeError("vllm-kvcomp: fused attention-output quantisation reached a compressed layer; "
                               "pass -cc.pass_config.fuse_attn_quant=false")
        kernel_metadata = self._kernel_metadata(worker, layer, query.dtype, attn_metadata)
        if kernel_metadata is not None:
            output = super().forward(layer, query, key, value, kv_cache, kernel_metadata, output, output_scale,
                                     output_block_scale)
        n = attn_metadata.num_actual_tokens
        worker.after_attention(layer.layer_name, query[:n], output[:n])
        return output

    def _kernel_metadata(self, worker, layer, dtype: torch.dtype, meta):
        """``meta`` with recomputed rows trimmed (built once per step and metadata object); None
        when the worker attends every row (the parent kernel has nothing to do)."""
        for seen, trimmed in worker.trimmed:  # by identity: one entry per metadata object of the step
            if seen is meta:
                return trimmed
        rows, index = worker.rows_to_recompute(self.num_heads // self.num_kv_heads)
        trimmed = meta
        if rows and len(rows) == meta.query_start_loc.shape[0] - 1:
            trimmed = None
        elif rows:
            seq_lens, table = trim_rows(meta.seq_lens, meta.block_table, meta.query_start_loc, index,
                                        worker.block_size)
            trimmed = self.with_lengths(layer, dtype, meta, seq_lens, table)
        worker.trimmed.append((meta, trimmed))
        return trimmed

    def with_lengths(self, layer, dtype: torch.dtype, meta, seq_lens: torch.Tensor, block_table: torch.Tensor):
        """A copy of ``meta`` whose kernel attends with these ``seq_lens`` and ``block_table``."""
        raise NotImplementedError
