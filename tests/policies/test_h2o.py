"""H2O: accumulated attention carried across compressions, no double counting."""

from __future__ import annotations

import math

import pytest
import torch

from vllm_kvcomp.policies.base import LayerKV, RequestState
from vllm_kvcomp.policies.h2o import H2O, H2OMemory


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
    idx = policy.decide([kv], state)[0].indices[0]
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
    idx2 = policy.decide([kv2], state)[0].indices[0]
    assert len(idx2) == 12
    memory = state.layer(0, H2OMemory).acc
    assert memory.positions[0].tolist() == pos2[idx2].tolist()
    assert torch.allclose(memory.values[0], expected[idx2], atol=1e-5)


def test_same_window_twice_adds_nothing():
    gen = torch.Generator().manual_seed(1)
    policy = H2O(budget=10, window=4, interval=4)
    keys, values = torch.randn(2, 20, 4, generator=gen), torch.randn(2, 20, 4, generator=gen)
    kv = LayerKV(keys, values, queries=torch.randn(2, 4, 4, generator=gen))
    state = RequestState()
    sel = policy.decide([kv], state)[0]
    before = state.layer(0, H2OMemory).acc.values.clone()
    idx = sel.indices
    kept = LayerKV(
        torch.stack([keys[h, idx[h]] for h in range(2)]),
        torch.stack([values[h, idx[h]] for h in range(2)]),
        positions=torch.stack(idx),
        queries=kv.queries,
        query_positions=torch.arange(16, 20),
    )
    again = policy.decide([kept], state)[0]
    assert all(len(i) == 10 for i in again.indices)
    assert torch.allclose(state.layer(0, H2OMemory).acc.values, before)


def test_a_recompression_attends_only_the_queries_not_yet_counted(monkeypatch):
    """Decode recompressions count ``interval`` new queries of a ``window`` the engine captures:
    the window attention is computed for those alone (half the work at the defaults)."""
    from vllm_kvcomp.policies import h2o

    attended = []
    real = h2o.window_attention_mass
    monkeypatch.setattr(h2o, "window_attention_mass", lambda kv: attended.append(kv.window_query_positions().tolist()) or real(kv))
    gen = torch.Generator().manual_seed(2)
    policy = H2O(budget=8, window=4, interval=2)
    keys, values = torch.randn(1, 20, 4, generator=gen), torch.randn(1, 20, 4, generator=gen)
    queries = torch.randn(2, 22, 4, generator=gen)
    state = RequestState()
    kv = LayerKV(keys, values, queries=queries[:, 16:20], query_positions=torch.arange(16, 20))
    idx = policy.decide([kv], state)[0].indices[0]
    grown = LayerKV(torch.cat([keys[:, idx], torch.randn(1, 2, 4, generator=gen)], 1),
                    torch.cat([values[:, idx], torch.randn(1, 2, 4, generator=gen)], 1),
                    positions=torch.cat([idx, torch.arange(20, 22)]).unsqueeze(0),
                    queries=queries[:, 18:22], query_positions=torch.arange(18, 22))
    policy.decide([grown], state)
    assert attended == [[16, 17, 18, 19], [20, 21]]


def _one_hot(positions: list[int], probs: list[float], query_pos: int, dim: int = 8) -> LayerKV:
    """One KV head holding the tokens at ``positions`` (key of position p = e_p) and one window
    query at ``query_pos`` whose attention over them is exactly ``probs`` (scale 1)."""
    keys = torch.eye(dim)[positions].unsqueeze(0)
    query = torch.full((dim,), -60.0)
    for p, prob in zip(positions, probs):
        query[p] = math.log(prob)
    return LayerKV(keys, torch.zeros_like(keys), positions=torch.tensor([positions]),
                   queries=query.view(1, 1, dim), query_positions=torch.tensor([query_pos]), scale=1.0)


def test_accumulator_is_the_sum_over_queries_as_in_the_authors_code():
    """Deviation pinned (issue #17): H2O's code sums attention over queries
    (``attn_weights.sum(0).sum(1)``, added up step by step); kvpress's ObservedAttentionPress
    divides by the number of queries that saw the token.

    Prefill of 6 tokens, budget 4, window 1: query 5 gives 0.08, 0.4, 0.3, 0.12, 0.05, 0.05 ->
    keep 1, 2, 3 (heaviest) + 5 (window). Decode token 6: query 6 gives positions 1, 2, 3, 5, 6
    0.1, 0.05, 0.05, 0.2, 0.6 -> sums 0.5, 0.35, 0.17, 0.25, 0.6 (kvpress: 0.25, 0.175, 0.085,
    0.125, 0.6) -> keep 1, 2, 5 + 6.
    """
    policy = H2O(budget=4, window=1, interval=1)
    state = RequestState()
    first = _one_hot([0, 1, 2, 3, 4, 5], [0.08, 0.4, 0.3, 0.12, 0.05, 0.05], 5)
    assert policy.decide([first], state)[0].indices[0].tolist() == [1, 2, 3, 5]
    second = _one_hot([1, 2, 3, 5, 6], [0.1, 0.05, 0.05, 0.2, 0.6], 6)
    assert policy.score(second, state)[0].tolist() == pytest.approx([0.5, 0.35, 0.17, 0.25, 0.6],
                                                                    abs=1e-6)
    kept = policy.decide([second], state)[0].indices[0]
    assert second.positions[0, kept].tolist() == [1, 2, 5, 6]


