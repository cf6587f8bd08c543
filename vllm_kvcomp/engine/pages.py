"""Packed per-head pages: where each (layer, KV head) of a compressed request keeps its tokens.

A **page** is ``block_size`` token cells of one (layer, KV head) inside one physical vLLM block.
vLLM allocates all layers' caches as views of one buffer, so the buffer seen as pages has
``L * num_blocks * H`` of them (:class:`PageGeometry` numbers them); a block holds ``L * H``
pages. vLLM writes a new token of logical position ``t`` into page (l, ``block_ids[t // bs]``, h)
at offset ``t % bs`` for every layer and head, as always.

Each (layer, head) of a request reads a **virtual sequence** (:class:`RequestPages`): its
``m[l, h]`` *packed* pages (full, anywhere in the request's blocks, any layer's cells), then the
*tail*: its own page of every block from column ``tail_col`` on. Compression at logical length
``end`` (``o = end % bs``, ``G = end // bs``) keeps ``k[l, h] = m * bs + o`` tokens per head (the
``Policy.decide`` rounds every policy's pick up to that, see ``RequestState.page_quantum``): the first
``m * bs`` kept tokens fill packed pages, the last ``o`` sit in cells ``[0, o)`` of the head's
own page of block ``G`` (exactly where vLLM's next tokens continue, at offset ``o``), and
``tail_col`` becomes ``G``. Virtual order is ascending logical position.

Packed pages go into the request's *last* blocks below ``G``: ``K = ceil(sum m / (L * H))``
blocks, columns ``[G - K, G)``; columns before ``G - K`` hold nothing live and go back to vLLM.
Since every head's live length is ``≡ end (mod bs)``, a recompression never needs more columns
than the previous one left (``G - K`` never decreases). A request therefore holds
``ceil(sum_lh m / (L * H))`` blocks plus its tail, which grows by one block every ``bs`` decode
steps, exactly as vLLM's own accounting expects.

Inside those columns a packed page whose ``bs`` kept tokens are one whole page already there, at
the same offsets, stays put; only the other pages are written. A decode recompression that
evicts a run of cells (a sliding window, every ``bs`` steps) therefore moves the pages of the
column that goes back and the cells around the run, not every kept token (at 8K, ~2 of ~63
pages per head).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from vllm_kvcomp.policies.base import ceil_div

NO_PAGE = 0  # table padding: a valid page id, never read past a sequence's length


@dataclass(frozen=True)
class PageGeometry:
    """Page numbering of one KV-cache group: page (l, b, h) = ``first_page[l] + b * H + h``."""

    num_layers: int
    num_kv_heads: int
    block_size: int
    first_page: torch.Tensor  # [L] int64

    @property
    def pages_per_block(self) -> int:
        return self.num_layers * self.num_kv_heads

    def in_blocks(self, pages: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
        """[n] bool: whether each of ``pages`` [n] lies in one of ``blocks`` (a packed page may
        hold any layer's cells: its block is found from the layer slice it lies in)."""
        starts, order = self.first_page.sort()
        layers = order[torch.searchsorted(starts, pages, right=True) - 1]
        of = (pages - self.first_page[layers]) // self.num_kv_heads
        if not of.numel():
            return torch.zeros(0, dtype=torch.bool)
        top = max(int(of.max()), int(blocks.max()) if blocks.numel() else 0)
        marked = torch.zeros(top + 1, dtype=torch.bool)
        marked[blocks] = True
        return marked[of]

    def page_ids(self, blocks: torch.Tensor) -> torch.Tensor:
        """[L, H, n] page ids of physical ``blocks`` [n] for every layer and head."""
        blocks = torch.as_tensor(blocks, dtype=torch.long)
        heads = torch.arange(self.num_kv_heads)
        return self.first_page.view(-1, 1, 1) + blocks.view(1, 1, -1) * self.num_kv_heads + heads.view(1, -1, 1)


@dataclass
class Move:
    """Cells to copy: source (page, offset) -> destination (page, offset), all [n] int64.

    Sources may be overwritten by other destinations: read every source before writing.
    """

    src_pages: torch.Tensor
    src_offsets: torch.Tensor
    dst_pages: torch.Tensor
    dst_offsets: torch.Tensor
    #: [n] bool, the moves whose source some move may overwrite, when the plan knows (a source
    #: in a block it writes); None: found cell by cell
    clobbered: torch.Tensor | None = None

    def __len__(self) -> int:
        return int(self.src_pages.numel())

    def __getitem__(self, rows: slice | torch.Tensor) -> Move:
        return Move(self.src_pages[rows], self.src_offsets[rows], self.dst_pages[rows], self.dst_offsets[rows],
                    None if self.clobbered is None else self.clobbered[rows])

    def staged(self, block_size: int) -> tuple[Move, int]:
        """These moves ordered so that the ``k`` whose source may be overwritten (:attr:`clobbered`)
        come first, and ``k``: those are read before anything is written; the others' sources are
        never written, so they can go through one bounded buffer a slice at a time.
        Copy-on-compress writes only spares: ``k`` is 0."""
        clobbered = self.clobbered
        if clobbered is None:
            src = self.src_pages * block_size + self.src_offsets
            clobbered = torch.isin(src, self.dst_pages * block_size + self.dst_offsets)
        order = torch.cat([torch.nonzero(clobbered).flatten(), torch.nonzero(~clobbered).flatten()])
        return self[order], int(clobbered.sum())


@dataclass
class RequestPages:
    """One request's virtual sequences (see the module docstring). Before the first compression
    nothing is packed and the tail starts at column 0: the natural layout."""

    geometry: PageGeometry
    packed: torch.Tensor = field(default=None)  # [L, H, M] int64 page ids, NO_PAGE past counts
    counts: torch.Tensor = field(default=None)  # [L, H] int64 packed pages per head
    kept_positions: list[list[torch.Tensor]] | None = None  # [L][H] logical positions of kept tokens
    tail_col: int = 0
    first_live_col: int = 0  # columns before it were freed
    # the last table built and the tail blocks it was built from (a decode step's table changes
    # only when the tail crosses into a new block; a compaction makes a new RequestPages)
    _table: tuple[tuple[int, ...], torch.Tensor] | None = field(default=None, init=False, repr=False, compare=False)
    # the last positions built and the length they were built for (a compression reads them for
    # its policy's inputs and again for its compaction)
    _positions: tuple[int, torch.Tensor] | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        g = self.geometry
        if self.packed is None:
            self.packed = torch.zeros(g.num_layers, g.num_kv_heads, 0, dtype=torch.long)
            self.counts = torch.zeros(g.num_layers, g.num_kv_heads, dtype=torch.long)

    @property
    def compressed(self) -> bool:
        return self.kept_positions is not None

    def lengths(self, seq_len: int) -> torch.Tensor:
        """[L, H] int64 virtual length of every head when the request holds ``seq_len`` tokens."""
        return self.counts * self.geometry.block_size + (seq_len - self.tail_col * self.geometry.block_size)

    def tables(self, block_ids: torch.Tensor | list[int], seq_len: int) -> torch.Tensor:
        """[L, H, W] int64 page table of every head's virtual sequence (``block_ids`` [n] positional).

        Built again only when the tail's blocks changed since the last call (the same tensor is
        returned until then: read it, do not write it)."""
        tail_blocks = self.tail_blocks(block_ids, seq_len)
        if self._table is not None and self._table[0] == tail_blocks:
            return self._table[1]
        tail = self.geometry.page_ids(torch.tensor(tail_blocks, dtype=torch.long))  # [L, H, n_tail]
        width = self.packed.shape[2] + tail.shape[2]
        table = torch.full((*self.counts.shape, width), NO_PAGE, dtype=torch.long)
        table[..., : self.packed.shape[2]] = self.packed
        columns = self.counts.unsqueeze(-1) + torch.arange(tail.shape[2])
        table.scatter_(2, columns, tail)
        self._table = (tail_blocks, table)
        return table

    def tail_blocks(self, block_ids: torch.Tensor | list[int], seq_len: int) -> tuple[int, ...]:
        """The blocks of the tail (every head's pages from column ``tail_col`` on) at ``seq_len`` tokens."""
        ids = block_ids.tolist() if isinstance(block_ids, torch.Tensor) else block_ids
        return tuple(ids[self.tail_col : ceil_div(seq_len, self.geometry.block_size)])

    def positions(self, seq_len: int) -> torch.Tensor:
        """[L, H, N] logical positions of every head's virtual sequence when the request holds
        ``seq_len`` tokens, ascending, right-aligned to the longest head's N (-1 on the left):
        its kept positions, then the tail's consecutive ones. Built again only for another
        ``seq_len`` than the last call's (read it, do not write it)."""
        if self._positions is not None and self._positions[0] == seq_len:
            return self._positions[1]
        lengths = self.lengths(seq_len).flatten()  # [L*H]
        width = int(lengths.max()) if lengths.numel() else 0
        held, start, tail = self._held_positions()
        virtual = torch.arange(width) - (width - lengths).unsqueeze(1)  # [L*H, N]; < 0: padding
        kept = self._kept_flat()[(start.unsqueeze(1) + virtual).clamp(0, max(int(held.sum()) - 1, 0))]
        out = torch.where(virtual < held.unsqueeze(1), kept, tail.unsqueeze(1) + virtual - held.unsqueeze(1))
        self._positions = (seq_len, out.masked_fill_(virtual < 0, -1).view(*self.counts.shape, width))
        return self._positions[1]

    def packed_pages(self, kept: list[list[torch.Tensor]], end: int) -> torch.Tensor:
        """[L, H] packed pages each head needs to keep ``kept[l][h]`` at logical length ``end``.

        Raises ValueError if a count is not ``≡ end (mod bs)``."""
        bs = self.geometry.block_size
        residue = end % bs
        counts = torch.tensor([[len(idx) for idx in layer] for layer in kept], dtype=torch.long)
        if bool(((counts - residue) % bs != 0).any()):
            raise ValueError(f"kept counts must be ≡ {residue} (mod {bs}), got {counts.tolist()}")
        return (counts - residue) // bs

    def blocks_needed(self, kept: list[list[torch.Tensor]], end: int) -> int:
        """Blocks the packed pages of ``kept`` fill (the columns just below ``end // bs``)."""
        return ceil_div(int(self.packed_pages(kept, end).sum()), self.geometry.pages_per_block)

    def compact(
        self, kept: list[list[torch.Tensor]], block_ids: torch.Tensor, end: int,
        destination: list[int] | None = None,
    ) -> tuple[Move, RequestPages]:
        """The cell moves and new page state after keeping virtual indices ``kept[l][h]``
        (sorted; each count ``≡ end (mod bs)`` or the whole head) at logical length ``end``.

        Packed pages go into the request's own blocks of columns ``[G - K, G)``, or, given
        ``destination`` (K block ids standing for those columns: copy-on-compress), into those.
        Raises ValueError if the kept pages do not fit (a bug: the engine then leaves the
        request uncompressed).
        """
        g, bs = self.geometry, self.geometry.block_size
        block_ids = torch.as_tensor(block_ids, dtype=torch.long)
        residue, growth = end % bs, end // bs
        pages = self.packed_pages(kept, end)  # [L, H]
        needed = ceil_div(int(pages.sum()), g.pages_per_block)
        first = growth - needed
        if first < self.first_live_col:
            raise ValueError(f"{int(pages.sum())} pages do not fit columns [{self.first_live_col}, {growth})")
        if destination is not None and len(destination) != needed:
            raise ValueError(f"{needed} destination blocks needed, {len(destination)} given")
        targets = block_ids[first:growth] if destination is None else torch.as_tensor(destination, dtype=torch.long)
        heads = g.num_layers * g.num_kv_heads
        counts = (pages * bs + residue).flatten()  # [L*H] kept per head (packed_pages checked them)
        idx = torch.cat([torch.as_tensor(i, dtype=torch.long) for layer in kept for i in layer])  # kept, head-major
        old_tables = self.tables(block_ids, end).view(heads, -1)
        first_kept = torch.cumsum(counts, 0) - counts
        packed, movers = self._repack(g.page_ids(targets), pages, idx, first_kept, old_tables)
        own = torch.nn.functional.pad(packed, (0, 1), value=NO_PAGE).view(heads, -1)  # [L*H, M+1]
        if residue:  # the last `residue` kept cells stay in the head's page of block `growth`
            own.scatter_(1, pages.view(heads, 1), g.page_ids(block_ids[growth : growth + 1]).view(heads, 1))
        # the cells that may move, as (head, index in the head's new sequence): those of the packed
        # pages not left in place, then each head's last `residue` (a page left in place moves nothing)
        mover_head, mover_page = movers
        cell_head = torch.cat([mover_head.repeat_interleave(bs), torch.arange(heads).repeat_interleave(residue)])
        dst = torch.cat([(mover_page.unsqueeze(1) * bs + torch.arange(bs)).flatten(),
                         (pages.view(heads, 1) * bs + torch.arange(residue)).flatten()])
        src = idx[first_kept[cell_head] + dst]  # the cell's virtual index now
        src_pages, src_offsets = old_tables[cell_head, src // bs], src % bs
        dst_pages, dst_offsets = own[cell_head, dst // bs], dst % bs
        moved = (src_pages != dst_pages) | (src_offsets != dst_offsets)
        written = targets if not residue else torch.cat([targets, block_ids[growth : growth + 1]])
        move = Move(src_pages, src_offsets, dst_pages, dst_offsets,
                    g.in_blocks(src_pages, written))[moved]
        old_positions = self.positions(end).view(heads, -1)  # right-aligned: virtual index v at v + N - length
        padding = old_positions.shape[1] - self.lengths(end).flatten()
        position_row = torch.repeat_interleave(torch.arange(heads) * old_positions.shape[1] + padding, counts)
        split = torch.split(old_positions.view(-1)[position_row + idx], counts.tolist())
        positions = [list(split[layer * g.num_kv_heads : (layer + 1) * g.num_kv_heads]) for layer in range(g.num_layers)]
        return move, RequestPages(g, packed, pages, positions, tail_col=growth, first_live_col=first)

    def _repack(self, region: torch.Tensor, pages: torch.Tensor, idx: torch.Tensor, first_kept: torch.Tensor,
                old_tables: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """[L, H, max pages] packed page ids of the new layout, from the pages ``region`` [L, H, K]
        of the packed columns. A new packed page whose ``bs`` kept cells are one whole old page
        of the region, at the same offsets, stays where it is (nothing moves: after a decode
        recompression that evicted a run of whole pages' worth of cells, every page past the
        run); the others take the region's remaining pages, each head its own first
        (:func:`assign_pages`). ``idx`` [n]: every head's kept virtual indices, head-major,
        head ``i``'s from ``first_kept[i]``; ``old_tables`` [L*H, W] the current tables. Also
        returns the pages that are not left in place: their heads (flat ``l * H + h``) and
        indices among the head's packed pages, both [P_moving]."""
        bs, heads = self.geometry.block_size, region.shape[0] * region.shape[1]
        per_head = pages.flatten()
        total = int(per_head.sum())
        if total == 0:
            none = torch.zeros(0, dtype=torch.long)
            return torch.full((*pages.shape, 0), NO_PAGE, dtype=torch.long), (none, none)
        head = torch.repeat_interleave(torch.arange(heads), per_head)  # [P] each new page's head
        j = torch.arange(total) - torch.repeat_interleave(torch.cumsum(per_head, 0) - per_head, per_head)
        start = first_kept[head] + j * bs  # each new page's first kept cell in idx
        src_first, src_last = idx[start], idx[start + bs - 1]
        src_page = old_tables[head, src_first // bs]
        whole = (src_first % bs == 0) & (src_last - src_first == bs - 1)  # sorted, distinct: one whole old page
        stays = whole & torch.isin(src_page, region.flatten())
        flat = region.reshape(heads, -1)
        free = ~torch.isin(flat, src_page[stays])  # [L*H, K] region pages nobody stays in
        wanted = torch.bincount(head[~stays], minlength=heads)  # [L*H] pages each head still needs
        free_first = torch.argsort((~free).to(torch.int8), dim=1, stable=True)  # free pages first, block order
        assigned = assign_pages(flat.gather(1, free_first).view(region.shape), wanted.view(pages.shape),
                                free.sum(1).view(pages.shape))  # [L, H, max wanted]
        packed = torch.full((heads, int(per_head.max())), NO_PAGE, dtype=torch.long)
        packed[head[stays], j[stays]] = src_page[stays]
        moving = ~stays
        rank = torch.cumsum(moving.long(), 0) - 1 - torch.repeat_interleave(
            torch.cumsum(wanted, 0) - wanted, per_head)  # among the head's pages that move
        packed[head[moving], j[moving]] = assigned.view(heads, -1)[head[moving], rank[moving]]
        return packed.view(*pages.shape, -1), (head[moving], j[moving])

    def _held_positions(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per head [L*H]: how many kept positions it holds (the first of its virtual sequence),
        where they start in :meth:`_kept_flat`, and the logical position of its first tail cell
        (nothing kept yet: 0, 0, 0)."""
        heads = self.geometry.num_layers * self.geometry.num_kv_heads
        if self.kept_positions is None:
            zero = torch.zeros(heads, dtype=torch.long)
            return zero, zero, zero
        held = torch.tensor([len(p) for layer in self.kept_positions for p in layer], dtype=torch.long)
        tail = self.tail_col * self.geometry.block_size + held - self.counts.flatten() * self.geometry.block_size
        return held, torch.cumsum(held, 0) - held, tail

    def _kept_flat(self) -> torch.Tensor:
        """Every head's kept positions, head-major, in one tensor (one 0 when none)."""
        if self.kept_positions is None:
            return torch.zeros(1, dtype=torch.long)
        return torch.cat([p for layer in self.kept_positions for p in layer] + [torch.zeros(1, dtype=torch.long)])


def assign_pages(own: torch.Tensor, counts: torch.Tensor, available: torch.Tensor | None = None) -> torch.Tensor:
    """[L, H, max count] packed page ids (``NO_PAGE`` past each count) of heads that need
    ``counts`` [L, H] pages, from the K blocks whose pages ``own`` [L, H, K] are (sum of counts
    <= L * H * K). Each head fills its own page of those blocks first, in block order (the
    layout vLLM's kernel reads for an uncompressed request: one stride through the head's own
    slots, not a jump between layers per page); a head that needs more than K takes the pages
    other heads leave, in (layer, head, block) order. ``available`` [L, H]: only each head's
    first that many pages of ``own`` may be used (default all K)."""
    k = own.shape[2]
    width = int(counts.max()) if counts.numel() else 0
    usable = torch.arange(k) < (torch.full_like(counts, k) if available is None else available).unsqueeze(-1)
    used = torch.minimum(counts, usable.sum(-1))  # [L, H] own pages each head takes
    mine = torch.arange(k) < used.unsqueeze(-1)  # [L, H, K]
    slot = torch.arange(width)
    packed = torch.full((*counts.shape, width), NO_PAGE, dtype=torch.long)
    packed[slot < used.unsqueeze(-1)] = own[mine]
    beyond = (slot >= used.unsqueeze(-1)) & (slot < counts.unsqueeze(-1))  # pages beyond the head's own
    packed[beyond] = own[usable & ~mine][: int(beyond.sum())]
    return packed
