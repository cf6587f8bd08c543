"""Plain-PyTorch references for the kernels behind ``vllm_kvcomp.ops``, and the paged fixture.

Shared by ``tests/kernels`` and ``benchmarks/bench_kernels.py``. Every reference loops over
requests and heads, reads the paged cache token by token through the block table and then calls
the policy-side math (``policies.base``, ``policies.compensation``, ``policies.lagkv``) or a
direct formula, so it is slow but obviously right.

Cache layout: one layer's cache is a logical ``[num_blocks, block_size, H_kv, 2D]`` view (K in
``[0, D)``, V in ``[D, 2D)`` of a token-head cell); with ``layout="HNC"`` the storage is vLLM's
LBHNC ``[num_blocks, H_kv, block_size, 2D]`` and the view is its transpose. Logical token i of
request r lives in block ``block_table[r, i // bs]`` at offset ``i % bs``.

Numerics: :func:`assert_close_to_ref` sets the tolerance from PyTorch's own error: the
reference run in the test dtype against the same reference in float64.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from vllm_kvcomp.policies.base import LayerKV, entropy, window_attention
from vllm_kvcomp.policies.compensation import attention_with_lse, compensation_lse, merge_partials
from vllm_kvcomp.policies.lagkv import RANGE_EPS, lagkv_scores

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


def random_selection(
    seq_lens: list[int], starts: torch.Tensor, keep: float, seed: int = 2
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sorted kept slots per head from its valid range: kept [B, H_kv, K_max] int32, counts [B, H_kv]."""
    gen = torch.Generator().manual_seed(seed)
    batch, heads = starts.shape
    chosen = []
    for b in range(batch):
        for h in range(heads):
            lo, n = int(starts[b, h]), seq_lens[b]
            count = min(n - lo, max(1, round(keep * (n - lo)))) if n > lo else 0
            pick = torch.randperm(n - lo, generator=gen)[:count] + lo
            chosen.append(torch.sort(pick).values)
    k_max = max((len(c) for c in chosen), default=0)
    kept = torch.zeros(batch * heads, max(k_max, 1), dtype=torch.int32)
    for i, c in enumerate(chosen):
        kept[i, : len(c)] = c.to(torch.int32)
    counts = torch.tensor([len(c) for c in chosen], dtype=torch.int32).view(batch, heads)
    return kept.view(batch, heads, -1), counts


# ---------------------------------------------------------------------------- references


