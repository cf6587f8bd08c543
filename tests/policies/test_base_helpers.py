"""Helpers added to the policy base: SlotMemory, keep_pinned_layers, target_budget, ScorePolicy hooks."""

from __future__ import annotations

import pytest
import torch

from tests.policies.conftest import compressions, make_policy
from vllm_kvcomp.policies import base
from vllm_kvcomp.policies.base import (
    Deferred,
    LayerKV,
    RequestState,
    Selection,
    SlotMemory,
    keep_pinned_layers,
    page_count,
    protected_topk,
    round_to_pages,
    window_attention,
    window_attention_mass,
    window_logits,
)
from vllm_kvcomp.policies.streamingllm import StreamingLLM


@pytest.fixture(params=["table", "search"])
def lookup_by(request, monkeypatch) -> str:
    """SlotMemory.lookup by its position table, or by binary search (a table too large)."""
    if request.param == "search":
        monkeypatch.setattr(base, "DENSE_LOOKUP", 0)
    return request.param


def test_slot_memory_follows_positions(lookup_by):
    values = torch.arange(12, dtype=torch.float32).view(2, 6)
    positions = torch.tensor([[-1, -1, 3, 5, 8, 9], [10, 11, 12, 13, 14, 15]])
    memory = SlotMemory.kept(values, positions, [torch.tensor([3, 5]), torch.tensor([0, 2, 4])])
    assert memory.positions.tolist() == [[-1, 5, 9], [10, 12, 14]]
    # a later layout: other slots, new tokens (positions 20, 21), an invalid slot
    later = torch.tensor([[-1, 5, 9, 20], [10, 12, 14, 21]])
    looked = memory.lookup(later, fill=-7.0)
    assert looked.tolist() == [[-7.0, 3.0, 5.0, -7.0], [6.0, 8.0, 10.0, -7.0]]


@pytest.mark.parametrize("in_order", [True, False])
@pytest.mark.parametrize("ragged", [True, False])
@pytest.mark.parametrize("seed", range(4))
def test_slot_memory_of_all_heads_at_once_matches_one_head_at_a_time(seed, ragged, in_order):
    """Ragged and empty heads, or heads keeping as many; sorted kept indices of ascending
    positions (the engine's: nothing to sort), or unsorted ones of positions not in slot order."""
    gen = torch.Generator().manual_seed(seed)
    heads, n = 5, 40
    values = torch.randn(heads, n, generator=gen, dtype=torch.float64)
    positions = torch.stack([torch.randperm(200, generator=gen)[:n] for _ in range(heads)])
    counts = torch.randint(0, n, (heads,), generator=gen).tolist() if ragged else [7 + seed] * heads
    indices = [torch.randperm(n, generator=gen)[:k] for k in counts]
    if in_order:
        positions, indices = positions.sort(dim=1).values, [idx.sort().values for idx in indices]
    if ragged:
        indices[seed % heads] = torch.tensor([], dtype=torch.long)
    memory = SlotMemory.kept(values, positions, indices)
    width = max(len(i) for i in indices)
    assert memory.positions.shape == memory.values.shape == (heads, width)
    for h, idx in enumerate(indices):
        order = torch.argsort(positions[h, idx])
        pad = width - len(idx)
        assert memory.positions[h, :pad].eq(-1).all() and memory.values[h, :pad].eq(0).all()
        assert torch.equal(memory.positions[h, pad:], positions[h, idx][order])
        assert torch.equal(memory.values[h, pad:], values[h, idx][order])


def test_empty_slot_memory():
    memory = SlotMemory.kept(torch.zeros(1, 3), torch.arange(3).view(1, 3), [torch.tensor([], dtype=torch.long)])
    assert memory.lookup(torch.arange(3).view(1, 3)).tolist() == [[0.0, 0.0, 0.0]]


def test_keep_pinned():
    kv = LayerKV(torch.zeros(1, 12, 2), torch.zeros(1, 12, 2))
    pinned = torch.zeros(1, 12, dtype=torch.bool)
    pinned[0, [4, 6]] = True
    (chosen, priority, holds_pins), = keep_pinned_layers([kv], [pinned], [2], [7])
    assert chosen[0].tolist() == [0, 1, 4, 6, 9, 10, 11] and holds_pins
    scores = priority.scores
    assert scores.shape == (1, 12) and bool(scores[0, 4] > scores[0, 11] > scores[0, 10])


