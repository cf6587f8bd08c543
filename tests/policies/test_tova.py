"""TOVA: the newest query's attention, averaged per token over every query head of the layer (or
of the KV head's group), against a plain float64 implementation."""

from __future__ import annotations

import math

import pytest
import torch

from tests.policies.conftest import make_policy
from vllm_kvcomp.policies.base import LayerKV, Ranks, RequestState
from vllm_kvcomp.policies.tova import TOVA

HEADS, GROUP, N, D = 2, 3, 9, 4


def _layer(seed: int) -> tuple[LayerKV, list[list[int]]]:
    """Two ragged KV heads over positions 0..8 (both hold the newest, 8), three queries per head
    (only the last one, at position 8, may count)."""
    gen = torch.Generator().manual_seed(seed)
    held = [[0, 2, 3, 5, 6, 7, 8], [1, 2, 4, 8]]
    positions = torch.full((HEADS, N), -1, dtype=torch.long)
    for h, pos in enumerate(held):
        positions[h, N - len(pos):] = torch.tensor(pos)
    kv = LayerKV(torch.randn(HEADS, N, D, generator=gen, dtype=torch.float64),
                 torch.randn(HEADS, N, D, generator=gen, dtype=torch.float64),
                 lengths=torch.tensor([len(p) for p in held]), positions=positions,
                 queries=torch.randn(HEADS * GROUP, 3, D, generator=gen, dtype=torch.float64),
                 query_positions=torch.tensor([6, 7, 8]))
    return kv, held


def _plain_attention(kv: LayerKV, held: list[list[int]]) -> list[dict[int, float]]:
    """Per query head: {position: softmax weight of the newest query} over its KV head's tokens."""
    out = []
    for q in range(HEADS * GROUP):
        h = q // GROUP
        slots = range(N - len(held[h]), N)
        logits = [float(kv.queries[q, -1] @ kv.keys[h, s]) / math.sqrt(D) for s in slots]
        top = max(logits)
        weights = [math.exp(x - top) for x in logits]
        out.append({pos: w / sum(weights) for pos, w in zip(held[h], weights)})
    return out


def test_layer_average_is_the_mean_over_every_query_head_per_token():
    kv, held = _layer(0)
    attention = _plain_attention(kv, held)
    scores = TOVA().score(kv, RequestState())
    for h, pos in enumerate(held):
        for slot, p in zip(range(N - len(pos), N), pos):
            expected = sum(a.get(p, 0.0) for a in attention) / (HEADS * GROUP)
            assert float(scores[h, slot]) == pytest.approx(expected, rel=0, abs=1e-12)


class _Mirrored(Ranks):
    """Two tensor-parallel ranks whose heads see exactly the same attention."""

    size = 2

    def gather(self, value):
        return [value, value]


def test_layer_average_runs_over_every_ranks_heads():
    kv, _ = _layer(2)
    one = TOVA().score(kv, RequestState())
    assert torch.allclose(TOVA().score(kv, RequestState(ranks=_Mirrored())), one, rtol=1e-15, atol=0)


def test_group_average_is_the_mean_over_the_kv_heads_query_group():
    kv, held = _layer(1)
    attention = _plain_attention(kv, held)
    scores = TOVA(average="group").score(kv, RequestState())
    for h, pos in enumerate(held):
        for slot, p in zip(range(N - len(pos), N), pos):
            expected = sum(attention[q][p] for q in range(h * GROUP, (h + 1) * GROUP)) / GROUP
            assert float(scores[h, slot]) == pytest.approx(expected, rel=0, abs=1e-12)


def test_the_newest_token_is_kept_even_when_least_attended():
    keys = torch.eye(4, dtype=torch.float64).unsqueeze(0)
    query = torch.tensor([[[3.0, 2.0, 1.0, -5.0]]], dtype=torch.float64)  # attends least to the newest
    kv = LayerKV(keys, keys.clone(), queries=query, scale=1.0)
    (selection,) = TOVA(budget=2).decide([kv], RequestState())
    assert selection.indices[0].tolist() == [0, 3]


def test_layer_average_keeps_the_same_tokens_in_every_head(fake_request):
    request = fake_request(40, 3, 2, seed=8)
    for sel in make_policy("tova").decide(request.layers(1), RequestState(prompt_len=40)):
        assert all(torch.equal(idx, sel.indices[0]) for idx in sel.indices)