def ref_compact(paged: Paged, kept: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """The cache after writing head h's kept cells to slots [N - count, N); other slots unchanged."""
    out = paged.cache.clone()
    bs = paged.block_size
    for b in range(paged.batch):
        n = int(paged.seq_lens[b])
        cells = paged.cells(b)  # read everything before writing: overlap cannot matter
        for h in range(paged.num_heads):
            count = int(counts[b, h])
            for j in range(count):
                dst = n - count + j
                block = int(paged.block_table[b, dst // bs])
                out[block, dst % bs, h] = cells[h, int(kept[b, h, j])]
    return out


def ref_decode(
    q: torch.Tensor,
    paged: Paged,
    starts: torch.Tensor | None,
    scale: float,
    compensation: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode attention of q [B, H_q, D] over each head's slots [start, N) (+ compensation).

    compensation = (k_hat [B, H_kv, D], v_hat [B, H_kv, D], counts [B, H_kv] float; 0 = off).
    Runs :mod:`vllm_kvcomp.policies.compensation` on inputs cast to ``dtype`` (float64 = exact).
    Returns out [B, H_q, D] (``dtype``) and lse [B, H_q] (natural log, -inf when empty).
    """
    batch, hq, d = q.shape
    hk = paged.num_heads
    group = hq // hk
    out = torch.empty(batch, hq, d, dtype=dtype)
    lse = torch.empty(batch, hq, dtype=torch.float64 if dtype == torch.float64 else torch.float32)
    for b in range(batch):
        keys, values = paged.kv(b)
        n = keys.shape[1]
        for h in range(hk):
            lo = 0 if starts is None else int(starts[b, h])
            qh = q[b, h * group : (h + 1) * group].to(dtype).unsqueeze(0)  # [1, G, D]
            k = keys[h, lo:n].to(dtype).unsqueeze(1).expand(-1, group, -1)  # [S, G, D]
            v = values[h, lo:n].to(dtype).unsqueeze(1).expand(-1, group, -1)
            o, l_ = attention_with_lse(qh, k, v, scale)
            if compensation is not None:
                k_hat, v_hat, cnt = compensation
                kh = k_hat[b, h].to(dtype).expand(group, -1)
                c_lse = compensation_lse(qh, kh, cnt[b, h].expand(group).to(dtype), scale)
                c_out = v_hat[b, h].to(dtype).expand(1, group, -1)
                o, l_ = merge_partials(o, l_, c_out.to(o.dtype), c_lse.to(l_.dtype))
            out[b, h * group : (h + 1) * group] = o[0].to(dtype)
            lse[b, h * group : (h + 1) * group] = l_[0].to(lse.dtype)
    return out, lse


def ref_window(
    q: torch.Tensor, paged: Paged, starts: torch.Tensor | None, scale: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Window attention scores of q [B, w, H_q, D] (the last w tokens of each request).

    Query j of request b sits at slot N_b - w + j and sees slots [start, N_b - w + j]. Returns
    scores [B, H_kv, N_max] = softmax probabilities summed over the window and the query group,
    and entropy [B, H_q, w] (nats) of each query's distribution, both computed in ``dtype``.
    """
    batch, w, hq, _ = q.shape
    hk = paged.num_heads
    group = hq // hk
    n_max = int(paged.seq_lens.max()) if batch else 0
    scores = torch.zeros(batch, hk, n_max, dtype=dtype)
    ent = torch.zeros(batch, hq, w, dtype=dtype)
    for b in range(batch):
        keys, _ = paged.kv(b)
        n = keys.shape[1]
        qb = q[b].transpose(0, 1).to(dtype)  # [H_q, w, D]
        logits = (
            torch.einsum("hwd,hnd->hwn", qb, keys.to(dtype).repeat_interleave(group, 0)) * scale
        )
        slot = torch.arange(n)
        lo = torch.zeros(hk, dtype=torch.long) if starts is None else starts[b].long()
        visible = (slot >= lo.repeat_interleave(group).view(-1, 1, 1)) & (
            slot.view(1, 1, -1) <= (n - w + torch.arange(w)).view(1, -1, 1)
        )
        probs = torch.softmax(logits.masked_fill(~visible, -math.inf), dim=-1).nan_to_num(0.0)
        scores[b, :, :n] = probs.sum(1).view(hk, group, n).sum(1)
        ent[b] = entropy(probs)
    return scores, ent


def policy_window(
    q: torch.Tensor, paged: Paged, starts: torch.Tensor | None, b: int, scale: float
) -> torch.Tensor:
    """Request b's per-query-head probabilities [H_q, w, N] from ``policies.base.window_attention``."""
    keys, values = paged.kv(b)
    n = keys.shape[1]
    lengths = None if starts is None else (n - starts[b].long())
    kv = LayerKV(keys, values, lengths=lengths, queries=q[b].transpose(0, 1), scale=scale)
    return window_attention(kv)


def lagkv_partition(part_k, part_v, ref_k, ref_v, dtype: torch.dtype) -> torch.Tensor:
    """LagKV eq. 5–9 on [H, L, D] tensors computed in ``dtype``; the policy's conventions:
    unbiased std over channels, reference range clamped to ``RANGE_EPS``."""

    def term(part: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
        part, ref = part.to(dtype), ref.to(dtype)
        low, high = ref.amin(dim=-2, keepdim=True), ref.amax(dim=-2, keepdim=True)
        normed = (part - low) / (high - low).clamp_min(RANGE_EPS)
        return normed.std(dim=-1, correction=1).softmax(dim=-1)

    return term(part_k, ref_k) + term(part_v, ref_v)


def ref_lagkv(
    paged: Paged, starts: torch.Tensor, num_parts: torch.Tensor, lag: int, dtype: torch.dtype | None
) -> torch.Tensor:
    """LagKV scores [B, H_kv, P_max, lag] of partitions p < num_parts[b] of each head.

    Partition p of head h covers slots ``start[b, h] + p·lag + [0, lag)``, its reference the next
    ``lag`` slots. ``dtype=None`` calls the policy's own ``lagkv_scores`` (float32); a dtype runs
    :func:`lagkv_partition` in it. Entries of missing partitions are 0.
    """
    p_max = int(num_parts.max()) if paged.batch else 0
    out = torch.zeros(paged.batch, paged.num_heads, p_max, lag, dtype=dtype or torch.float32)
    for b in range(paged.batch):
        keys, values = paged.kv(b)
        for h in range(paged.num_heads):
            for p in range(int(num_parts[b])):
                lo = int(starts[b, h]) + p * lag
                sl, rl = slice(lo, lo + lag), slice(lo + lag, lo + 2 * lag)
                args = (
                    keys[h : h + 1, sl],
                    values[h : h + 1, sl],
                    keys[h : h + 1, rl],
                    values[h : h + 1, rl],
                )
                s = lagkv_scores(*args) if dtype is None else lagkv_partition(*args, dtype)
                out[b, h, p] = s[0]
    return out


# ---------------------------------------------------------------------------- tolerance


def max_abs_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Max |a - b| over finite-and-equal-aware entries (matching infinities count as 0)."""
    diff = (a.double() - b.double()).abs()
    same = a.double() == b.double()  # handles equal infinities
    return (
        float(torch.where(same, torch.zeros_like(diff), diff).nan_to_num(0.0).max())
        if diff.numel()
        else 0.0
    )


def assert_close_to_ref(
    actual: torch.Tensor,
    ref64: torch.Tensor,
    ref_lp: torch.Tensor,
    factor: float = 4.0,
    what: str = "",
) -> None:
    """``actual`` within ``factor`` × (PyTorch's own error ``|ref_lp - ref64|``) of ``ref64``.

    An absolute floor of one ulp of ``actual``'s dtype at the reference's magnitude covers
    references that happen to be exact.
    """
    lp_err = max_abs_err(ref_lp, ref64)
    finite = ref64[torch.isfinite(ref64)]
    magnitude = float(finite.abs().max()) if finite.numel() else 1.0
    dtype = actual.dtype if actual.dtype.is_floating_point else torch.float32
    atol = factor * lp_err + torch.finfo(dtype).eps * max(magnitude, 1.0)
    torch.testing.assert_close(
        actual.double().cpu(),
        ref64.double().cpu(),
        atol=atol,
        rtol=0.0,
        equal_nan=True,
        msg=lambda m: (
            f"{what}: {m}\n(PyTorch's own {ref_lp.dtype} error {lp_err:.3g}, atol {atol:.3g})"
        ),
    )
