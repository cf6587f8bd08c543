"""AdaKV-style adaptive heads, explicit layer budgets, and the ``heads`` spec extra."""

from __future__ import annotations

import math

import pytest
import torch

from vllm_kvcomp.params import SpecError
from vllm_kvcomp.policies.base import LayerKV, RequestState, SlotMemory
from vllm_kvcomp.policies.h2o import H2O, H2OMemory
from vllm_kvcomp.policies.knorm import KNorm
from vllm_kvcomp.policies.snapkv import SnapKV
from vllm_kvcomp.policies.wrappers import AdaptiveHeads, LayerBudgets, adaptive_topk
from vllm_kvcomp.spec import CompressionSpec


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize(("sink", "window", "floor"), [(0, 0, 0.2), (2, 3, 0.2), (1, 1, 0.0), (0, 0, 1.0)])
def test_adaptive_topk_global_cut(seed, sink, window, floor):
    gen = torch.Generator().manual_seed(seed)
    heads, n, budget = 4, 40, 10
    scores = torch.randn(heads, n, generator=gen) * torch.tensor([[0.1], [1.0], [3.0], [0.5]])
    lengths = torch.tensor([40, 25, 8, 40])
    kept = adaptive_topk(scores, budget, lengths, sink, window, floor)
    assert sum(len(k) for k in kept) == min(budget * heads, int(lengths.sum()))  # the layer's H·B
    base = min(budget, max(sink + window, math.ceil(floor * budget)))
    extra_kept, dropped = [], []
    for h, idx in enumerate(kept):
        length = int(lengths[h])
        start = n - length
        assert len(idx) >= min(base, length)
        assert idx.min() >= start and bool((idx[1:] > idx[:-1]).all())
        assert set(range(start, start + min(sink, length))) <= set(idx.tolist())
        if length > sink + window:
            assert set(range(n - window, n)) <= set(idx.tolist())
        # slots beyond the head's own floor compete globally
        live = list(range(start + sink, n - window))
        own = sorted(live, key=lambda s: -float(scores[h, s]))[: max(0, base - sink - window)]
        extra_kept += [float(scores[h, s]) for s in idx.tolist() if s in live and s not in own]
        dropped += [float(scores[h, s]) for s in live if s not in set(idx.tolist())]
    if extra_kept and dropped:
        assert min(extra_kept) >= max(dropped)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize(("n", "budget", "sink", "window"), [(200, 50, 0, 0), (203, 61, 4, 8), (97, 30, 2, 16)])
def test_adaptive_topk_on_the_page_grid_holds_the_layer_total(seed, n, budget, sink, window):
    """On the engine's grid every head keeps ≡ residue (mod page) slots (or its whole length),
    the layer total stays within one page above the plain allocation's (not one per head), and
    a head whose count moved keeps its best slots: a superset of its plain picks or a subset."""
    page = 8
    gen = torch.Generator().manual_seed(seed)
    heads = 6
    scores = torch.randn(heads, n, generator=gen) * torch.linspace(0.2, 3.0, heads).view(heads, 1)
    lengths = torch.tensor([n] * (heads - 1) + [n - 3 * page])  # all ≡ the residue, as in the engine
    quantum = (page, n % page)
    plain = adaptive_topk(scores, budget, lengths, sink, window)
    snapped = adaptive_topk(scores, budget, lengths, sink, window, quantum=quantum)
    total = sum(len(k) for k in plain)
    assert 0 <= sum(len(k) for k in snapped) - total < page
    for h, (mine, base) in enumerate(zip(snapped, plain)):
        assert len(mine) == int(lengths[h]) or len(mine) % page == quantum[1]
        assert set(mine.tolist()) <= set(base.tolist()) or set(base.tolist()) <= set(mine.tolist())
    rounded_up = sum(min(int(lengths[h]), len(k) + (quantum[1] - len(k)) % page) for h, k in enumerate(plain))
    assert sum(len(k) for k in snapped) <= rounded_up  # what the engine held before, at most