def _remembered(memory: SlotMemory) -> list[set[int]]:
    return [set(row[row >= 0].tolist()) for row in memory.positions]


@pytest.mark.parametrize("name", ["sagekv", "entropy"])
def test_a_slide_that_must_drop_pins_remembers_the_kept_ones_only(name, fake_request):
    """A pin memory keeps what its slides keep: when a slide must drop pinned tokens (its budget
    cut below sink + pins here, which the policies' own budgets never ask), the memory forgets
    exactly those, and remembers every pin it kept; a slide that keeps every pin leaves it as is."""
    policy = make_policy(name, ratio=0.5)
    before: dict[int, list[set[int]]] = {}
    lost = 0
    for i, done in enumerate(compressions(policy, fake_request(64, 2, 3, seed=3), decode_steps=40)):
        memories = {kv.layer: done.state.layers[kv.layer] for kv in done.layers}
        if i == 0:  # the first selection pinned; cut every layer's budget to its sink + 1
            before = {layer: _remembered(memory.pinned) for layer, memory in memories.items()}
            done.state.budget = 1 + max(memory.sink for memory in memories.values())
            for memory in memories.values():
                if hasattr(memory, "budget"):
                    memory.budget = memory.sink + 1
            continue
        for kv, sel in zip(done.layers, done.selections):
            positions = kv.slot_positions()
            for h, idx in enumerate(sel.indices):
                kept = set(positions[h, idx].tolist())
                assert _remembered(memories[kv.layer].pinned)[h] == before[kv.layer][h] & kept
                lost += len(before[kv.layer][h] - kept)
        break
    assert lost, "no slide dropped a pin"


def _random_layers(gen: torch.Generator, count: int, heads: int = 3) -> list[LayerKV]:
    """``count`` layers of unequal widths; heads of random live lengths, positions out of slot order."""
    layers = []
    for i in range(count):
        n = int(torch.randint(20, 300, (1,), generator=gen))
        lengths = torch.randint(1, n + 1, (heads,), generator=gen)
        lengths[i % heads] = n  # one head fills its layer
        positions = torch.stack([torch.randperm(2 * n, generator=gen)[:n] for _ in range(heads)])
        positions = positions.masked_fill(~base.live_mask(lengths, n), -1)
        layers.append(LayerKV(torch.zeros(heads, n, 2), None, layer=i, lengths=lengths, positions=positions))
    return layers


@pytest.mark.parametrize("seed", range(4))
def test_keep_pinned_of_every_layer_at_once_is_its_definition_per_layer(seed):
    """Per layer: priority = recency + 2·pinned (pinned first, then the most recent), its order
    the one a sort of those scores gives though none is sorted, and the picks the sink plus the
    best of that order up to ``keep``, as protected_topk of the sorted scores picks them."""
    gen = torch.Generator().manual_seed(seed)
    layers = _random_layers(gen, 5)
    pinned = [torch.rand(kv.num_kv_heads, kv.num_slots, generator=gen) < 0.2 for kv in layers]
    sinks = torch.randint(0, 6, (5,), generator=gen).tolist()
    keeps = torch.randint(1, 120, (5,), generator=gen).tolist()
    out = keep_pinned_layers(layers, pinned, sinks, keeps)
    for kv, pins, sink, keep, (chosen, priority, holds_pins) in zip(layers, pinned, sinks, keeps, out):
        n = kv.num_slots
        scores = (torch.arange(n, dtype=torch.float32) / n).expand(kv.num_kv_heads, -1) + 2.0 * pins.float()
        assert torch.equal(priority.scores, scores)
        assert torch.equal(priority.order, base.ranked_slots(scores))
        expected = protected_topk(scores, keep, kv.valid_lengths(), sink, 0)
        assert [c.tolist() for c in chosen] == [e.tolist() for e in expected]
        assert holds_pins == all(set(torch.nonzero(p).flatten().tolist()) <= set(c.tolist()) for p, c in zip(pins, chosen))


