"""SAGE-KV: Appendix A.2 budget split, union of per-query-head top-k, decode pinning."""

from __future__ import annotations

import math

import pytest
import torch

from vllm_kvcomp.policies.base import LayerKV, RequestState
from vllm_kvcomp.policies.sagekv import SageKV, SageKVMemory, sagekv_split


@pytest.mark.parametrize(("group", "expected"), [(4, (2048, 1024, 2048)), (7, (2048, 512, 2560))])
def test_appendix_a2_splits(group, expected):
    assert sagekv_split(8192, group) == expected


@pytest.mark.parametrize("budget", [1, 2, 3, 5, 17, 64, 100, 1000, 4097])
@pytest.mark.parametrize("group", [1, 2, 3, 4, 7, 8])
def test_split_sums_to_budget_and_keeps_the_last_token(budget, group):
    sink, k, recent = sagekv_split(budget, group)
    assert sink + group * k + recent == budget
    assert recent >= 1
    assert sink == budget // 4
    assert group * k <= budget // 2
    assert k == 0 or (k & (k - 1)) == 0  # a power of two


def test_sink_override_is_clamped():
    assert sagekv_split(16, 2, sink=100)[0] == 15
    assert sum(x * m for x, m in zip(sagekv_split(16, 2, sink=3), (1, 2, 1))) == 16


def _last_attention(kv: LayerKV) -> torch.Tensor:
    """[H_q, N] softmax of the last query over every key of its KV head (all positions visible)."""
    group = kv.queries.shape[0] // kv.num_kv_heads
    keys = kv.keys.repeat_interleave(group, 0)
    logits = torch.einsum("hd,hnd->hn", kv.queries[:, -1], keys) * kv.keys.shape[-1] ** -0.5
    return logits.softmax(-1)


def _layer(n: int, kv_heads: int, group: int, dim: int = 8, seed: int = 0, tie_group: bool = False) -> LayerKV:
    gen = torch.Generator().manual_seed(seed)
    queries = torch.randn(kv_heads * group, 1, dim, generator=gen) * 3
    if tie_group:  # every query head of a group identical -> top-k sets overlap completely
        queries = queries[::group].repeat_interleave(group, 0)
    return LayerKV(
        torch.randn(kv_heads, n, dim, generator=gen) * 2, torch.randn(kv_heads, n, dim, generator=gen), queries=queries
    )


@pytest.mark.parametrize("group", [1, 2, 4])
def test_keeps_union_of_per_query_head_topk(group):
    n, budget = 200, 64
    kv = _layer(n, kv_heads=2, group=group, seed=group)
    state = RequestState()
    sel = SageKV(budget=budget).decide([kv], state)[0]
    sink, k, recent = sagekv_split(budget, group)
    attn = _last_attention(kv)
    for h in range(2):
        kept = set(sel.indices[h].tolist())
        assert set(range(sink)) <= kept and set(range(n - recent, n)) <= kept and n - 1 in kept
        union = set()
        for q in range(h * group, (h + 1) * group):
            region = attn[q, sink : n - recent]
            union |= {sink + int(i) for i in region.topk(k).indices}
        middle = kept - set(range(sink)) - set(range(n - recent, n))
        assert union <= middle
        assert len(middle) == group * k
        if len(union) == group * k:
            assert middle == union


def test_overlapping_topk_fills_with_next_ranks():
    n, budget, group = 120, 32, 4
    kv = _layer(n, kv_heads=1, group=group, seed=5, tie_group=True)
    sel = SageKV(budget=budget).decide([kv], RequestState())[0]
    sink, k, recent = sagekv_split(budget, group)
    attn = _last_attention(kv)[0, sink : n - recent]
    expected = {sink + int(i) for i in attn.topk(group * k).indices}  # identical heads: plain top G·k
    kept = set(sel.indices[0].tolist())
    assert len(kept) == budget
    assert kept - set(range(sink)) - set(range(n - recent, n)) == expected


def _grow(kv: LayerKV, positions: torch.Tensor, idx: torch.Tensor, step: int, gen) -> tuple[LayerKV, torch.Tensor]:
    keys, values, pos = kv.keys[:, idx], kv.values[:, idx], positions[:, idx]
    for _ in range(step):
        keys = torch.cat([keys, torch.randn(1, 1, keys.shape[-1], generator=gen)], 1)
        values = torch.cat([values, torch.randn(1, 1, values.shape[-1], generator=gen)], 1)
        pos = torch.cat([pos, pos[:, -1:] + 1], 1)
    queries = torch.randn(kv.queries.shape[0], 1, keys.shape[-1], generator=gen)
    return LayerKV(keys, values, positions=pos, queries=queries), pos