def test_adaptive_recompression_keeps_the_layer_total(fake_request):
    """Through decode recompressions the layer keeps H·B: a head given little at the prompt (and
    so holding less than B) leaves the rest to the others instead of shrinking the total."""
    policy = CompressionSpec.from_header("policy=h2o; budget=24; window=2; heads=adaptive; interval=4").build_policy()
    request = fake_request(120, 4, 2, seed=11)
    for layer in range(request.num_layers):
        request.keys[layer][0] *= 6  # head 0 attends sharply: AdaKV gives it less than B
    state = RequestState(prompt_len=120)
    request.apply(policy.decide(request.inputs(policy), state))
    totals = []
    for step in range(1, 25):
        request.decode_step()
        if step % 4 == 0 and policy.due(state, request.max_live(), 4):
            selections = policy.decide(request.inputs(policy), state)
            totals += [int(sel.counts().sum()) for sel in selections]
            request.apply(selections)
            assert min(sel.counts().min() for sel in selections) < 24  # some head holds less than B
    assert totals and all(t == 4 * 24 for t in totals), totals


@pytest.mark.parametrize("heads", ["uniform", "adaptive"])
def test_recompression_waits_a_page_past_the_largest_allotment(fake_request, heads):
    """On the engine's page grid a decode recompression is due once the longest head is a page
    past what it was given, adaptive or not: every head grows alike, so the layer then frees a
    page a head. Before, an adaptive head given more than B made every interval due (half the
    cut freed nothing but moved slots between heads, twice the decode cost of uniform)."""
    page, prompt = 8, 120
    policy = CompressionSpec.from_header(f"policy=h2o; budget=24; window=2; heads={heads}; interval=4").build_policy()
    request = fake_request(prompt, 4, 2, seed=11)
    for layer in range(request.num_layers):
        request.keys[layer][0] *= 6  # head 0 attends sharply: adaptive heads give it more or less than B
    state = RequestState(prompt_len=prompt)
    state.page_quantum = (page, prompt % page)
    request.apply(policy.decide(request.inputs(policy), state))
    assert state.allotted == max(len(idx) for layer in range(request.num_layers) for idx in request.positions[layer])
    due_at, freed = [], []
    for step in range(1, 49):
        request.decode_step()
        if step % 4 == 0 and policy.due(state, request.max_live(), 4):
            before = sum(sum(request.lengths(layer)) for layer in range(request.num_layers))
            state.page_quantum = (page, (prompt + step) % page)
            request.apply(policy.decide(request.inputs(policy), state))
            due_at.append(step)
            freed.append(before - sum(sum(request.lengths(layer)) for layer in range(request.num_layers)))
    assert due_at == [8, 16, 24, 32, 40, 48], due_at  # a page of growth each time
    assert all(f >= page * request.num_layers for f in freed), freed  # each frees at least a page a layer


def test_floor_one_is_uniform():
    scores = torch.randn(3, 20)
    lengths = torch.full((3,), 20)
    kept = adaptive_topk(scores, 6, lengths, 0, 0, floor=1.0)
    assert [len(k) for k in kept] == [6, 6, 6]


def test_heads_adaptive_through_the_spec():
    keys = torch.randn(3, 60, 8) * torch.tensor([0.2, 1.0, 5.0]).view(3, 1, 1)
    kv = LayerKV(keys, torch.randn(3, 60, 8))
    policy = CompressionSpec.from_header("policy=knorm; budget=10; heads=adaptive").build_policy()
    counts = policy.decide([kv], RequestState())[0].counts().tolist()
    assert sum(counts) == 30 and len(set(counts)) > 1
    assert counts[2] == 2  # big keys lose: the head only keeps its 20 % floor
    uniform = KNorm(budget=10).decide([kv], RequestState())[0].counts().tolist()
    assert uniform == [10, 10, 10]