@pytest.mark.parametrize("seed", range(4))
def test_slot_memory_of_every_layer_at_once_matches_one_layer_at_a_time(seed, lookup_by):
    """kept_layers and lookup_layers: the stacked rows give each layer what kept and lookup
    give it alone (layers of unequal widths and kept counts, one layer keeping nothing)."""
    gen = torch.Generator().manual_seed(seed)
    layers = _random_layers(gen, 4)
    values = [torch.randn(kv.num_kv_heads, kv.num_slots, generator=gen) for kv in layers]
    indices = []
    for i, kv in enumerate(layers):
        counts = torch.minimum(kv.valid_lengths(), torch.randint(0, 60, (kv.num_kv_heads,), generator=gen))
        counts = counts * int(i != seed % len(layers))
        start = kv.num_slots - kv.valid_lengths()
        indices.append([start[h] + torch.randperm(int(kv.valid_lengths()[h]), generator=gen)[:k]
                        for h, k in enumerate(counts.tolist())])
    positions = [kv.slot_positions() for kv in layers]
    memories = SlotMemory.kept_layers(values, positions, indices)
    for memory, v, p, idx in zip(memories, values, positions, indices):
        alone = SlotMemory.kept(v, p, idx)
        assert torch.equal(memory.positions, alone.positions) and torch.equal(memory.values, alone.values)
    later = [p.roll(1, dims=1) for p in positions]  # other slots, the remembered positions among them
    found = SlotMemory.lookup_layers(memories, later, fill=-7.0)
    for memory, p, looked, v, idx, kv in zip(memories, later, found, values, indices, layers):
        assert torch.equal(looked, memory.lookup(p, fill=-7.0))
        want = torch.full_like(v, -7.0)  # by definition: each kept slot's value where its position is now
        for h, slots in enumerate(idx):
            where = (p[h].unsqueeze(1) == kv.slot_positions()[h, slots].unsqueeze(0)).nonzero()
            want[h, where[:, 0]] = v[h, slots[where[:, 1]]]
        assert torch.equal(looked, want)
    assert sum(int((looked != -7.0).sum()) for looked in found) == sum(len(i) for layer in indices for i in layer)


def test_page_rounding_adds_the_next_best_live_slots():
    quantum = (4, 3)  # kept counts must be ≡ 3 (mod 4)
    priority = torch.tensor([[9.0, 0, 5, 1, 7, 7, 2, 0], [0, 0, 0, 0, 1, 1, 3, 3]])
    kv = LayerKV(torch.zeros(2, 8, 2), torch.zeros(2, 8, 2), lengths=torch.tensor([8, 4]))  # head 1: slots [4, 8)
    pick = Selection([torch.tensor([0, 4]), torch.tensor([6])], priority=priority)
    padded = round_to_pages(pick, kv, quantum).indices
    assert padded[0].tolist() == [0, 4, 5]  # 2 -> 3 kept: slot 5 has the best free priority
    assert padded[1].tolist() == [5, 6, 7]  # 1 -> 3: slot 7, then 5 over 4 (equal priority, later slot)
    assert [page_count(k, 8, quantum) for k in (0, 3, 4, 7, 8)] == [3, 3, 7, 7, 8]
    assert round_to_pages(pick, kv, None) is pick
    recent = round_to_pages(Selection(pick.indices), kv, quantum).indices  # no priority: the most recent
    assert recent[0].tolist() == [0, 4, 7] and recent[1].tolist() == [5, 6, 7]


def test_the_layers_are_ranked_once_for_their_picks_and_their_page_rounding(monkeypatch):
    """A score policy's picks and the page rounding after them read one order: one sort of every
    layer's heads as rows (the layers' picks are allocated together)."""
    from vllm_kvcomp.policies.snapkv import SnapKV

    sorts = []
    ranked = base.ranked_slots
    monkeypatch.setattr(base, "ranked_slots", lambda scores: sorts.append(scores.shape) or ranked(scores))
    torch.manual_seed(0)
    layers = [LayerKV(torch.randn(2, 40, 4), torch.randn(2, 40, 4), queries=torch.randn(4, 8, 4), layer=i)
              for i in range(3)]
    state = RequestState(page_quantum=(8, 40 % 8))
    kept = SnapKV(budget=13, window=4, kernel=1).decide(layers, state)
    assert [k.counts().tolist() for k in kept] == [[16, 16]] * 3  # rounded: 13 -> 16 ≡ 40 (mod 8)
    assert sorts == [(6, 40)]


