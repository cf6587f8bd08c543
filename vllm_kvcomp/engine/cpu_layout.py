"""Read and write tokens of vLLM's CPU paged KV cache (``vec`` ISA layout).

Per layer the cache is ``[num_blocks, H_kv, block_size, 2*D]``. On the ``vec`` ISA each
(block, head) cell stores K transposed, ``K^T[D, bs]``, followed by V as ``[bs, D]``
(verified against ``cpu_attn_reshape_and_cache`` by tests/engine/test_cpu_layout.py).
Other ISAs (amx, vec16, neon) pack differently and are refused.

Logical slot ``i`` of a request lives in block ``block_ids[i // bs]`` at offset ``i % bs``.
"""

from __future__ import annotations

import torch

from vllm_kvcomp.policies.base import Compensation
from vllm_kvcomp.policies.compensation import stack_compensation

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

    def decode(
        self,
        q: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        starts: torch.Tensor,
        compensation: list[Compensation | None],
        scale: float,
    ) -> torch.Tensor:
        """Attention of one query per row, q [R, H_q, D], over each head's live suffix
        ``[starts[r, h], seq_lens[r])`` plus the row's compensation token (eq. 5), all rows in one
        batched fp32 computation -> out [R, H_q, D]."""
        rows, hq, d = q.shape
        hk = starts.shape[1]
        group = hq // hk
        seq = seq_lens.long()
        lo = starts.min(dim=1).values.long()  # [R]
        width = max(int((seq - lo).max()), 1)
        slots = lo.unsqueeze(1) + torch.arange(width)  # [R, S]
        live = (slots.unsqueeze(1) >= starts.unsqueeze(2)) & (slots < seq.unsqueeze(1)).unsqueeze(1)  # [R, H, S]
        slots = torch.minimum(slots, (seq - 1).unsqueeze(1))
        blocks = block_tables.long().gather(1, slots // self.block_size)
        offs = slots % self.block_size
        keys = self.keys_t[blocks, :, :, offs].float()  # [R, S, H, D]
        values = self.values[blocks, :, offs, :].float()
        qg = q.float().view(rows, hk, group, d)
        logits = torch.einsum("rkgd,rskd->rkgs", qg, keys) * scale
        logits.masked_fill_(~live.unsqueeze(2), float("-inf"))
        comp = stack_compensation(compensation, hk, d)
        if comp is None:
            probs = torch.softmax(logits, dim=-1)
            return torch.einsum("rkgs,rskd->rkgd", probs, values).reshape(rows, hq, d)
        k_hat, v_hat, counts = comp
        extra = torch.einsum("rkgd,rkd->rkg", qg, k_hat) * scale + counts.log().unsqueeze(2)  # log 0 = -inf: off
        probs = torch.softmax(torch.cat([logits, extra.unsqueeze(3)], dim=3), dim=-1)
        out = torch.einsum("rkgs,rskd->rkgd", probs[..., :-1], values) + probs[..., -1:] * v_hat.unsqueeze(2)
        return out.reshape(rows, hq, d)
