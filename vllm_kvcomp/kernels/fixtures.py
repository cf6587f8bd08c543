"""Random paged KV caches for the kernel tests and the kernel benchmark.

Cache layout: one layer's cache is a logical ``[num_blocks, block_size, H_kv, 2D]`` view (K in
``[0, D)``, V in ``[D, 2D)`` of a token-head cell); with ``layout="HNC"`` the storage is vLLM's
LBHNC ``[num_blocks, H_kv, block_size, 2D]`` and the view is its transpose. Logical token i of
request r lives in block ``block_table[r, i // bs]`` at offset ``i % bs``. Every request owns a
random permutation of the blocks, so a kernel that assumes contiguous blocks fails.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

NULL_BLOCK = 0  # never handed to a request; filled with NaN so a stray read shows


@dataclass
class Paged:
    """A paged KV cache of one layer plus the requests living in it."""

    cache: torch.Tensor  # [num_blocks, block_size, H_kv, 2D] logical view
    block_table: torch.Tensor  # [B, max_blocks] int32, padded with NULL_BLOCK
    seq_lens: torch.Tensor  # [B] int32

    @property
    def batch(self) -> int:
        return self.block_table.shape[0]

    @property
    def block_size(self) -> int:
        return self.cache.shape[1]

    @property
    def num_heads(self) -> int:
        return self.cache.shape[2]

    @property
    def head_dim(self) -> int:
        return self.cache.shape[3] // 2

    def cpu(self) -> Paged:
        return Paged(self.cache.cpu(), self.block_table.cpu(), self.seq_lens.cpu())

    def cells(self, b: int) -> torch.Tensor:
        """[H_kv, N_b, 2D] copy of request b's cells, read token by token."""
        n = int(self.seq_lens[b])
        out = []
        for i in range(n):
            block = int(self.block_table[b, i // self.block_size])
            out.append(self.cache[block, i % self.block_size])  # [H_kv, 2D]
        if not out:
            return self.cache.new_empty(self.num_heads, 0, self.cache.shape[3])
        return torch.stack(out, dim=1)

    def kv(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [H_kv, N_b, D] of request b."""
        cells = self.cells(b)
        return cells[..., : self.head_dim], cells[..., self.head_dim :]


def make_paged(
    seq_lens: list[int],
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: str | torch.device = "cpu",
    layout: str = "NHC",
    spare_blocks: int = 2,
    seed: int = 0,
    poison: bool = True,
) -> Paged:
    """Random cache whose requests own a random permutation of the blocks (never contiguous).

    With ``poison`` every slot no request owns (null block, spare blocks, tails of last blocks)
    holds NaN, so a kernel reading past a range shows it. Values are drawn on ``device``.
    """
    gen = torch.Generator().manual_seed(seed)
    need = [math.ceil(n / block_size) for n in seq_lens]
    owned = sum(need)
    num_blocks = 1 + owned + spare_blocks
    cell = 2 * head_dim
    shape = (
        (num_blocks, block_size, num_kv_heads, cell)
        if layout == "NHC"
        else (num_blocks, num_kv_heads, block_size, cell)
    )
    if layout not in ("NHC", "HNC"):
        raise ValueError(f"layout must be NHC or HNC, got {layout!r}")
    storage = torch.full(shape, math.nan if poison else 0.0, dtype=dtype, device=device)
    cache = storage if layout == "NHC" else storage.transpose(1, 2)
    perm = torch.randperm(num_blocks - 1, generator=gen) + 1
    blocks = perm[:owned].to(device)
    dev_gen = torch.Generator(device=device).manual_seed(seed)
    cache[blocks] = torch.randn(
        owned, block_size, num_kv_heads, cell, generator=dev_gen, device=device
    ).to(dtype)
    table = torch.full((len(seq_lens), max(need, default=0) + 1), NULL_BLOCK, dtype=torch.int32)
    first = 0
    for b, (n, nb) in enumerate(zip(seq_lens, need)):
        table[b, :nb] = perm[first : first + nb].to(torch.int32)
        first += nb
        if poison and nb and n % block_size:
            cache[int(table[b, nb - 1]), n % block_size :] = math.nan
    return Paged(cache, table.to(device), torch.tensor(seq_lens, dtype=torch.int32, device=device))


def random_starts(
    seq_lens: list[int], num_kv_heads: int, seed: int = 1, min_len: int = 1
) -> torch.Tensor:
    """[B, H_kv] int32 ragged per-head starts: head h of request b holds slots [start, N_b)."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for n in seq_lens:
        hi = max(n - min_len, 0)
        rows.append(torch.randint(0, hi + 1, (num_kv_heads,), generator=gen))
    return torch.stack(rows).to(torch.int32)
