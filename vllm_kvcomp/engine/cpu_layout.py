"""Read and write tokens of vLLM's CPU paged KV cache (``vec`` ISA layout).

Per layer the cache is ``[num_blocks, H_kv, block_size, 2*D]``. On the ``vec`` ISA each
(block, head) cell stores K transposed, ``K^T[D, bs]``, followed by V as ``[bs, D]``
(verified against ``cpu_attn_reshape_and_cache`` by tests/engine/test_cpu_layout.py).
Other ISAs (amx, vec16, neon) pack differently and are refused.

Logical slot ``i`` of a request lives in block ``block_ids[i // bs]`` at offset ``i % bs``.
"""

from __future__ import annotations

import torch

SUPPORTED_ISAS = ("vec",)


class CpuPagedKV:
    """Layout-aware view of one layer's CPU KV cache."""

    def __init__(self, kv_cache: torch.Tensor, isa: str = "vec"):
        if isa not in SUPPORTED_ISAS:
            raise NotImplementedError(
                f"vllm-kvcomp's CPU path supports the {SUPPORTED_ISAS} attention ISA, got {isa!r} "
                "(use float32/float16 with head_size a multiple of 32 on x86 without AMX)"
            )
        nb, h, bs, c = kv_cache.shape
        d = c // 2
        flat = kv_cache.view(nb, h, 2 * bs * d)
        self.block_size = bs
        self.keys_t = flat[:, :, : bs * d].view(nb, h, d, bs)  # K^T per (block, head)
        self.values = flat[:, :, bs * d :].view(nb, h, bs, d)

    def _locate(self, block_table: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return block_table[slots // self.block_size].long(), slots % self.block_size

    def read(self, block_table: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """All heads at logical ``slots`` [S] -> keys, values [S, H_kv, D]."""
        blocks, offs = self._locate(block_table, slots)
        keys = self.keys_t[blocks, :, :, offs]  # advanced indices first: [S, H, D]
        values = self.values[blocks, :, offs, :]
        return keys, values

    def read_head(
        self, block_table: torch.Tensor, head: int, slots: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One head at logical ``slots`` [S] -> keys, values [S, D]."""
        blocks, offs = self._locate(block_table, slots)
        return self.keys_t[blocks, head, :, offs], self.values[blocks, head, offs, :]

    def write_head(
        self,
        block_table: torch.Tensor,
        head: int,
        slots: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
    ) -> None:
        """Write keys/values [S, D] of one head to logical ``slots`` [S]."""
        blocks, offs = self._locate(block_table, slots)
        self.keys_t[blocks, head, :, offs] = keys.to(self.keys_t.dtype)
        self.values[blocks, head, offs, :] = values.to(self.values.dtype)