@pytest.mark.parametrize(("ratio", "n", "kept", "truncated"), [
    (0.25, 10, 3, 2),   # ceil(2.5) = 3; H2O / kvpress int(2.5) = 2
    (0.3, 10, 3, 3),    # 0.3·10 = 3.0000000000000004: no spurious 4th token
    (0.5, 64, 32, 32),
])
def test_budget_rounds_up_where_the_references_truncate(ratio, n, kept, truncated):
    """Deviation pinned (issue #17): kept per head = ceil(ratio · N), a floor on what is kept."""
    gen = torch.Generator().manual_seed(2)
    kv = LayerKV(torch.randn(1, n, 4, generator=gen), torch.randn(1, n, 4, generator=gen),
                 queries=torch.randn(1, 1, 4, generator=gen))
    assert int(ratio * n) == truncated
    assert len(H2O(ratio=ratio, window=1).decide([kv], RequestState())[0].indices[0]) == kept


def test_every_layer_at_once_scores_and_remembers_as_each_layer_alone():
    """``decide`` over several layers (their memories looked up in one search and remembered in
    one gather, heads of unequal widths across layers) keeps and remembers what each layer decided
    alone keeps and remembers, over two compressions."""
    gen = torch.Generator().manual_seed(3)
    policy = H2O(budget=8, window=4, interval=4)

    def layer(index, keys, positions):  # the window: the last 4 positions
        last = int(positions.max()) + 1
        return LayerKV(keys, None, layer=index, num_layers=2, positions=positions,
                       queries=torch.randn(4, 4, 4, generator=gen), query_positions=torch.arange(last - 4, last))

    first = [layer(i, torch.randn(2, n, 4, generator=gen), torch.arange(n).expand(2, n)) for i, n in enumerate((20, 14))]
    together, apart = RequestState(), [RequestState(), RequestState()]
    kept = policy.decide(first, together)
    alone = [policy.decide([kv], state)[0] for kv, state in zip(first, apart)]
    second = []
    for kv, sel, new in zip(first, kept, (4, 6)):
        assert [i.tolist() for i in sel.indices] == [i.tolist() for i in alone[kv.layer].indices]
        idx = torch.stack(sel.indices)
        positions = torch.cat([kv.positions.gather(1, idx), torch.arange(new).expand(2, new) + kv.num_slots], 1)
        keys = torch.cat([kv.keys.gather(1, idx.unsqueeze(-1).expand(-1, -1, 4)), torch.randn(2, new, 4, generator=gen)], 1)
        second.append(layer(kv.layer, keys, positions))
    kept = policy.decide(second, together)
    alone = [policy.decide([kv], state)[0] for kv, state in zip(second, apart)]
    for kv, sel, own, state in zip(second, kept, alone, apart):
        assert [i.tolist() for i in sel.indices] == [i.tolist() for i in own.indices]
        mine, theirs = together.layer(kv.layer, H2OMemory), state.layer(kv.layer, H2OMemory)
        assert mine.counted == theirs.counted == int(kv.query_positions.max())
        assert torch.equal(mine.acc.positions, theirs.acc.positions)
        torch.testing.assert_close(mine.acc.values, theirs.acc.values, rtol=0, atol=0)


def test_observed_attention_stands_for_the_window_and_reads_no_keys():
    """A decode recompression given ``observed`` (the engine's kernel summed every decode query's
    attention) adds it in place of attending its window: the same accumulators as attending
    those queries, with keys that are NaN (nothing read back), and its counted position moves to
    ``observed_through`` so that a later window counts none of them again."""
    gen = torch.Generator().manual_seed(3)
    dim, group = 8, 3
    policy = H2O(budget=10, window=4, interval=4)
    keys = torch.randn(1, 24, dim, generator=gen) * 2
    queries = torch.randn(group, 24, dim, generator=gen) * 2
    pos = torch.arange(24)
    state = RequestState()
    prompt = LayerKV(keys[:, :16], None, positions=pos[:16].unsqueeze(0), queries=queries[:, 12:16],
                     query_positions=pos[12:16])
    idx = policy.decide([prompt], state)[0].indices[0]
    kept_keys = torch.cat([keys[:, idx], keys[:, 16:]], 1)
    kept_pos = torch.cat([pos[idx], pos[16:]])
    decode = _group_attention(queries[:, 16:], pos[16:], kept_keys[0], kept_pos)  # 8 queries, the window has 4
    window = LayerKV(kept_keys, None, positions=kept_pos.unsqueeze(0), queries=queries[:, 20:], query_positions=pos[20:])
    observed = LayerKV(torch.full_like(kept_keys, float("nan")), None, positions=kept_pos.unsqueeze(0),
                       queries=queries[:, 20:], query_positions=pos[20:], observed=decode.unsqueeze(0),
                       observed_through=23)
    carried = torch.cat([policy.score(prompt, RequestState())[0, idx], torch.zeros(8)])
    seen = policy.score(observed, state)
    torch.testing.assert_close(seen, (carried + decode).unsqueeze(0))
    windowed = policy.score(window, state)  # the last 4 queries only
    assert not torch.allclose(windowed, seen)
    policy.decide([observed], state)
    assert state.layer(0, H2OMemory).counted == 23