def test_decode_keeps_sink_and_selection_while_recent_slides():
    gen = torch.Generator().manual_seed(3)
    policy = SageKV(budget=40, interval=8)
    kv = _layer(150, kv_heads=1, group=2, seed=3)
    positions = torch.arange(150).unsqueeze(0)
    state = RequestState()
    idx = policy.decide([kv], state)[0].indices[0]
    sink, _, recent = sagekv_split(40, 2)
    selected = [p for p in positions[0, idx].tolist() if sink <= p < 150 - recent]
    for _ in range(3):
        kv, positions = _grow(kv, positions, idx, 8, gen)
        assert policy.due(state, kv.num_slots, 8)
        idx = policy.decide([kv], state)[0].indices[0]
        kept = positions[0, idx].tolist()
        last = int(positions[0, -1])
        assert len(kept) == 40
        assert kept[:sink] == list(range(sink))
        assert kept[sink : sink + len(selected)] == selected
        assert kept[sink + len(selected) :] == list(range(last - recent + 1, last + 1))


def test_short_prompt_selects_at_first_decode_recompression():
    gen = torch.Generator().manual_seed(4)
    policy = SageKV(budget=32, interval=4)
    kv = _layer(20, kv_heads=1, group=1, seed=4)
    positions = torch.arange(20).unsqueeze(0)
    state = RequestState()
    idx = policy.decide([kv], state)[0].indices[0]
    assert len(idx) == 20 and state.layer(0, SageKVMemory).pinned is None
    kv, positions = _grow(kv, positions, idx, 20, gen)
    idx = policy.decide([kv], state)[0].indices[0]
    sink, k, recent = sagekv_split(32, 1)
    attn = _last_attention(kv)[0, sink : 40 - recent]
    expected = {sink + int(i) for i in attn.topk(k).indices}
    assert set(idx.tolist()) == set(range(sink)) | expected | set(range(40 - recent, 40))
    assert state.layer(0, SageKVMemory).pinned is not None


def _probs(top: dict[int, float], n: int = 20) -> list[float]:
    """A last-query distribution: ``top`` as given, the rest of the mass spread evenly."""
    rest = (1.0 - sum(top.values())) / (n - len(top))
    return [top.get(j, rest) for j in range(n)]


def test_union_per_kv_head_not_a_cache_per_query_head():
    """Deviation pinned (issue #17): the paper keeps a top-k per query head; we keep their union
    per KV head (the engine's cache is per KV head) and fill the overlap with the next ranks.

    B=16, G=2 -> sink 4, k=4, recent 4; eviction region = slots 4..15. Query head 0 ranks
    5, 6, 7, 8, then 11, then 14; query head 1 ranks 10, 9, 8, 7, then 12, then 14. The paper
    keeps {5,6,7,8} for head 0 and {7,8,9,10} for head 1: 6 distinct tokens in 8 slots. Union:
    {5..10}; the two free slots go to the next best ranks, 11 and 12 (rank 4), not to 14 (rank
    5 in both), although 14 has the larger group-mean attention (0.095 vs 0.054): a KV-head
    ranking by the group mean would keep 14 and drop 6 and 9.
    """
    head0 = _probs({5: 0.2, 6: 0.18, 7: 0.16, 8: 0.14, 11: 0.1, 14: 0.095})
    head1 = _probs({10: 0.2, 9: 0.18, 8: 0.16, 7: 0.14, 12: 0.1, 14: 0.095})
    queries = torch.tensor([[math.log(p) for p in head0], [math.log(p) for p in head1]]).unsqueeze(1)
    kv = LayerKV(torch.eye(20).unsqueeze(0), torch.zeros(1, 20, 20), queries=queries, scale=1.0)
    assert sagekv_split(16, 2) == (4, 4, 4)
    kept = SageKV(budget=16).decide([kv], RequestState())[0].indices[0].tolist()
    assert kept == [0, 1, 2, 3, 5, 6, 7, 8, 9, 10, 11, 12, 16, 17, 18, 19]
    assert {5, 6, 7, 8} <= set(kept) and {7, 8, 9, 10} <= set(kept)  # each head sees its own top-k


@pytest.mark.parametrize(("budget", "group", "expected"), [
    (24, 2, (6, 4, 10)),     # B/(2G) = 6 -> 4: the recent window takes the 4 slots
    (512, 3, (128, 64, 192)),  # SmolLM2 (G=3) at 2K, ratio 0.25: 85 -> 64
    (8192, 7, (2048, 512, 2560)),  # A.2 Qwen2.5: 585 -> 512, the paper's own number
])
def test_k_is_rounded_down_to_a_power_of_two(budget, group, expected):
    """Deviation pinned (issue #17): k = B/(2G) rounded down to a power of two (A.2's two settings)."""
    assert sagekv_split(budget, group) == expected
