"""Read, write and attend over vLLM's standard GPU paged KV layout (FlashAttention, Triton).

Per layer vLLM hands the connector a logical ``[num_blocks, H_kv, block_size, 2*D]`` view (K in
``[0, D)``, V in ``[D, 2D)`` of a token-head cell; the physical order is the backend's, the view's
strides say which). ``transpose(1, 2)`` gives ``[num_blocks, block_size, H_kv, 2*D]``, the
convention of :mod:`vllm_kvcomp.ops`, whose kernels attend over right-aligned per-head suffixes.

Logical slot ``i`` of a request lives in block ``block_ids[i // bs]`` at offset ``i % bs``. Index
tensors may live on the host; they are moved to the cache's device. Quantized (fp8) caches are
refused: moving their cells is fine but the policies would score quantized bytes.
"""

from __future__ import annotations

import torch

from vllm_kvcomp import ops
from vllm_kvcomp.engine.paged import PagedKV, Tensors
from vllm_kvcomp.policies.base import Compensation
from vllm_kvcomp.policies.compensation import stack_compensation

FLOAT_CACHE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class FlashPagedKV(PagedKV):
    """Layout-aware view of one layer's KV cache in vLLM's standard (FlashAttention) layout."""

    def __init__(self, kv_cache: torch.Tensor):
        if kv_cache.dtype not in FLOAT_CACHE_DTYPES:
            raise NotImplementedError(
                f"vllm-kvcomp needs an unquantized KV cache ({', '.join(map(str, FLOAT_CACHE_DTYPES))}), got "
                f"{kv_cache.dtype}: start vLLM with --kv-cache-dtype auto"
            )
        self.block_size = kv_cache.shape[2]
        self.head_dim = kv_cache.shape[3] // 2
        self.cells = kv_cache.transpose(1, 2)  # [nb, bs, H, 2D]
        self.device = kv_cache.device

    def read(self, block_table: torch.Tensor, slots: torch.Tensor) -> Tensors:
        blocks, offs = self._locate(block_table, slots)
        cells = self.cells[blocks, offs]  # [S, H, 2D]
        return cells[..., : self.head_dim], cells[..., self.head_dim :]

    def read_head(self, block_table: torch.Tensor, head: int, slots: torch.Tensor) -> Tensors:
        blocks, offs = self._locate(block_table, slots)
        cells = self.cells[blocks, offs, head]  # [S, 2D]
        return cells[:, : self.head_dim], cells[:, self.head_dim :]

    def write_head(self, block_table: torch.Tensor, head: int, slots: torch.Tensor, keys: torch.Tensor,
                   values: torch.Tensor) -> None:
        blocks, offs = self._locate(block_table, slots)
        cells = torch.cat([keys, values], dim=-1).to(device=self.device, dtype=self.cells.dtype)
        self.cells[blocks, offs, head] = cells

    def decode(self, q: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor, starts: torch.Tensor,
               compensation: list[Compensation | None], scale: float) -> torch.Tensor:
        """All rows in one ``ops.decode_attention`` call (CUDA extension or Triton on a GPU)."""
        comp = stack_compensation(compensation, starts.shape[1], self.head_dim)
        if comp is not None:
            comp = tuple(t.to(self.device) for t in comp)
        out, _ = ops.decode_attention(
            q,
            self.cells,
            block_tables.to(self.device),
            seq_lens.to(self.device),
            start=starts.to(self.device),
            compensation=comp,
            scale=scale,
        )
        return out
