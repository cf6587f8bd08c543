"""The KV buffer of one KV-cache group seen as pages, per platform: read, write, attend.

vLLM gives every layer a view ``[num_blocks, H_kv, block_size, 2*D]`` of one buffer (layout
LBHNC: a (layer, block, head) page is ``block_size`` contiguous cells). :class:`PagedCache` checks
that, numbers the pages (:class:`~vllm_kvcomp.engine.pages.PageGeometry`) and moves or attends
over cells by (page, offset). Attention runs over *virtual sequences* — one per (request, KV
head): a page table, a length, and the G query heads of that KV head as its queries — so a
kernel sees ``num_kv_heads = 1``:

- :class:`CpuPagedCache`: vLLM's own CPU kernel (``vec`` ISA: a page stores ``K^T [D, bs]``
  then ``V [bs, D]``), one call per layer for all compressed rows.
- :class:`CudaPagedCache`: ``kernels.decode_attention`` (CUDA extension or Triton; the torch
  reference on CPU tensors), a page stores ``[bs, 2D]`` cells.

RazorAttention's compensation token (eq. 5) is merged by log-sum-exp. vLLM's CPU kernel returns
no LSE, so for the sequences that carry a compensation token the CPU class computes the LSE of
their kept keys in torch (batched over those sequences only) and merges; the CUDA kernels take
the token natively. Both are tested against the one reference
(``kernels.reference.decode_attention_reference``) in float64.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod

import torch

from vllm_kvcomp import vllm_compat
from vllm_kvcomp.engine.pages import Move, PageGeometry
from vllm_kvcomp.policies.compensation import merge_partials

Tensors = tuple[torch.Tensor, torch.Tensor]
#: per virtual sequence: k_hat [S, D], v_hat [S, D], counts [S] float (0 = no token)
SequenceCompensation = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
FLOAT_CACHE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class PagedCache(ABC):
    """All layers' caches of one KV-cache group as one buffer of pages."""

    def __init__(self, caches: list[torch.Tensor]):
        if not caches:
            raise ValueError("no KV caches to page")
        num_blocks, heads, block_size, width = caches[0].shape
        self.head_dim = width // 2
        self.page_elems = block_size * width
        first = []
        for layer, cache in enumerate(caches):
            contiguous_pages = cache.stride()[:2] == (heads * self.page_elems, self.page_elems)
            if cache.shape != caches[0].shape or not contiguous_pages or cache.stride(-1) != 1:
                raise NotImplementedError(
                    f"layer {layer}: KV cache {tuple(cache.shape)} with strides {cache.stride()} is not laid out "
                    "as LBHNC pages ([num_blocks, H, block_size, 2D], one page per (block, head))"
                )
            if cache.untyped_storage().data_ptr() != caches[0].untyped_storage().data_ptr():
                raise NotImplementedError("vllm-kvcomp needs every layer's KV cache in one buffer")
            if cache.storage_offset() % self.page_elems:
                raise NotImplementedError(f"layer {layer}: KV cache does not start on a page boundary")
            first.append(cache.storage_offset() // self.page_elems)
        self.geometry = PageGeometry(len(caches), heads, block_size, torch.tensor(first, dtype=torch.long))
        self.num_pages = max(first) + num_blocks * heads
        self.dtype = caches[0].dtype
        self.device = caches[0].device
        self.pages = torch.as_strided(caches[0], (self.num_pages, self.page_elems), (self.page_elems, 1), 0)
        self._scratch: dict[str, torch.Tensor] = {}

    @abstractmethod
    def read_cells(self, pages: torch.Tensor, offsets: torch.Tensor) -> Tensors:
        """Keys, values [n, D] (copies) of the cells at (``pages``, ``offsets``) [n]."""

    @abstractmethod
    def read_pages(self, pages: torch.Tensor) -> Tensors:
        """Keys, values [..., n * bs, D] of whole ``pages`` [..., n], cells in page order: copies
        in buffers this cache reuses, valid until its next ``read_pages``."""

    def scratch(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """A reused buffer of ``shape`` (grown when too small; fresh allocations of the size of
        a whole request's cache cost more in page faults than the copy itself)."""
        size = math.prod(shape)
        buf = self._scratch.get(name)
        if buf is None or buf.numel() < size:
            buf = self._scratch[name] = torch.empty(size, dtype=self.dtype, device=self.device)
        return buf[:size].view(shape)

    @abstractmethod
    def write_cells(self, pages: torch.Tensor, offsets: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Write keys/values [n, D] to the cells at (``pages``, ``offsets``) [n]."""

    def move(self, move: Move) -> None:
        """Copy cells; every source is read before any destination is written."""
        if len(move):
            keys, values = self.read_cells(move.src_pages.to(self.device), move.src_offsets.to(self.device))
            self.write_cells(move.dst_pages.to(self.device), move.dst_offsets.to(self.device), keys, values)

    @abstractmethod
    def attend(self, q: torch.Tensor, tables: torch.Tensor, lengths: torch.Tensor, query_start: torch.Tensor,
               scale: float, compensation: SequenceCompensation | None) -> torch.Tensor:
        """Causal attention of virtual sequences: q [T, G, D] (sequence s owns query rows
        ``query_start[s]:query_start[s + 1]``, the last tokens of its ``lengths[s]``), tables
        [S, W] page ids -> out [T, G, D] in q's dtype."""


class CpuPagedCache(PagedCache):
    """vLLM's CPU cache, ``vec`` ISA: per page ``K^T [D, bs]`` then ``V [bs, D]``."""

    SUPPORTED_ISAS = ("vec",)

    def __init__(self, caches: list[torch.Tensor], isa: str = "vec"):
        if isa not in self.SUPPORTED_ISAS:
            raise NotImplementedError(
                f"vllm-kvcomp's CPU path supports the {self.SUPPORTED_ISAS} attention ISA, got {isa!r} "
                "(use float32/float16 with head_size a multiple of 32 on x86 without AMX)"
            )
        super().__init__(caches)
        self.isa = isa
        bs, d = self.geometry.block_size, self.head_dim
        halves = self.pages.view(self.num_pages, 2, bs * d)
        self.keys_t = halves[:, 0].view(self.num_pages, d, bs)
        self.values = halves[:, 1].view(self.num_pages, bs, d)
        # the kernel's own view of a cache (as CPU_ATTN builds it), with one head per "block"
        self.kernel_keys, self.kernel_values = self.pages.view(self.num_pages, 1, 2 * bs, d).chunk(2, dim=2)

    def read_cells(self, pages: torch.Tensor, offsets: torch.Tensor) -> Tensors:
        return self.keys_t[pages, :, offsets], self.values[pages, offsets]

    def read_pages(self, pages: torch.Tensor) -> Tensors:
        bs, d, flat = self.geometry.block_size, self.head_dim, pages.reshape(-1)
        gathered = torch.index_select(self.keys_t, 0, flat, out=self.scratch("keys_t", (flat.numel(), d, bs)))
        keys = self.scratch("keys", (*pages.shape, bs, d))
        keys.copy_(gathered.view(*pages.shape, d, bs).transpose(-1, -2))
        values = self.scratch("values", (*pages.shape, bs, d))
        torch.index_select(self.values, 0, flat, out=values.view(flat.numel(), bs, d))
        return keys.flatten(-3, -2), values.flatten(-3, -2)

    def write_cells(self, pages: torch.Tensor, offsets: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.keys_t[pages, :, offsets] = keys.to(self.dtype)
        self.values[pages, offsets] = values.to(self.dtype)

    def attend(self, q: torch.Tensor, tables: torch.Tensor, lengths: torch.Tensor, query_start: torch.Tensor,
               scale: float, compensation: SequenceCompensation | None) -> torch.Tensor:
        q = q.contiguous()
        seq_lens, starts, table = lengths.to(torch.int32), query_start.to(torch.int32), tables.to(torch.int32)
        schedule = vllm_compat.cpu_attention_schedule(
            num_reqs=table.shape[0], num_heads=q.shape[1], num_kv_heads=1, head_dim=self.head_dim,
            seq_lens=seq_lens, dtype=q.dtype, query_start_loc=starts, causal=True, sliding_window_size=-1,
            isa=self.isa, dynamic_causal=None, kv_cache_dtype="auto",
        )
        out = torch.empty_like(q)
        vllm_compat.cpu_paged_attention(
            query=q, key_cache=self.kernel_keys, value_cache=self.kernel_values, output=out, query_start_loc=starts,
            seq_lens=seq_lens, scale=scale, causal=True, alibi_slopes=None, sliding_window=-1, block_table=table,
            softcap=0.0, scheduler_metadata=schedule, s_aux=None,
        )
        if compensation is not None:
            self._compensate(out, q, tables, lengths, query_start, scale, compensation)
        return out

    def _compensate(self, out: torch.Tensor, q: torch.Tensor, tables: torch.Tensor, lengths: torch.Tensor,
                    query_start: torch.Tensor, scale: float, compensation: SequenceCompensation) -> None:
        """Merge the compensation token into ``out`` (in place) for the sequences that have one:
        the LSE of their kept keys is recomputed in torch from their own pages only, batched over
        the sequences with the same number of query rows."""
        k_hat, v_hat, counts = compensation
        seqs = torch.nonzero(counts > 0).flatten()
        if seqs.numel() == 0:
            return
        bs = self.geometry.block_size
        for s, group in _by_query_count(seqs, query_start):
            width = int((lengths[s].max() + bs - 1) // bs)  # these sequences' own pages, not the batch's
            rows = query_start[s].unsqueeze(1) + torch.arange(group)  # [C, T]
            qs = q[rows].float()  # [C, T, G, D]
            keys = self.keys_t[tables[s, :width]].float()  # [C, W, D, bs]
            logits = torch.matmul(qs.unsqueeze(1), keys.unsqueeze(2)).permute(0, 2, 3, 1, 4).flatten(-2)
            limit = lengths[s].view(-1, 1) - group + torch.arange(group) + 1  # causal: [C, T]
            visible = torch.arange(width * bs).view(1, 1, -1) < limit.unsqueeze(-1)
            lse = (logits * scale).masked_fill_(~visible.unsqueeze(2), float("-inf")).logsumexp(-1)  # [C, T, G]
            comp_lse = torch.einsum("ctgd,cd->ctg", qs, k_hat[s].float()) * scale + counts[s].float().log().view(-1, 1, 1)
            comp_out = v_hat[s].float().view(-1, 1, 1, self.head_dim).expand_as(qs)
            merged, _ = merge_partials(out[rows].float().flatten(0, 1), lse.flatten(0, 1),
                                       comp_out.flatten(0, 1), comp_lse.flatten(0, 1))
            out[rows] = merged.view_as(qs).to(out.dtype)


class CudaPagedCache(PagedCache):
    """vLLM's FlashAttention / Triton cache in layout LBHNC: per page ``[bs, 2D]`` cells."""

    def __init__(self, caches: list[torch.Tensor]):
        if caches and caches[0].dtype not in FLOAT_CACHE_DTYPES:
            raise NotImplementedError(
                f"vllm-kvcomp needs an unquantized KV cache ({', '.join(map(str, FLOAT_CACHE_DTYPES))}), got "
                f"{caches[0].dtype}: start vLLM with --kv-cache-dtype auto"
            )
        super().__init__(caches)
        bs, d = self.geometry.block_size, self.head_dim
        self.cells = self.pages.view(self.num_pages, bs, 1, 2 * d)  # kernels' [blocks, bs, H_kv=1, 2D]

    def read_cells(self, pages: torch.Tensor, offsets: torch.Tensor) -> Tensors:
        cells = self.cells[pages, offsets, 0]
        return cells[:, : self.head_dim], cells[:, self.head_dim :]

    def read_pages(self, pages: torch.Tensor) -> Tensors:
        flat = pages.reshape(-1)
        cells = self.scratch("cells", (flat.numel(), *self.cells.shape[1:]))
        torch.index_select(self.cells, 0, flat, out=cells)
        cells = cells.view(*pages.shape, -1, 2 * self.head_dim).flatten(-3, -2)  # [..., n * bs, 2D]
        return cells[..., : self.head_dim], cells[..., self.head_dim :]

    def write_cells(self, pages: torch.Tensor, offsets: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.cells[pages, offsets, 0] = torch.cat([keys, values], dim=-1).to(self.dtype)

    def attend(self, q: torch.Tensor, tables: torch.Tensor, lengths: torch.Tensor, query_start: torch.Tensor,
               scale: float, compensation: SequenceCompensation | None) -> torch.Tensor:
        """One ``decode_attention`` launch: a sequence with T queries becomes T one-query
        sequences whose lengths end at each query's causal limit."""
        from vllm_kvcomp import kernels

        counts = query_start[1:] - query_start[:-1]
        seq = torch.repeat_interleave(torch.arange(counts.numel(), device=counts.device), counts)  # [T]
        back = (query_start[1:] - 1)[seq] - torch.arange(seq.numel(), device=seq.device)  # tokens after each query
        comp = None
        if compensation is not None:
            k_hat, v_hat, weight = compensation
            comp = (k_hat[seq].unsqueeze(1), v_hat[seq].unsqueeze(1), weight[seq].unsqueeze(1))
        out, _ = kernels.decode_attention(q, self.cells, tables[seq], lengths[seq] - back, compensation=comp,
                                          scale=scale)
        return out


def _by_query_count(seqs: torch.Tensor, query_start: torch.Tensor):
    """(sequences, T) groups of ``seqs`` that have the same number T of query rows."""
    counts = (query_start[seqs + 1] - query_start[seqs]).tolist()
    for t in sorted(set(counts)):
        yield seqs[torch.tensor([c == t for c in counts])], t
