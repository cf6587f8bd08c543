"""SAGE-KV: Appendix A.2 budget split, union of per-query-head top-k, decode pinning."""

from __future__ import annotations

import pytest
import torch

from vllm_kvcomp.policies.base import LayerKV, RequestState
from vllm_kvcomp.policies.sagekv import SageKV, sagekv_split


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
    sel = SageKV(budget=budget).select_layer(kv, state)
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
    sel = SageKV(budget=budget).select_layer(kv, RequestState())
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
    idx = policy.select_layer(kv, state).indices[0]
    sink, _, recent = sagekv_split(40, 2)
    selected = [p for p in positions[0, idx].tolist() if sink <= p < 150 - recent]
    for _ in range(3):
        kv, positions = _grow(kv, positions, idx, 8, gen)
        assert policy.due(state, kv.num_slots, 8)
        idx = policy.select_layer(kv, state).indices[0]
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
    idx = policy.select_layer(kv, state).indices[0]
    assert len(idx) == 20 and "pinned" not in state.layer(0)
    kv, positions = _grow(kv, positions, idx, 20, gen)
    idx = policy.select_layer(kv, state).indices[0]
    sink, k, recent = sagekv_split(32, 1)
    attn = _last_attention(kv)[0, sink : 40 - recent]
    expected = {sink + int(i) for i in attn.topk(k).indices}
    assert set(idx.tolist()) == set(range(sink)) | expected | set(range(40 - recent, 40))
    assert "pinned" in state.layer(0)
