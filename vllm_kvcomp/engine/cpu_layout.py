"""Read and write tokens of vLLM's CPU paged KV cache (``vec`` ISA layout).

Per layer the cache is ``[num_blocks, H_kv, block_size, 2*D]``. On the ``vec`` ISA each
(block, head) cell stores K transposed, ``K^T[D, bs]``, followed by V as ``[bs, D]``
(verified against ``cpu_attn_reshape_and_cache`` by tests/engine/test_cpu_layout.py).
Other ISAs (amx, vec16, neon) pack differently and are refused.

Logical slot ``i`` of a request lives in block ``block_ids[i // bs]`` at offset ``i % bs``.
"""

from __future__ import annotations

import torch

from vllm_kvcomp.engine.paged import PagedKV, Tensors
from vllm_kvcomp.policies.base import Compensation
from vllm_kvcomp.policies.compensation import stack_compensation

SUPPORTED_ISAS = ("vec",)


class CpuPagedKV(PagedKV):
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

    def read(self, block_table: torch.Tensor, slots: torch.Tensor) -> Tensors:
        if slots.numel() > 1 and int(slots[-1]) - int(slots[0]) + 1 == slots.numel():  # a range: whole blocks
            lo, bs = int(slots[0]), self.block_size
            blocks = block_table[lo // bs : int(slots[-1]) // bs + 1].long()
            keys = self.keys_t[blocks].permute(0, 3, 1, 2).flatten(0, 1)  # [C*bs, H, D]
            values = self.values[blocks].transpose(1, 2).flatten(0, 1)
            cut = slice(lo % bs, lo % bs + slots.numel())
            return keys[cut], values[cut]
        blocks, offs = self._locate(block_table, slots)
        keys = self.keys_t[blocks, :, :, offs]  # advanced indices first: [S, H, D]
        values = self.values[blocks, :, offs, :]
        return keys, values

    def read_head(self, block_table: torch.Tensor, head: int, slots: torch.Tensor) -> Tensors:
        blocks, offs = self._locate(block_table, slots)
        return self.keys_t[blocks, head, :, offs], self.values[blocks, head, offs, :]

    def write_head(self, block_table: torch.Tensor, head: int, slots: torch.Tensor, keys: torch.Tensor,
                   values: torch.Tensor) -> None:
        blocks, offs = self._locate(block_table, slots)
        self.keys_t[blocks, head, :, offs] = keys.to(self.keys_t.dtype)
        self.values[blocks, head, offs, :] = values.to(self.values.dtype)

    def decode(self, q: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor, starts: torch.Tensor,
               compensation: list[Compensation | None], scale: float) -> torch.Tensor:
        """All rows in one batched fp32 torch computation over whole gathered blocks."""
        rows, hq, d = q.shape
        hk, bs = starts.shape[1], self.block_size
        group = hq // hk
        seq = seq_lens.long()
        first = starts.min(dim=1).values.long() // bs  # [R] first table column with a live slot
        last = (seq - 1) // bs
        width = int((last - first).max()) + 1
        cols = first.unsqueeze(1) + torch.arange(width)  # [R, C]
        blocks = block_tables.long().gather(1, torch.minimum(cols, last.unsqueeze(1)))
        slots = cols.view(rows, width, 1, 1, 1) * bs + torch.arange(bs)  # [R, C, 1, 1, bs]
        live = (slots >= starts.view(rows, 1, hk, 1, 1)) & (slots < seq.view(rows, 1, 1, 1, 1))  # [R, C, H, 1, bs]
        qg = q.float().view(rows, 1, hk, group, d)
        # whole blocks, multiplied in the cache's own per-block layout (K^T [D, bs], V [bs, D]): no re-layout
        logits = torch.matmul(qg, self.keys_t[blocks].float()) * scale  # [R, C, H, G, bs]
        logits = logits.masked_fill(~live, float("-inf")).permute(0, 2, 3, 1, 4).reshape(rows, hk, group, -1)
        comp = stack_compensation(compensation, hk, d)
        if comp is not None:
            k_hat, v_hat, counts = comp
            extra = torch.einsum("rkgd,rkd->rkg", qg.squeeze(1), k_hat) * scale + counts.log().unsqueeze(2)  # log 0: off
            logits = torch.cat([logits, extra.unsqueeze(3)], dim=3)
        probs = torch.softmax(logits, dim=-1)
        span = probs[..., : width * bs].reshape(rows, hk, group, width, bs).permute(0, 3, 1, 2, 4)  # [R, C, H, G, bs]
        values = self.values[blocks].float()  # [R, C, H, bs, D]
        # slots past a row's end (its last block's tail, padding columns) were never written for it:
        # zero them in the copy so that a zero weight cannot meet a NaN; only trailing columns have any
        tail = int((last - first).min())
        past_end = (slots[:, tail:] >= seq.view(rows, 1, 1, 1, 1)).transpose(-1, -2)  # [R, C', 1, bs, 1]
        values[:, tail:].masked_fill_(past_end, 0.0)
        out = torch.matmul(span, values).sum(dim=1)  # [R, H, G, D]
        if comp is not None:
            out = out + probs[..., -1:] * v_hat.unsqueeze(2)
        return out.reshape(rows, hq, d)