def test_adaptive_wrapper_commits_inner_state():
    gen = torch.Generator().manual_seed(3)
    inner = H2O(budget=8, window=2, interval=4)
    policy = AdaptiveHeads(inner)
    assert policy.RECOMPRESSES and policy.queries_needed() == 4
    kv = LayerKV(torch.randn(2, 30, 4, generator=gen), torch.randn(2, 30, 4, generator=gen),
                 queries=torch.randn(4, 4, 4, generator=gen))
    state = RequestState()
    sel = policy.decide([kv], state)[0]
    assert sum(sel.counts().tolist()) == 16
    memory = state.layer(0, H2OMemory).acc
    assert isinstance(memory, SlotMemory)
    for h, idx in enumerate(sel.indices):
        assert memory.positions[h][memory.positions[h] >= 0].tolist() == idx.tolist()


def test_wrapper_recompresses_as_its_inner_policy_says():
    assert not AdaptiveHeads(KNorm()).recompresses
    assert AdaptiveHeads(KNorm(decode="recompress")).recompresses
    assert not AdaptiveHeads(H2O(budget=8, decode="keep")).recompresses


def test_wrapper_reads_what_its_inner_policy_reads():
    """The engine reads values back (half a recompression's bytes) only for a policy that reads them."""
    assert not AdaptiveHeads(KNorm()).READS_VALUES
    assert not LayerBudgets(SnapKV(), budgets=(5, 20)).READS_VALUES


def test_wrapper_needs_a_score_policy():
    with pytest.raises(SpecError, match="inner"):
        AdaptiveHeads(None)
    with pytest.raises(SpecError, match="floor"):
        AdaptiveHeads(KNorm(), floor=2.0)


def test_layer_budgets():
    gen = torch.Generator().manual_seed(4)
    layers = [
        LayerKV(torch.randn(2, 50, 8, generator=gen), torch.randn(2, 50, 8, generator=gen), layer=i, num_layers=3,
                queries=torch.randn(2, 4, 8, generator=gen))
        for i in range(3)
    ]
    policy = LayerBudgets(SnapKV(window=4, kernel=3), budgets=(5, 20, 60))
    state = RequestState()
    counts = [sel.counts().tolist() for sel in policy.decide(layers, state)]
    assert counts == [[5, 5], [20, 20], [50, 50]]
    assert state.budget == 60
    with pytest.raises(SpecError, match="budgets"):
        LayerBudgets(SnapKV(), budgets=(5,)).decide(layers, RequestState())
    with pytest.raises(SpecError, match="budgets"):
        LayerBudgets(SnapKV(), budgets=(5, 0, 3))


def _layers_of_unequal_widths(seed: int) -> list[LayerKV]:
    """Four layers as a decode recompression reads them: widths differ, a layer's heads hold
    unequal lengths (right-aligned), and the scores tie (keys rounded)."""
    gen = torch.Generator().manual_seed(seed)
    layers = []
    for layer, width in enumerate((40, 27, 40, 33)):
        lengths = torch.tensor([width, width - int(torch.randint(0, 9, (1,), generator=gen)), width - 5])
        keys = (torch.randn(3, width, 4, generator=gen) * 2).round() / 2
        layers.append(LayerKV(keys, torch.randn(3, width, 4, generator=gen), layer=layer, num_layers=4, lengths=lengths,
                              queries=torch.randn(6, 4, 4, generator=gen)))
    return layers


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("heads", ["uniform", "adaptive"])
@pytest.mark.parametrize("quantum", [None, (8, 3)])
def test_one_allocation_for_every_layer_keeps_what_layer_by_layer_keeps(seed, heads, quantum):
    """A score policy allocates every layer at once (one sort of all the layers' heads); each
    layer keeps what deciding it alone keeps, page rounding included (it reads each layer's part
    of the shared order), with per-layer budgets too."""
    layers = _layers_of_unequal_widths(seed)
    for policy in (SnapKV(budget=13, window=3, kernel=1, heads=heads),
                   LayerBudgets(inner=KNorm(budget=9, heads=heads), budgets=[11, 6, 17, 9])):
        together = policy.decide(layers, RequestState(page_quantum=quantum))
        alone = [policy.decide([kv], RequestState(page_quantum=quantum))[0] for kv in layers]
        assert [[idx.tolist() for idx in sel.indices] for sel in together] == \
            [[idx.tolist() for idx in sel.indices] for sel in alone]
