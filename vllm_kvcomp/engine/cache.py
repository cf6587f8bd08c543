"""The KV buffer of one KV-cache group seen as pages, per platform: read, write, attend.

vLLM gives every layer a view ``[num_blocks, H_kv, block_size, 2*D]`` of one buffer (layout
LBHNC: a (layer, block, head) page is ``block_size`` contiguous cells). :class:`PagedCache` checks
that, numbers the pages (:class:`~vllm_kvcomp.engine.pages.PageGeometry`) and moves or attends
over cells by (page, offset). Attention runs over *virtual sequences* — one per (request, KV
head): a page table, a length, and the G query heads of that KV head as its queries — so a
kernel sees ``num_kv_heads = 1``:

- :class:`CpuPagedCache`: vLLM's CPU ``vec`` page (``K^T [D, bs]`` then ``V [bs, D]``), one call
  per layer for all compressed rows: kvcomp's C kernel (``kernels.cpu_native``) for decode rows,
  vLLM's own CPU kernel for the many rows of a prefill chunk.
- :class:`CudaPagedCache`: ``kernels.decode_attention`` for decode rows and
  ``kernels.prefill_attention`` for the many rows of a prefill chunk or drafts, one launch per
  layer either way (Triton; the torch reference on CPU tensors), a page stores ``[bs, 2D]`` cells.

Each layer attends as vLLM's own kernel would for it (:class:`AttentionVariant`: scale, logit
soft-capping, learned sinks). RazorAttention's compensation token (eq. 5) and sinks are merged by
log-sum-exp. kvcomp's C kernel (compiled on first use) does that itself. vLLM's CPU kernel caps
logits but returns no LSE, so where it attends (a prefill chunk, or no C compiler) the sequences
that carry a compensation token (or every sequence of a layer with sinks: the kernel takes one
sink vector for all sequences, ours differ per KV head) attend by the C kernel, or in torch where
it cannot be built (with their LSE, batched; pages read in place by ``embedding_bag`` for decode
rows), and vLLM's kernel skips them; the CUDA kernels take the token and the sinks natively. Both are tested against the one
reference (``kernels.reference.decode_attention_reference``) in float64.
"""

from __future__ import annotations

import functools
import math
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from vllm_kvcomp import vllm_compat
from vllm_kvcomp.engine import memory
from vllm_kvcomp.engine.pages import Move, PageGeometry
from vllm_kvcomp.engine.staging import to_device
from vllm_kvcomp.kernels import cpu_native
from vllm_kvcomp.policies.compensation import soft_cap

