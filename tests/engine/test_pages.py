"""Packed per-head pages without vLLM: a cache whose cells hold their own logical position.

A simulated request grows like vLLM grows it (one block per ``bs`` tokens, every layer and head
writing its token at the natural slot), is compressed to random page-rounded kept sets and keeps
decoding; after every step each head's virtual sequence must read back exactly the positions it
kept plus the tokens appended since, and nothing may live in a freed block.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from vllm_kvcomp.engine.pages import Move, PageGeometry, RequestPages

L, H, BS, NUM_BLOCKS = 3, 2, 4, 64


class SimRequest:
    """Cells ``[P, bs]`` holding logical positions (-1 = empty), a block list, a RequestPages."""

    def __init__(self, seed: int):
        self.rng = random.Random(seed)
        self.geometry = PageGeometry(L, H, BS, torch.arange(L) * NUM_BLOCKS * H)
        self.cells = torch.full((L * NUM_BLOCKS * H, BS), -1, dtype=torch.long)
        self.free = list(range(1, NUM_BLOCKS))
        self.rng.shuffle(self.free)
        self.blocks: list[int] = []
        self.pages = RequestPages(self.geometry)
        self.length = 0
        self.expected = [[[] for _ in range(H)] for _ in range(L)]  # positions each head holds

    def append(self, n: int) -> None:
        """vLLM's side: allocate blocks as needed and write positions at the natural slots."""
        for t in range(self.length, self.length + n):
            if t // BS >= len(self.blocks):
                self.blocks.append(self.free.pop())
            pages = self.geometry.page_ids(torch.tensor([self.blocks[t // BS]]))[..., 0]
            self.cells[pages.flatten(), t % BS] = t
            for layer in range(L):
                for head in range(H):
                    self.expected[layer][head].append(t)
        self.length += n

    def read(self) -> list[list[list[int]]]:
        tables = self.pages.tables(torch.tensor(self.blocks), self.length)
        lengths = self.pages.lengths(self.length)
        out = []
        for layer in range(L):
            out.append([])
            for head in range(H):
                i = torch.arange(int(lengths[layer, head]))
                out[layer].append(self.cells[tables[layer, head, i // BS], i % BS].tolist())
        return out

    def compress(self) -> int:
        """Keep a random page-rounded subset per head (or all but one random run); returns
        columns freed."""
        residue = self.length % BS
        kept = []
        for layer in range(L):
            kept.append([])
            for head in range(H):
                live = len(self.expected[layer][head])
                choices = [k for k in range(residue, live + 1, BS)]
                k = self.rng.choice(choices)
                if self.rng.random() < 0.5:
                    idx = sorted(self.rng.sample(range(live), k))
                else:  # one evicted run, as a window sliding in decode evicts (whole pages then stay put)
                    start = self.rng.randrange(k + 1)
                    idx = list(range(start)) + list(range(start + live - k, live))
                kept[layer].append(torch.tensor(idx, dtype=torch.long))
                self.expected[layer][head] = [self.expected[layer][head][i] for i in idx]
        before = self.pages.first_live_col
        move, self.pages = self.pages.compact(kept, torch.tensor(self.blocks), self.length)
        src, dst = move.src_pages * BS + move.src_offsets, move.dst_pages * BS + move.dst_offsets
        assert bool(move.clobbered[torch.isin(src, dst)].all())  # the plan marks every source it overwrites
        ordered, k = move.staged(BS)  # as the caches move: the first k read first, the rest in slices
        first = ordered[:k]
        held = self.cells[first.src_pages, first.src_offsets].clone()
        for start in range(k, len(ordered), 5):
            part = ordered[start : start + 5]
            self.cells[part.dst_pages, part.dst_offsets] = self.cells[part.src_pages, part.src_offsets].clone()
        self.cells[first.dst_pages, first.dst_offsets] = held
        freed = self.blocks[before : self.pages.first_live_col]
        for block in freed:  # what the scheduler gives back: poison it
            self.cells[self.geometry.page_ids(torch.tensor([block])).flatten()] = -7
        return len(freed)


@pytest.mark.parametrize("seed", range(12))
def test_virtual_sequences_hold_what_was_kept_through_compressions_and_decode(seed):
    req = SimRequest(seed)
    req.append(req.rng.randrange(BS, 12 * BS))
    for _ in range(4):
        req.compress()
        assert req.read() == req.expected
        positions = req.pages.positions(req.length)  # cells hold their own positions: so must positions()
        assert positions.shape[2] == int(req.pages.lengths(req.length).max())
        assert [[row[row >= 0].tolist() for row in layer] for layer in positions] == req.expected
        assert [[int((row < 0).sum()) for row in layer] for layer in positions] == \
            [[positions.shape[2] - len(held) for held in layer] for layer in req.expected]  # padding on the left
        for _ in range(req.rng.randrange(1, 3 * BS)):
            req.append(1)
            assert req.read() == req.expected


def test_a_table_is_rebuilt_only_when_the_tail_enters_another_block():
    """Decode reuses a request's page table (the same tensor) until its tail needs a new block;
    every table equals one built from scratch."""
    req = SimRequest(5)
    req.append(5 * BS + 1)
    req.compress()
    table = req.pages.tables(req.blocks, req.length)
    for _ in range(3 * BS):
        blocks_before = -(-req.length // BS)
        req.append(1)
        again = req.pages.tables(req.blocks, req.length)
        assert (again is table) == (-(-req.length // BS) == blocks_before)
        assert torch.equal(again, dataclasses.replace(req.pages).tables(req.blocks, req.length))  # no memo
        table = again


def test_blocks_held_are_the_packed_pages_plus_the_tail():
    req = SimRequest(0)
    req.append(10 * BS + 3)  # 11 blocks, residue 3
    kept = [[torch.arange(BS + 3) for _ in range(H)] for _ in range(L)]  # one packed page per head
    move, pages = req.pages.compact(kept, torch.tensor(req.blocks), req.length)
    assert pages.tail_col == 10
    assert pages.first_live_col == 10 - 1  # L * H = 6 pages fit one block
    assert pages.counts.tolist() == [[1] * H] * L
    assert sorted(pages.packed.flatten().tolist()) == sorted(
        req.geometry.page_ids(torch.tensor([req.blocks[9]])).flatten().tolist())
    assert len(move) > 0


def test_counts_off_the_page_grid_are_refused():
    req = SimRequest(1)
    req.append(3 * BS + 1)
    kept = [[torch.arange(2) for _ in range(H)] for _ in range(L)]  # 2 is not ≡ 1 (mod 4)
    with pytest.raises(ValueError, match="mod"):
        req.pages.compact(kept, torch.tensor(req.blocks), req.length)


def test_each_head_packs_into_its_own_pages_first():
    """Equal counts: every head's packed pages are its own page of each packed block, in block
    order (the stride vLLM's kernel reads for an uncompressed request). Unequal counts: a head
    within K keeps to its own pages, the others take the pages left over, none twice."""
    req = SimRequest(2)
    req.append(12 * BS + 1)
    kept = [[torch.arange(3 * BS + 1) for _ in range(H)] for _ in range(L)]  # 3 pages per head
    _, pages = req.pages.compact(kept, torch.tensor(req.blocks), req.length)
    own = req.geometry.page_ids(torch.tensor(req.blocks[12 - 3 : 12]))  # [L, H, 3]
    assert torch.equal(pages.packed, own)

    req = SimRequest(3)
    req.append(12 * BS + 1)
    counts = [[1, 5], [3, 0], [2, 4]]  # 15 pages: K = ceil(15 / 6) = 3 blocks
    kept = [[torch.arange(c * BS + 1) for c in row] for row in counts]
    _, pages = req.pages.compact(kept, torch.tensor(req.blocks), req.length)
    own = req.geometry.page_ids(torch.tensor(req.blocks[12 - 3 : 12]))
    used = [p for layer in range(L) for head in range(H) for p in pages.packed[layer, head, : counts[layer][head]].tolist()]
    assert len(used) == len(set(used)) == 15 and set(used) <= set(own.flatten().tolist())
    for layer in range(L):
        for head in range(H):
            c = counts[layer][head]
            assert pages.packed[layer, head, : min(c, 3)].tolist() == own[layer, head, : min(c, 3)].tolist()


def test_a_decode_recompression_moves_only_the_pages_it_must():
    """After 6 packed pages per head, a page of decode and an eviction of one page's worth of
    cells from the middle: every whole page past the evicted run stays where it is (as does the
    last kept cell, already in the tail). What moves is the oldest column's page (its column
    goes back) and the one cell the run's page needs from before it: BS + 1 cells per head, not
    every kept cell."""
    req = SimRequest(4)
    req.append(12 * BS + 1)
    kept = [[torch.arange(6 * BS + 1) + 6 * BS for _ in range(H)] for _ in range(L)]
    move, req.pages = req.pages.compact(kept, torch.tensor(req.blocks), req.length)
    req.cells[move.dst_pages, move.dst_offsets] = req.cells[move.src_pages, move.src_offsets].clone()
    req.expected = [[list(range(6 * BS, 12 * BS + 1)) for _ in range(H)] for _ in range(L)]
    req.append(BS)
    assert req.read() == req.expected
    evicted = torch.arange(2 * BS + 1, 3 * BS + 1)
    live = 7 * BS + 1
    keep = torch.tensor([i for i in range(live) if i not in set(evicted.tolist())])
    kept = [[keep for _ in range(H)] for _ in range(L)]
    req.expected = [[[held[i] for i in keep.tolist()] for held in layer] for layer in req.expected]
    before = req.pages.first_live_col
    move, req.pages = req.pages.compact(kept, torch.tensor(req.blocks), req.length)
    req.cells[move.dst_pages, move.dst_offsets] = req.cells[move.src_pages, move.src_offsets].clone()
    assert req.pages.first_live_col == before + 1
    for block in req.blocks[before : req.pages.first_live_col]:
        req.cells[req.geometry.page_ids(torch.tensor([block])).flatten()] = -7
    assert len(move) == L * H * (BS + 1)
    assert req.read() == req.expected


def test_staged_moves_read_first_only_the_cells_something_overwrites():
    """``Move.staged``: every move once, in order within each part; first exactly the moves whose
    source cell is some move's destination (found cell by cell when the plan did not mark
    them); a move into fresh pages (copy-on-compress) reads none first."""
    gen = torch.Generator().manual_seed(4)
    bs, n = 4, 50
    cells = torch.randperm(40 * bs, generator=gen)
    src, dst = cells[:n], torch.cat([cells[n - 20 : n], cells[n : n + 30]])  # 20 sources are destinations
    ordered, first = Move(src // bs, src % bs, dst // bs, dst % bs).staged(bs)
    clobbered = torch.isin(src, dst)
    assert first == 20
    assert torch.equal(ordered.src_pages * bs + ordered.src_offsets, torch.cat([src[clobbered], src[~clobbered]]))
    assert torch.equal(ordered.dst_pages * bs + ordered.dst_offsets, torch.cat([dst[clobbered], dst[~clobbered]]))
    assert Move(src // bs, src % bs, dst // bs + 1000, dst % bs).staged(bs)[1] == 0