def test_decide_rounds_every_policys_pick_and_commits_what_is_kept():
    """A policy picks; :meth:`Policy.decide` rounds to the grid (the policy never does) and hands
    the rounded selection to :meth:`commit_kept`."""
    seen = []

    class Picky(StreamingLLM):
        def commit_kept(self, layers, state, picks, kept):
            seen.append(([p.counts().tolist() for p in picks], [k.counts().tolist() for k in kept]))

    kv = LayerKV(torch.zeros(2, 30, 2), torch.zeros(2, 30, 2))
    state = RequestState(page_quantum=(8, 30 % 8))
    (kept,) = Picky(budget=10, sink=2).decide([kv], state)
    assert kept.counts().tolist() == [14, 14]  # 10 -> 14 ≡ 30 (mod 8)
    assert seen == [([[10, 10]], [[14, 14]])]


def test_budget_above_prompt_is_kept_for_decode():
    policy = StreamingLLM(budget=100)
    state = RequestState()
    sel = policy.decide([LayerKV(torch.zeros(1, 30, 2), torch.zeros(1, 30, 2))], state)[0]
    assert sel.counts().tolist() == [30]
    assert state.budget == 100
    assert not policy.due(state, 60, 20) and policy.due(state, 101, 20)
    ratio_state = RequestState()
    StreamingLLM(ratio=0.5).decide([LayerKV(torch.zeros(1, 30, 2), torch.zeros(1, 30, 2))], ratio_state)[0]
    assert ratio_state.budget == 15


# ---------------------------------------------------------------------------- the selection helpers
# against plain per-head references: every head at once must pick what one head at a time picks


def reference_protected_topk(scores, keeps, lengths, sink, window):
    """Per head: the live sink and window slots, then the best-ranked others (ties: later slot)."""
    n = scores.shape[1]
    out = []
    for h, keep in enumerate(keeps):
        length = int(lengths[h])
        start, k = n - length, min(keep, length)
        s = min(sink, k)
        w = min(window, k - s)
        chosen = set(range(start, start + s)) | set(range(n - w, n))
        middle = sorted(range(start + s, n - w), key=lambda slot: (-float(scores[h, slot]), -slot))
        chosen |= set(middle[: k - len(chosen)]) if k < length else set(range(start, n))
        out.append(sorted(chosen))
    return out


def reference_round_to_pages(indices, priority, lengths, n, quantum):
    """Per head: the pick plus its best free live slots (the most recent without a priority)."""
    out = []
    for h, idx in enumerate(indices):
        length, picked = int(lengths[h]), set(idx.tolist())
        free = [s for s in range(n - length, n) if s not in picked]
        rank = [(0.0 if priority is None else -float(priority[h, s]), -s, s) for s in free]
        extra = page_count(len(picked), length, quantum) - len(picked)
        out.append(sorted(picked | {s for _, _, s in sorted(rank)[: max(extra, 0)]}))
    return out


