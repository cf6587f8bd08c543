"""Tensor parallelism at the policy level: two simulated ranks (threads), each holding half of the
KV heads, decide exactly what one rank holding all heads decides, for every policy and variant,
through a prompt compression and decode recompressions."""

from __future__ import annotations

import threading

import pytest
import torch

from tests.policies.conftest import CASES, make_case
from vllm_kvcomp.policies.base import LayerKV, Ranks, RequestState

HEADS, GROUP = 4, 2


class ThreadRanks(Ranks):
    """``size`` ranks run as threads; ``gather`` is a barrier-synchronised exchange."""

    def __init__(self, rank: int, shared: dict):
        self.size, self.rank, self.shared = 2, rank, shared

    def gather(self, value):
        slots, barrier = self.shared["slots"], self.shared["barrier"]
        slots[self.rank] = value
        barrier.wait()
        out = list(slots)
        barrier.wait()  # nobody overwrites a slot before everyone has read it
        return out


def _half(kv: LayerKV, rank: int) -> LayerKV:
    """Rank ``rank``'s KV heads of ``kv`` (and their query heads), right-aligned to their own width."""
    heads = slice(rank * HEADS // 2, (rank + 1) * HEADS // 2)
    lengths = kv.valid_lengths()[heads]
    width = int(lengths.max())
    cut = kv.num_slots - width
    query_heads = slice(rank * HEADS * GROUP // 2, (rank + 1) * HEADS * GROUP // 2)
    queries = None if kv.queries is None else kv.queries[query_heads]
    out_proj = None if kv.out_proj is None else kv.out_proj[query_heads]  # o_proj is split by query head
    return LayerKV(kv.keys[heads, cut:], None if kv.values is None else kv.values[heads, cut:], layer=kv.layer, num_layers=kv.num_layers,
                   lengths=lengths, positions=kv.positions[heads, cut:], queries=queries,
                   query_positions=kv.query_positions, scale=kv.scale, out_proj=out_proj)


def _split_select(policy_factory, layers, states) -> list[list[torch.Tensor]]:
    """Both ranks select in threads; returns the kept positions per layer and global head."""
    results: dict[int, list] = {}

    def run(rank: int) -> None:
        halves = [_half(kv, rank) for kv in layers]
        sels = policy_factory[rank].decide(halves, states[rank])
        results[rank] = [[kv.positions[h, idx].tolist() for h, idx in enumerate(sel.indices)]
                         for kv, sel in zip(halves, sels)]

    threads = [threading.Thread(target=run, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    return [results[0][i] + results[1][i] for i in range(len(layers))]


@pytest.mark.parametrize("case", CASES)
def test_two_ranks_keep_what_one_rank_keeps(case, fake_request):
    label = case[0]
    request = fake_request(150, HEADS, GROUP, num_layers=2, seed=5)
    one = make_case(case)
    shared = {"slots": [None, None], "barrier": threading.Barrier(2)}
    ranks = [ThreadRanks(r, shared) for r in (0, 1)]
    split = [make_case(case) for _ in (0, 1)]
    whole_state = RequestState(prompt_len=150, page_quantum=(16, 150 % 16))
    states = [RequestState(prompt_len=150, page_quantum=(16, 150 % 16), ranks=ranks[r]) for r in (0, 1)]
    for step in range(40):
        if step:
            request.decode_step()
            due = one.recompresses and one.due(whole_state, request.max_live(), step)
            if not due:
                continue
            for state in (whole_state, *states):
                state.page_quantum = (16, request.next_position % 16)
        layers = request.inputs(one)
        whole = one.decide(layers, whole_state)
        expected = [[kv.positions[h, idx].tolist() for h, idx in enumerate(sel.indices)]
                    for kv, sel in zip(layers, whole)]
        assert _split_select(split, layers, states) == expected, f"{label}: ranks disagree at step {step}"
        request.apply(whole)


def test_sum_tensor_adds_every_ranks_tensor_and_one_rank_returns_its_own():
    mine = torch.arange(3.0)
    assert Ranks().sum_tensor(mine) is mine  # one rank: no copy, no trip to the host
    shared = {"slots": [None, None], "barrier": threading.Barrier(2)}
    results: dict[int, torch.Tensor] = {}

    def run(rank: int) -> None:
        results[rank] = ThreadRanks(rank, shared).sum_tensor(torch.full((3,), float(rank + 1)))

    threads = [threading.Thread(target=run, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for rank in (0, 1):
        torch.testing.assert_close(results[rank], torch.full((3,), 3.0))