Tensors = tuple[torch.Tensor, torch.Tensor | None]  # keys, values (None when not asked for)
FLOAT_CACHE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class AttentionVariant:
    """What one layer's attention computes, as vLLM's kernel for the layer does: the softmax
    ``scale``, logit soft-capping ``softcap`` (Gemma 2: ``cap · tanh(x / cap)``; 0 = off) and
    learned ``sinks`` [H_q] float32 (gpt-oss: one logit per query head with a zero value)."""

    scale: float
    softcap: float = 0.0
    sinks: torch.Tensor | None = None

    def sequence_sinks(self, num_sequences: int, num_kv_heads: int) -> torch.Tensor | None:
        """[S, G] sinks of virtual sequences ordered (row, KV head), or None."""
        if self.sinks is None:
            return None
        return self.sinks.view(num_kv_heads, -1).repeat(num_sequences // num_kv_heads, 1)


@dataclass(frozen=True)
class SequenceCompensation:
    """One layer's compensation tokens per virtual sequence, and where they are.

    ``keys``/``values`` [S, D], ``counts`` [S] float (0 = no token), on the cache's device;
    ``present`` [S] (host) the sequences whose attention needs a log-sum-exp merge (those that
    have a token, or all of them in a layer with sinks), ``query_rows`` their query rows and
    ``lengths`` [S] (host) their lengths. From those, made on first use on the host (only the CPU
    cache merges by groups): :attr:`groups`, as (indices [C], T = their query rows, W = pages of
    the longest), so that attention reads nothing back; :attr:`merged`, their indices (layers
    that merge the same sequences share a kernel schedule)."""

    keys: torch.Tensor
    values: torch.Tensor
    counts: torch.Tensor
    present: torch.Tensor
    query_rows: list[int]
    lengths: torch.Tensor
    block_size: int

    @classmethod
    def schedule(cls, keys: torch.Tensor, values: torch.Tensor, counts: torch.Tensor, present: torch.Tensor,
                 query_rows: list[int], lengths: torch.Tensor, block_size: int) -> list[SequenceCompensation | None]:
        """Every layer's tokens: keys/values [L, S, D] and counts [L, S] on the cache's device,
        ``present`` [L, S] bool (host) whether sequence s of layer l needs a merge, ``query_rows``
        T per sequence, ``lengths`` [L, S] (host) the sequences' lengths. None for a layer where
        no sequence needs a merge."""
        layers = present.any(dim=1).tolist()
        return [cls(keys[layer], values[layer], counts[layer], present[layer], query_rows, lengths[layer], block_size)
                if has else None for layer, has in enumerate(layers)]

    @functools.cached_property
    def _by_rows(self) -> list[tuple[int, list[int]]]:
        """(T, the merging sequences with T query rows), by T."""
        by_rows: dict[int, list[int]] = {}
        for s, (t, p) in enumerate(zip(self.query_rows, self.present.tolist(), strict=True)):
            if p:
                by_rows.setdefault(t, []).append(s)
        return sorted(by_rows.items())

    @functools.cached_property
    def groups(self) -> tuple[tuple[torch.Tensor, int, int], ...]:
        pages = ((self.lengths + self.block_size - 1) // self.block_size).tolist()
        return tuple((torch.tensor(seqs), t, max(pages[s] for s in seqs)) for t, seqs in self._by_rows)

    @functools.cached_property
    def merged(self) -> tuple[int, ...]:
        return tuple(s for _, seqs in self._by_rows for s in seqs)


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
        self._scratch: dict[tuple[int, str], torch.Tensor] = {}

    @abstractmethod
    def read_cells(self, pages: torch.Tensor, offsets: torch.Tensor, values: bool = True) -> Tensors:
        """Keys, values [n, D] (copies) of the cells at (``pages``, ``offsets``) [n]; values None
        unless ``values``."""

    @abstractmethod
    def read_pages(self, pages: torch.Tensor, values: bool = True) -> Tensors:
        """Keys, values [..., n * bs, D] of whole ``pages`` [..., n], cells in page order: fresh
        copies (a decision reads one layer's at a time, :class:`LayerReader`); values None unless
        ``values``."""

    def scratch(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """A reused buffer of ``shape`` (grown when too small; fresh allocations of the size of
        a whole request's cache cost more in page faults than the copy itself), one per thread: a
        compression decided off the step reads pages while the step attends and moves."""
        size, key = math.prod(shape), (threading.get_ident(), name)
        buf = self._scratch.get(key)
        if buf is None or buf.numel() < size:
            buf = self._scratch[key] = torch.empty(size, dtype=self.dtype, device=self.device)
        return buf[:size].view(shape)

    @abstractmethod
    def write_cells(self, pages: torch.Tensor, offsets: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Write keys/values [n, D] to the cells at (``pages``, ``offsets``) [n]."""

    @abstractmethod
    def move(self, move: Move) -> None:
        """Copy cells; every source is read before its cell is written (:meth:`Move.staged`)."""

    #: most cells a packing copies through one buffer (:meth:`move`; a fixed
    #: ``MOVE_CHUNK · 2D`` elements per thread, the cells of moves that must be read first aside)
    MOVE_CHUNK: ClassVar[int] = memory.MOVE_CHUNK

    def observes(self, group: int, query_rows: list[int]) -> bool:
        """Whether :meth:`attend` of sequences with ``query_rows`` rows each (``group`` query heads
        per sequence) can sum their attention (``observe``): none here."""
        return False

    @abstractmethod
    def attend(self, q: torch.Tensor, tables: torch.Tensor, lengths: torch.Tensor, query_start: torch.Tensor,
               variant: AttentionVariant, compensation: SequenceCompensation | None,
               memo: dict[str, object] | None = None, observe: torch.Tensor | None = None,
               query_rows: list[int] | None = None) -> torch.Tensor:
        """Causal attention of virtual sequences: q [T, G, D] (sequence s owns query rows
        ``query_start[s]:query_start[s + 1]``, the last tokens of its ``lengths[s]``; sequences
        ordered (request, KV head)), tables [S, W] page ids -> out [T, G, D] in q's dtype.
        ``memo``: a dict the caller shares between calls with the same lengths and query rows
        (the layers of one step that hold as much): what depends on them alone is made once.
        ``observe`` [S] int64, only where :meth:`observes` says so: addresses of float32 rows
        (0 = none) to which each sequence adds its cells' softmax weights, the mean over its query
        heads (``kernels.cpu_native.merged_attention``). ``query_rows``: each sequence's number of
        query rows on the host (what ``query_start`` says; read from it when not given)."""


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
        self.value_rows = self.pages.view(-1, d)  # [pages * 2bs, D]: a cell's value is row value_row(page, offset)
        self.key_rows = self.pages.view(-1, bs)  # [pages * 2D, bs]: (page p, dim i) of K^T is row 2D·p + i
        # the kernel's own view of a cache (as CPU_ATTN builds it), with one head per "block"
        self.kernel_keys, self.kernel_values = self.pages.view(self.num_pages, 1, 2 * bs, d).chunk(2, dim=2)
        if self.dtype == torch.float32:  # built (or found) now, not in a request's first step
            cpu_native.library()
        self._native_plan: tuple[torch.Tensor, list[tuple[torch.Tensor, int]] | None] | None = None
        self._zeros: torch.Tensor | None = None

    def value_row(self, pages: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """Rows of :attr:`value_rows` holding the values of cells (``pages``, ``offsets``) (broadcast)."""
        return (2 * pages + 1) * self.geometry.block_size + offsets

    def read_cells(self, pages: torch.Tensor, offsets: torch.Tensor, values: bool = True) -> Tensors:
        return self.keys_t[pages, :, offsets], self.values[pages, offsets] if values else None

    def move(self, move: Move) -> None:
        """Through bounded buffers (:meth:`Move.staged`): the cells whose source may be
        overwritten are copied out first, the others go through one reused buffer of at most
        :attr:`MOVE_CHUNK` cells per slice (a decode recompression of H2O at 8K moves ~170K
        cells: fresh buffers of that size cost more in page faults than the copy); keys are
        written by (page, :, offset), values as rows of :attr:`value_rows`. Everything is
        allocated before the first write (an allocation failure leaves the cache as it was)."""
        if not len(move):
            return
        d = self.head_dim
        ordered, first = move.staged(self.geometry.block_size)
        plan = self._move_indices(ordered)
        widest = min(self.MOVE_CHUNK, len(ordered) - first)
        keys, values = self.scratch("move_keys", (widest, d)), self.scratch("move_values", (widest, d))
        held = (torch.empty(first, d, dtype=self.dtype), torch.empty(first, d, dtype=self.dtype))
        self._gather_cells(plan, slice(0, first), *held)
        for start in range(first, len(ordered), self.MOVE_CHUNK):
            rows = slice(start, min(start + self.MOVE_CHUNK, len(ordered)))
            n = rows.stop - rows.start
            self._gather_cells(plan, rows, keys[:n], values[:n])
            self._write_cells(plan, rows, keys[:n], values[:n])
        self._write_cells(plan, slice(0, first), *held)

    def _move_indices(self, move: Move) -> tuple[torch.Tensor, ...]:
        """Source pages, offsets and value rows, destination pages, offsets and value rows."""
        src_pages, src_offsets = move.src_pages.to(self.device), move.src_offsets.to(self.device)
        dst_pages, dst_offsets = move.dst_pages.to(self.device), move.dst_offsets.to(self.device)
        return (src_pages, src_offsets, self.value_row(src_pages, src_offsets),
                dst_pages, dst_offsets, self.value_row(dst_pages, dst_offsets))

    def _gather_cells(self, plan: tuple[torch.Tensor, ...], rows: slice, keys: torch.Tensor,
                      values: torch.Tensor) -> None:
        src_pages, src_offsets, src_rows = (x[rows] for x in plan[:3])
        torch.ops.aten.index.Tensor_out(self.keys_t, [src_pages, None, src_offsets], out=keys)
        torch.index_select(self.value_rows, 0, src_rows, out=values)

    def _write_cells(self, plan: tuple[torch.Tensor, ...], rows: slice, keys: torch.Tensor,
                     values: torch.Tensor) -> None:
        dst_pages, dst_offsets, dst_rows = (x[rows] for x in plan[3:])
        self.keys_t[dst_pages, :, dst_offsets] = keys
        self.value_rows.index_copy_(0, dst_rows, values)

    def read_pages(self, pages: torch.Tensor, values: bool = True) -> Tensors:
        bs, d, flat = self.geometry.block_size, self.head_dim, pages.reshape(-1)
        gathered = torch.index_select(self.keys_t, 0, flat, out=self.scratch("keys_t", (flat.numel(), d, bs)))
        keys = gathered.view(*pages.shape, d, bs).transpose(-1, -2).contiguous()
        if not values:
            return keys.flatten(-3, -2), None
        read = torch.index_select(self.values, 0, flat).view(*pages.shape, bs, d)
        return keys.flatten(-3, -2), read.flatten(-3, -2)

    def write_cells(self, pages: torch.Tensor, offsets: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.keys_t[pages, :, offsets] = keys.to(self.dtype)
        self.values[pages, offsets] = values.to(self.dtype)

    def observes(self, group: int, query_rows: list[int]) -> bool:
        """Where the C kernel attends every sequence (float32, at most :attr:`NATIVE_ROWS` rows
        each, built), the sequences of one row: it sums their attention as it attends."""
        return (self.dtype == torch.float32 and cpu_native.covers(torch.float32, group, self.head_dim,
                                                                   self.geometry.block_size)
                and bool(query_rows) and max(query_rows) <= self.NATIVE_ROWS)

    def attend(self, q: torch.Tensor, tables: torch.Tensor, lengths: torch.Tensor, query_start: torch.Tensor,
               variant: AttentionVariant, compensation: SequenceCompensation | None,
               memo: dict[str, object] | None = None, observe: torch.Tensor | None = None,
               query_rows: list[int] | None = None) -> torch.Tensor:
        """Decode rows (at most :attr:`NATIVE_ROWS` per sequence): kvcomp's C kernel attends
        every sequence, merging compensation tokens and sinks (:mod:`~vllm_kvcomp.kernels.cpu_native`)
        and summing the attention of the sequences ``observe`` names.
        Otherwise (a prefill chunk, or the C kernel not built) vLLM's kernel, except for the
        sequences that merge a compensation token or sinks: it returns no LSE, so they attend by
        :meth:`_attend_merged` and the kernel reads only their first T cells. Its schedule (from
        the lengths and query rows alone) is kept in ``memo``, per set of merged sequences."""
        q = q.contiguous()
        native = self._native_groups(q, query_start, query_rows)
        if native is not None:
            out = torch.empty_like(q)
            s = tables.shape[0]
            if compensation is None:
                tokens = self._no_tokens(s)
            else:
                tokens = (compensation.keys, compensation.values, compensation.counts)
            cpu_native.merged_attention(self.pages, q, out, native, query_start, tables, lengths, *tokens,
                                        variant.sequence_sinks(s, self.geometry.num_kv_heads),
                                        self.geometry.block_size, variant.scale, variant.softcap, observe)
            return out
        if observe is not None:  # a bug: the worker asks observes() first
            raise RuntimeError("attention can be observed only where the C kernel attends every sequence")
        seq_lens, starts, table = lengths.to(torch.int32), query_start.to(torch.int32), tables.to(torch.int32)
        merged = () if compensation is None else compensation.merged
        if merged:  # the kernel's rows of a merged sequence are overwritten: it reads the fewest cells it can
            seq_lens = seq_lens.clone()
            for s, queries, _ in compensation.groups:
                seq_lens[s] = queries
        key = f"schedule {merged}" if merged else "schedule"
        schedule = None if memo is None else memo.get(key)
        if schedule is None:
            schedule = vllm_compat.cpu_attention_schedule(
                num_reqs=table.shape[0], num_heads=q.shape[1], num_kv_heads=1, head_dim=self.head_dim,
                seq_lens=seq_lens, dtype=q.dtype, query_start_loc=starts, causal=True, sliding_window_size=-1,
                isa=self.isa, dynamic_causal=None, kv_cache_dtype="auto",
            )
            if memo is not None:
                memo[key] = schedule
        out = torch.empty_like(q)
        vllm_compat.cpu_paged_attention(
            query=q, key_cache=self.kernel_keys, value_cache=self.kernel_values, output=out, query_start_loc=starts,
            seq_lens=seq_lens, scale=variant.scale, causal=True, alibi_slopes=None, sliding_window=-1,
            block_table=table, softcap=variant.softcap, scheduler_metadata=schedule, s_aux=None,
        )
        if compensation is not None:
            self._attend_merged(out, q, tables, lengths, query_start, variant, compensation)
        return out

    def _no_tokens(self, num_sequences: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Keys, values [S, D] and counts [S] of no compensation token (zeros the C kernel only
        reads), made once per size."""
        zeros = self._zeros
        if zeros is None or zeros.shape[0] != num_sequences:
            zeros = self._zeros = torch.zeros(num_sequences, self.head_dim, dtype=torch.float32)
        return zeros, zeros, zeros[:, 0]

    #: most query rows per sequence that kvcomp's C kernel attends in place of vLLM's kernel: it
    #: reads a sequence's pages once per row, where vLLM's kernel tiles a prefill chunk's rows
    NATIVE_ROWS: ClassVar[int] = 8

    def _native_covers(self, q: torch.Tensor) -> bool:
        """Whether kvcomp's C kernel takes attention of queries ``q`` [T, G, D] over this cache."""
        return self.dtype == torch.float32 and cpu_native.covers(q.dtype, q.shape[1], self.head_dim,
                                                                 self.geometry.block_size)

    def _native_groups(self, q: torch.Tensor, query_start: torch.Tensor,
                       query_rows: list[int] | None) -> list[tuple[torch.Tensor, int]] | None:
        """Every sequence, grouped by its number of query rows, when the C kernel attends them
        all (float32, at most :attr:`NATIVE_ROWS` rows each, the kernel built); else None. Made
        once per ``query_start`` tensor (a step's layers share one: they read nothing back)."""
        plan = self._native_plan
        if plan is not None and plan[0] is query_start:
            return plan[1]
        groups = None
        rows = query_rows if query_rows is not None else (query_start[1:] - query_start[:-1]).tolist()
        if q.dtype == torch.float32 and self.observes(q.shape[1], rows):  # the rule observes() tells the worker
            by_rows: dict[int, list[int]] = {}
            for s, t in enumerate(rows):
                by_rows.setdefault(t, []).append(s)
            groups = [(torch.tensor(seqs, dtype=torch.int32), t) for t, seqs in sorted(by_rows.items())]
        self._native_plan = (query_start, groups)
        return groups

    def _attend_merged(self, out: torch.Tensor, q: torch.Tensor, tables: torch.Tensor, lengths: torch.Tensor,
                       query_start: torch.Tensor, variant: AttentionVariant,
                       compensation: SequenceCompensation) -> None:
        """The planned sequences' attention, written into ``out``: by the C kernel of
        :mod:`~vllm_kvcomp.kernels.cpu_native` (one call per layer), or in torch
        (:meth:`_attend_merged_torch`) where it is not built or does not cover the call."""
        if self._native_covers(q):
            cpu_native.merged_attention(
                self.pages, q, out, [(s, group) for s, group, _ in compensation.groups], query_start, tables,
                lengths, compensation.keys, compensation.values, compensation.counts,
                variant.sequence_sinks(tables.shape[0], self.geometry.num_kv_heads), self.geometry.block_size,
                variant.scale, variant.softcap)
        else:
            self._attend_merged_torch(out, q, tables, lengths, query_start, variant, compensation)

    def _attend_merged_torch(self, out: torch.Tensor, q: torch.Tensor, tables: torch.Tensor, lengths: torch.Tensor,
                             query_start: torch.Tensor, variant: AttentionVariant,
                             compensation: SequenceCompensation) -> None:
        """The planned sequences' attention, written into ``out``: their kept keys' attention and
        its LSE in torch (:meth:`_kept_attention`, batched over the sequences with the same number
        of query rows T), then, with the token's and the sink's logits, every part's share of the
        softmax: ``out = w_kept · attention(kept) + w_token · v_hat`` (a sink's value is zero)."""
        k_hat, v_hat, counts = compensation.keys, compensation.values, compensation.counts
        d, cap = self.head_dim, variant.softcap
        sinks = variant.sequence_sinks(tables.shape[0], self.geometry.num_kv_heads)
        for s, group, width in compensation.groups:
            c, heads = s.numel(), q.shape[1]
            rows = (query_start[s].unsqueeze(1) + torch.arange(group)).flatten()  # [C*T]
            qs = q[rows].float().view(c, group * heads, d) * variant.scale  # [C, T*G, D]
            kept, lse = self._kept_attention(qs, tables[s, :width], lengths[s], group, cap)
            kept, lse = kept.view(c, group, heads, d), lse.view(c, group, heads)
            comp_logit = soft_cap(torch.bmm(qs, k_hat[s].float().unsqueeze(-1)), cap).view(c, group, heads)
            parts = [lse, comp_logit + counts[s].float().log().view(-1, 1, 1)]  # log 0 = -inf: no token
            if sinks is not None:
                parts.append(sinks[s].float().view(c, 1, heads).expand(-1, group, -1))
            weights = torch.softmax(torch.stack(parts), dim=0).unsqueeze(-1)  # [parts, C, T, G, 1]
            merged = weights[0] * kept + weights[1] * v_hat[s].float().view(c, 1, 1, d)
            out[rows] = merged.flatten(0, 1).to(out.dtype)

    #: most (query row, page, dim) triples :meth:`_kept_attention` reads by ``embedding_bag``
    #: (8 bytes of index each); past it (long query rows: a prefill chunk) it gathers the pages
    BAG_LIMIT: ClassVar[int] = 1 << 20

    def _kept_attention(self, qs: torch.Tensor, table: torch.Tensor, ends: torch.Tensor, group: int,
                        cap: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Causal attention of scaled queries qs [C, T*G, D] (the last T tokens of each sequence,
        G query heads each) over their pages ``table`` [C, W] holding ``ends`` [C] cells ->
        (attention [C, T*G, D], its LSE [C, T*G]), float32.

        Few query rows read the pages in place, as ``embedding_bag`` sums: a logit row of a page
        is its ``K^T`` rows weighted by the query, an attention row its cells' values weighted by
        the probabilities (a gather costs more than the sums). Many gather the pages once and
        multiply. Cells past a sequence's end are hidden and never read: what an unwritten cell
        holds could be NaN."""
        c, rows, d = qs.shape
        width, bs = table.shape[1], self.geometry.block_size
        n, cell = width * bs, torch.arange(width * bs)
        limit = ends.view(-1, 1) - group + torch.arange(group) + 1  # causal: [C, T]
        hidden = (cell >= limit.view(c, group, 1, 1)).view(c, group, 1, n)  # [C, T, 1, N]
        bags = self.dtype == torch.float32 and c * rows * width * d <= self.BAG_LIMIT
        if bags:
            key_rows = (table * (2 * d)).view(c, 1, width, 1) + torch.arange(d)  # K^T row (page, dim) [C, 1, W, D]
            logits = F.embedding_bag(key_rows.expand(c, rows, width, d).reshape(-1, d), self.key_rows, mode="sum",
                                     per_sample_weights=qs.view(c, rows, 1, d).expand(c, rows, width, d).reshape(-1, d))
        else:
            pages_t = torch.index_select(self.keys_t, 0, table.flatten(),
                                         out=self.scratch("merge_pages_t", (c * width, d, bs)))
            keys_t = self.scratch("merge_keys_t", (c, d, width, bs))
            keys_t.copy_(pages_t.view(c, width, d, bs).transpose(1, 2))
            logits = torch.bmm(qs, keys_t.view(c, d, n).float())
        logits = soft_cap(logits.view(c, group, -1, n), cap).masked_fill_(hidden, float("-inf"))
        lse = torch.logsumexp(logits, dim=-1)  # [C, T, G]: a sequence's last query sees >= 1 key
        probs = logits.sub_(lse.unsqueeze(-1)).exp_().view(c, rows, n)
        cells = self.value_row(table.view(c, width, 1), torch.arange(bs)).view(c, n)  # [C, N]
        cells = torch.where(cell < ends.view(-1, 1), cells, cells[:, :1])  # past the end: a written cell, weight 0
        if bags:
            kept = F.embedding_bag(cells.view(c, 1, n).expand(c, rows, n).reshape(-1, n), self.value_rows,
                                   mode="sum", per_sample_weights=probs.reshape(-1, n))
        else:
            values = torch.index_select(self.value_rows, 0, cells.flatten(),
                                        out=self.scratch("merge_values", (c * n, d)))
            kept = torch.bmm(probs, values.view(c, n, d).float())
        return kept.view(c, rows, d), lse.view(c, rows)


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

    def read_cells(self, pages: torch.Tensor, offsets: torch.Tensor, values: bool = True) -> Tensors:
        if not values:
            return self.cells[pages, offsets, 0, : self.head_dim], None
        cells = self.cells[pages, offsets, 0]
        return cells[:, : self.head_dim], cells[:, self.head_dim :]

    def read_pages(self, pages: torch.Tensor, values: bool = True) -> Tensors:
        flat = pages.reshape(-1)
        cells = torch.index_select(self.cells, 0, flat)
        cells = cells.view(*pages.shape, -1, 2 * self.head_dim).flatten(-3, -2)  # [..., n * bs, 2D]
        return cells[..., : self.head_dim], cells[..., self.head_dim :] if values else None  # K and V share cells

    def write_cells(self, pages: torch.Tensor, offsets: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.cells[pages, offsets, 0] = torch.cat([keys, values], dim=-1).to(self.dtype)

    def move(self, move: Move) -> None:
        """A cell is K and V side by side: whole cells are gathered by row (``index_select`` over
        the buffer as ``[pages * bs, 2D]`` rows), then scattered (``index_copy_``), through
        bounded buffers as on the host (:meth:`Move.staged`), all allocated before the first write."""
        if not len(move):
            return
        bs = self.geometry.block_size
        rows = self.pages.view(-1, 2 * self.head_dim)
        ordered, first = move.staged(bs)
        src = to_device(ordered.src_pages * bs + ordered.src_offsets, self.device)  # one transfer each, pinned
        dst = to_device(ordered.dst_pages * bs + ordered.dst_offsets, self.device)
        buffer = self.scratch("move_cells", (min(self.MOVE_CHUNK, len(ordered) - first), rows.shape[1]))
        held = rows.index_select(0, src[:first])
        for start in range(first, len(ordered), self.MOVE_CHUNK):
            part = buffer[: min(self.MOVE_CHUNK, len(ordered) - start)]
            torch.index_select(rows, 0, src[start : start + part.shape[0]], out=part)
            rows.index_copy_(0, dst[start : start + part.shape[0]], part)
        rows.index_copy_(0, dst[:first], held)

    def attend(self, q: torch.Tensor, tables: torch.Tensor, lengths: torch.Tensor, query_start: torch.Tensor,
               variant: AttentionVariant, compensation: SequenceCompensation | None,
               memo: dict[str, object] | None = None, observe: torch.Tensor | None = None,
               query_rows: list[int] | None = None) -> torch.Tensor:
        """One launch (nothing to share between layers: ``memo`` unused): ``decode_attention``
        when every sequence has one query row (its key splits keep the GPU busy), summing the
        attention of the sequences ``observe`` names; else ``prefill_attention``, every sequence's
        rows with their causal limits (a prefill chunk, draft rows)."""
        from vllm_kvcomp import kernels

        sinks = variant.sequence_sinks(tables.shape[0], self.geometry.num_kv_heads)  # [S, G]
        comp = None if compensation is None else (compensation.keys, compensation.values, compensation.counts)
        if q.shape[0] == tables.shape[0]:  # one query per sequence (decode)
            if comp is not None:
                comp = tuple(t.unsqueeze(1) for t in comp)
            return kernels.decode_attention(q, self.cells, tables, lengths, compensation=comp, scale=variant.scale,
                                            softcap=variant.softcap, sinks=sinks,
                                            observe=None if observe is None else observe.view(-1, 1))[0]
        if observe is not None:  # a bug: the worker asks observes() first
            raise RuntimeError("attention is observed only where every sequence has one query row")
        return kernels.prefill_attention(q, self.cells, tables, lengths, query_start, compensation=comp,
                                         scale=variant.scale, softcap=variant.softcap, sinks=sinks,
                                         max_rows=None if not query_rows else max(query_rows))[0]

    def observes(self, group: int, query_rows: list[int]) -> bool:
        """Sequences of one query row each: the decode kernel sums their attention as it attends."""
        return bool(query_rows) and max(query_rows) == 1


def right_aligned(read: torch.Tensor, lengths: torch.Tensor, width: int) -> torch.Tensor:
    """[H, width, D] of one layer's heads read left-aligned ``read`` [H, S, D] (head h's
    ``lengths[h]`` cells first), right-aligned with zeros on the left. A view when every head
    is ``width`` long, else one row gather."""
    if bool((lengths == width).all()):
        return read[:, :width]
    heads, cells, dim = read.shape
    virtual = torch.arange(width) - (width - lengths.unsqueeze(1))  # [H, width]; < 0: padding
    rows = (torch.arange(heads).unsqueeze(1) * cells + virtual.clamp(min=0)).flatten().to(read.device)
    out = read.reshape(-1, dim).index_select(0, rows)
    out.index_fill_(0, torch.nonzero(virtual.flatten() < 0).flatten().to(read.device), 0)
    return out.view(heads, width, dim)


class LayerReader:
    """A request's virtual sequences read for a decision one layer at a time: ``tables`` [L, H, W]
    (on the cache's device), ``lengths`` [L, H] (host). It keeps only the last layer it read
    (policies ask for a layer's keys and values more than once), so a decision holds one
    layer's K+V of the request, not all of them (``PluginMemory``). ``pause`` is called before
    each layer is read (off the step on the host: where a decision's slice may end)."""

    def __init__(self, cache: PagedCache, tables: torch.Tensor, lengths: torch.Tensor, values: bool,
                 pause: Callable[[], None] | None = None):
        self.cache, self.tables, self.lengths, self.values = cache, tables, lengths, values
        self.widths = lengths.amax(dim=1).tolist()
        self.pause = pause
        self._last: tuple[int, Tensors] | None = None

    def layer(self, layer: int) -> Tensors:
        """Keys, values [H, width, D] of ``layer``, right-aligned per head as policies expect."""
        if self._last is not None and self._last[0] == layer:
            return self._last[1]
        self._last = None  # dropped before the next one is read
        if self.pause is not None:
            self.pause()
        read = self.cache.read_pages(self.tables[layer], self.values)
        width = self.widths[layer]
        aligned = tuple(None if x is None else right_aligned(x, self.lengths[layer], width) for x in read)
        self._last = (layer, aligned)
        return aligned

    def part(self, layer: int, which: int) -> torch.Tensor:
        """Keys (``which`` 0) or values (1) of ``layer``."""
        return self.layer(layer)[which]
