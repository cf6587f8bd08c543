"""H2O: accumulated attention carried across compressions, no double counting."""

from __future__ import annotations

import torch

from vllm_kvcomp.policies.base import LayerKV, RequestState
from vllm_kvcomp.policies.h2o import H2O


def _group_attention(queries, qpos, keys, kpos) -> torch.Tensor:
    """[N] attention summed over the given queries, averaged over query heads (one KV head).

    queries [H_q, w, D], qpos [w], keys [N, D], kpos [N]; causal by logical position.
    """
    total = torch.zeros(keys.shape[0])
    scale = keys.shape[-1] ** -0.5
    for head in queries:
        for q, p in zip(head, qpos.tolist()):
            visible = kpos <= p
            logits = (keys[visible] @ q) * scale
            total[visible] += logits.softmax(0)
    return total / queries.shape[0]


def test_accumulators_over_two_compressions():
    gen = torch.Generator().manual_seed(0)
    dim, group = 6, 2
    policy = H2O(budget=12, window=6, interval=4, sink=1)
    assert policy.queries_needed() == 6
    keys = torch.randn(1, 30, dim, generator=gen) * 2
    values = torch.randn(1, 30, dim, generator=gen)
    pos = torch.arange(30)
    queries = torch.randn(group, 30, dim, generator=gen) * 2
    qpos = torch.arange(30)

    state = RequestState()
    kv = LayerKV(keys, values, positions=pos.unsqueeze(0), queries=queries[:, -6:], query_positions=qpos[-6:])
    acc1 = _group_attention(queries[:, -6:], qpos[-6:], keys[0], pos)
    assert torch.allclose(policy.score(kv, RequestState()), acc1.unsqueeze(0), atol=1e-5)
    idx = policy.select_layer(kv, state).indices[0]
    assert len(idx) == 12 and 0 in idx.tolist() and idx[-6:].tolist() == list(range(24, 30))
    middle = [i for i in range(1, 24) if i not in idx.tolist()]
    assert min(acc1[i] for i in idx[1:-6].tolist()) >= max(acc1[i] for i in middle)

    # four decode tokens, then the second compression: queries 28, 29 were counted already
    keys2 = torch.cat([keys[:, idx], torch.randn(1, 4, dim, generator=gen) * 2], 1)
    values2 = torch.cat([values[:, idx], torch.randn(1, 4, dim, generator=gen)], 1)
    pos2 = torch.cat([pos[idx], torch.arange(30, 34)])
    queries = torch.cat([queries, torch.randn(group, 4, dim, generator=gen) * 2], 1)
    qpos = torch.arange(34)
    kv2 = LayerKV(keys2, values2, positions=pos2.unsqueeze(0), queries=queries[:, -6:], query_positions=qpos[-6:])
    carried = torch.cat([acc1[idx], torch.zeros(4)])
    expected = carried + _group_attention(queries[:, -4:], qpos[-4:], keys2[0], pos2)
    assert torch.allclose(policy.score(kv2, state), expected.unsqueeze(0), atol=1e-5)
    idx2 = policy.select_layer(kv2, state).indices[0]
    assert len(idx2) == 12
    memory = state.layer(0)["acc"]
    assert memory.positions[0].tolist() == pos2[idx2].tolist()
    assert torch.allclose(memory.values[0], expected[idx2], atol=1e-5)


def test_same_window_twice_adds_nothing():
    gen = torch.Generator().manual_seed(1)
    policy = H2O(budget=10, window=4, interval=4)
    keys, values = torch.randn(2, 20, 4, generator=gen), torch.randn(2, 20, 4, generator=gen)
    kv = LayerKV(keys, values, queries=torch.randn(2, 4, 4, generator=gen))
    state = RequestState()
    sel = policy.select_layer(kv, state)
    before = state.layer(0)["acc"].values.clone()
    idx = sel.indices
    kept = LayerKV(
        torch.stack([keys[h, idx[h]] for h in range(2)]),
        torch.stack([values[h, idx[h]] for h in range(2)]),
        positions=torch.stack(idx),
        queries=kv.queries,
        query_positions=torch.arange(16, 20),
    )
    again = policy.select_layer(kept, state)
    assert all(len(i) == 10 for i in again.indices)
    assert torch.allclose(state.layer(0)["acc"].values, before)