def random_layer(seed: int, heads: int = 4, n: int = 37):
    """Scores with ties (a few distinct values) and ragged live lengths (a head may be empty)."""
    gen = torch.Generator().manual_seed(seed)
    scores = torch.randint(0, 5, (heads, n), generator=gen).float()
    lengths = torch.randint(0, n + 1, (heads,), generator=gen)
    lengths[0] = n
    return gen, scores, lengths


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize(("sink", "window"), [(0, 0), (2, 3), (5, 0), (0, 40)])
def test_protected_topk_matches_one_head_at_a_time(seed, sink, window):
    gen, scores, lengths = random_layer(seed)
    keeps = torch.randint(0, 45, (scores.shape[0],), generator=gen).tolist()
    got = protected_topk(scores, keeps, lengths, sink, window)
    assert [idx.tolist() for idx in got] == reference_protected_topk(scores, keeps, lengths, sink, window)
    assert all(idx.dtype == torch.long for idx in got)
    shared = protected_topk(scores[:1].expand_as(scores), 9, lengths, sink, window)  # a layer-shared ranking
    assert [idx.tolist() for idx in shared] == reference_protected_topk(scores[:1].expand_as(scores), [9] * 4,
                                                                        lengths, sink, window)


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("with_priority", [True, False])
def test_round_to_pages_matches_one_head_at_a_time(seed, with_priority):
    gen, scores, lengths = random_layer(seed)
    n = scores.shape[1]
    picks = [torch.sort(torch.randperm(int(length), generator=gen)[: int(length) // 3]).values + n - int(length)
             for length in lengths]
    kv = LayerKV(torch.zeros(4, n, 2), torch.zeros(4, n, 2), lengths=lengths)
    quantum = (8, n % 8)
    pick = Selection(picks, priority=scores if with_priority else None)
    got = round_to_pages(pick, kv, quantum)
    want = reference_round_to_pages(picks, scores if with_priority else None, lengths, n, quantum)
    assert [idx.tolist() for idx in got.indices] == want
    assert got.priority is pick.priority
    assert all(got.indices[h] is picks[h] for h in range(4) if len(want[h]) == len(picks[h]))  # untouched heads


@pytest.mark.parametrize("seed", range(6))
def test_rounding_several_layers_at_once_matches_one_head_at_a_time(seed):
    """Layers of two widths, with and without a priority, one needing nothing: each rounded as
    on its own (all in one pass)."""
    layers, picks, want = [], [], []
    for layer, (n, with_priority) in enumerate([(37, True), (37, False), (45, True), (37, True)]):
        gen, scores, lengths = random_layer(seed * 7 + layer, n=n)
        taking = (lambda length: int(length)) if layer == 3 else (lambda length: int(length) // 3)  # 3: all kept
        idx = [torch.sort(torch.randperm(int(length), generator=gen)[: taking(length)]).values + n - int(length)
               for length in lengths]
        priority = scores if with_priority else None
        layers.append(LayerKV(torch.zeros(4, n, 2), None, lengths=lengths))
        picks.append(Selection(idx, priority=priority))
        want.append(reference_round_to_pages(idx, priority, lengths, n, (8, 5)))
    got = base.round_to_pages_layers(picks, layers, (8, 5))
    assert [[idx.tolist() for idx in sel.indices] for sel in got] == want
    assert got[3] is picks[3]


@pytest.mark.parametrize("quantum", [(32, 0), (16, 5), (7, 3)])
def test_page_counts_of_every_head_at_once_are_each_heads_page_count(quantum):
    gen = torch.Generator().manual_seed(quantum[0])
    lengths = torch.randint(0, 200, (300,), generator=gen)
    kept = torch.minimum(torch.randint(0, 220, (300,), generator=gen), lengths + torch.randint(0, 2, (300,), generator=gen))
    want = [page_count(int(k), int(n), quantum) for k, n in zip(kept, lengths)]
    assert base.page_counts(kept, lengths, quantum).tolist() == want


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("quantum", [(32, 0), (16, 5), (7, 3)])
def test_snapped_budgets_sit_on_the_page_grid_with_the_same_sum_each_within_a_page(seed, quantum):
    gen = torch.Generator().manual_seed(seed)
    block_size, residue = quantum
    length = 2000
    budgets = torch.randint(40, 900, (30,), generator=gen).tolist()
    snapped = base.snap_to_pages(budgets, quantum, length)
    assert all(b % block_size == residue % block_size for b in snapped)
    assert all(abs(s - b) < block_size for s, b in zip(snapped, budgets))
    assert 0 <= sum(snapped) - sum(budgets) < block_size
    # what the engine then holds: each layer's budget rounded up to the grid = the budget itself
    assert [page_count(b, length, quantum) for b in snapped] == snapped


def test_snapping_leaves_whole_layers_and_empty_floors_and_no_grid_alone():
    assert base.snap_to_pages([100, 70], None, 1000) == [100, 70]
    assert base.snap_to_pages([1000, 70], (32, 0), 1000) == [1000, 96]  # 1000 = everything: stays
    assert base.snap_to_pages([20, 70], (32, 0), 1000) == [20, 96]  # 20 floors to 0: stays; 70 -> 64 + the missing page
    assert base.snap_to_pages([48, 48], (32, 0), 1000) == [64, 32]  # the lower layer gets the page on a tie
    assert base.snap_to_pages([50, 46], (32, 0), 1000) == [64, 32]  # the larger remainder first


@pytest.mark.parametrize("shuffled", [False, True])
@pytest.mark.parametrize("seed", [0, 1])
def test_window_logits_hide_exactly_the_padding_and_the_future(seed, shuffled):
    """Scaled q·k of every window query and slot, -inf where the slot is padding (position -1)
    or after the query (causal), against a plain loop; right-aligned heads of unequal lengths,
    positions in virtual order or shuffled (the masking must not lean on their order)."""
    gen = torch.Generator().manual_seed(seed)
    hk, group, w, n, dim = 3, 2, 5, 40, 8
    lengths = torch.tensor([40, 33, 21])
    slot = torch.arange(n).expand(hk, n) - (n - lengths).unsqueeze(1)  # < 0: left padding
    positions = (slot + 7).masked_fill(slot < 0, -1)  # live slots hold positions 7, 8, ...
    if shuffled:
        positions = positions[:, torch.randperm(n, generator=gen)]
    query_positions = torch.arange(40, 40 + w)  # slots at 41..46 are the future of some queries
    kv = LayerKV(torch.randn(hk, n, dim, generator=gen), None, lengths=lengths, positions=positions,
                 queries=torch.randn(hk * group, w, dim, generator=gen), query_positions=query_positions, scale=0.3)
    got = window_logits(kv)
    for q in range(hk * group):
        for i in range(w):
            for s in range(n):
                pos = int(positions[q // group, s])
                if pos < 0 or pos > int(query_positions[i]):
                    assert got[q, i, s] == float("-inf")
                else:
                    want = 0.3 * float(kv.queries[q, i] @ kv.keys[q // group, s])
                    assert float(got[q, i, s]) == pytest.approx(want, rel=1e-5, abs=1e-5)


@pytest.mark.parametrize("w", [base.WINDOW_ROWS, 2 * base.WINDOW_ROWS + 5])
def test_window_attention_mass_sums_the_window_a_run_of_rows_at_a_time(w, monkeypatch):
    """The window's attention summed over its queries equals the sum of the whole [H_q, w, N]
    attention, while no call attends more than WINDOW_ROWS queries (the bound of engine/memory.py);
    the causal mask follows each run's own query positions."""
    gen = torch.Generator().manual_seed(2)
    hk, group, n, dim = 2, 3, 300, 8
    kv = LayerKV(torch.randn(hk, n, dim, generator=gen), None, queries=torch.randn(hk * group, w, dim, generator=gen),
                 query_positions=torch.arange(n - w // 2 - 1, n + w - w // 2 - 1))  # the later queries see more
    want = window_attention(kv).sum(dim=1)
    widest = []
    logits = base.window_logits
    monkeypatch.setattr(base, "window_logits", lambda part: widest.append(part.queries.shape[1]) or logits(part))
    torch.testing.assert_close(window_attention_mass(kv), want)
    assert max(widest) == base.WINDOW_ROWS and sum(widest) == w


def test_deferred_keys_are_read_when_wanted_and_their_shape_is_known_before():
    """A layer given as Deferred keys: its shape (heads, slots, scale) without a read, the
    tensor read on each access, a context view still unread until wanted."""
    reads = []
    keys = torch.randn(2, 10, 4)
    kv = LayerKV(Deferred(lambda: reads.append(1) or keys, keys.shape), None)
    assert (kv.num_kv_heads, kv.num_slots, kv.softmax_scale) == (2, 10, 0.5) and not reads
    context = kv.context(6)
    assert context.num_slots == 6 and not reads
    torch.testing.assert_close(context.keys, keys[:, :6])
    torch.testing.assert_close(kv.keys, keys)
    assert len(reads) == 2
