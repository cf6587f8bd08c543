"""Shared helpers for policy tests (as fixtures): a policy factory and a small engine stand-in.

``FakeRequest`` keeps, per layer and KV head, the live tokens (K, V, logical position), lays them
out right-aligned like the engine, compacts them to a policy's selection and appends decode
tokens; queries roll across prefill and decode.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from vllm_kvcomp.policies.base import LayerKV, Policy, Selection
from vllm_kvcomp.policies.registry import get_policy_class


@pytest.fixture(autouse=True)
def _one_thread():
    """The tensors here are tiny: one thread avoids OpenMP contention on shared cores (100x faster)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)

# small sizes so that short random prompts exercise every code path
TEST_OVERRIDES: dict[str, dict] = {
    "full": {},
    "streamingllm": {"sink": 3, "interval": 4},
    "snapkv": {"window": 6, "kernel": 3},
    "h2o": {"window": 4, "interval": 4},
    "knorm": {"sink": 2, "window": 3},
    "sagekv": {"interval": 4},
    "lagkv": {"sink": 4, "lag": 8},
    "entropy": {"window": 6, "interval": 4},
}

#: Policies that keep exactly min(budget, length) tokens in every head.
EQUAL_BUDGET = ("streamingllm", "snapkv", "h2o", "knorm", "sagekv")


def make_policy(name: str, **overrides) -> Policy:
    """A policy by public name with small test-friendly settings (``overrides`` win)."""
    if name in ("razor", "pod"):
        cls = get_policy_class(name)
        if name == "razor":
            return cls(retrieval_heads=frozenset({(0, 0)}), **overrides)
        return cls(groups=((0, 1),), **overrides)
    return get_policy_class(name)(**{**TEST_OVERRIDES[name], **overrides})


@dataclass
class FakeRequest:
    """Per layer, per KV head token lists plus a rolling query history."""

    keys: list[list[torch.Tensor]]  # [layer][head] -> [n_h, D]
    values: list[list[torch.Tensor]]
    positions: list[list[torch.Tensor]]  # [layer][head] -> [n_h] int64 ascending
    queries: list[torch.Tensor]  # [layer] -> [H_q, T, D]
    query_positions: torch.Tensor  # [T]
    next_position: int
    generator: torch.Generator

    @classmethod
    def random(
        cls,
        num_tokens: int,
        num_kv_heads: int = 2,
        group: int = 1,
        num_layers: int = 2,
        dim: int = 8,
        ragged: bool = False,
        seed: int = 0,
    ) -> FakeRequest:
        """Random K/V/queries; ``ragged`` gives heads random subsets of the positions (last kept)."""
        gen = torch.Generator().manual_seed(seed)
        keys, values, positions = [], [], []
        for _ in range(num_layers):
            lk, lv, lp = [], [], []
            for _ in range(num_kv_heads):
                pos = torch.arange(num_tokens)
                if ragged and num_tokens > 1:
                    count = int(torch.randint(1, num_tokens + 1, (1,), generator=gen))
                    pick = torch.randperm(num_tokens - 1, generator=gen)[: count - 1]
                    pos = torch.cat([torch.sort(pick).values, torch.tensor([num_tokens - 1])])
                lk.append(torch.randn(len(pos), dim, generator=gen) * 2)
                lv.append(torch.randn(len(pos), dim, generator=gen))
                lp.append(pos)
            keys.append(lk)
            values.append(lv)
            positions.append(lp)
        queries = [torch.randn(num_kv_heads * group, num_tokens, dim, generator=gen) * 2 for _ in range(num_layers)]
        return cls(keys, values, positions, queries, torch.arange(num_tokens), num_tokens, gen)

    @property
    def num_layers(self) -> int:
        return len(self.keys)

    def lengths(self, layer: int) -> list[int]:
        return [len(p) for p in self.positions[layer]]

    def max_live(self) -> int:
        return max(max(self.lengths(layer)) for layer in range(self.num_layers))

    def layer_kv(self, layer: int, window: int) -> LayerKV:
        """Right-aligned [H, N, D] view as the engine passes it, with the last ``window`` queries."""
        lengths = self.lengths(layer)
        n = max(lengths)
        heads = len(lengths)
        dim = self.keys[layer][0].shape[-1]
        keys = torch.zeros(heads, n, dim)
        values = torch.zeros(heads, n, dim)
        pos = torch.full((heads, n), -1, dtype=torch.long)
        for h, length in enumerate(lengths):
            keys[h, n - length :] = self.keys[layer][h]
            values[h, n - length :] = self.values[layer][h]
            pos[h, n - length :] = self.positions[layer][h]
        queries = qpos = None
        if window > 0:
            queries = self.queries[layer][:, -window:]
            qpos = self.query_positions[-window:]
        return LayerKV(
            keys, values, layer=layer, num_layers=self.num_layers, lengths=torch.tensor(lengths),
            positions=pos, queries=queries, query_positions=qpos,
        )

    def layers(self, window: int) -> list[LayerKV]:
        return [self.layer_kv(i, window) for i in range(self.num_layers)]

    def apply(self, selections: list[Selection]) -> None:
        """Compact every head to exactly the selected slots, in order."""
        for layer, sel in enumerate(selections):
            n = max(self.lengths(layer))
            for h, idx in enumerate(sel.indices):
                rows = idx - (n - len(self.positions[layer][h]))
                self.keys[layer][h] = self.keys[layer][h][rows]
                self.values[layer][h] = self.values[layer][h][rows]
                self.positions[layer][h] = self.positions[layer][h][rows]

    def decode_step(self) -> None:
        """Append one token (and its query) to every head of every layer."""
        for layer in range(self.num_layers):
            for h in range(len(self.keys[layer])):
                dim = self.keys[layer][h].shape[-1]
                self.keys[layer][h] = torch.cat([self.keys[layer][h], torch.randn(1, dim, generator=self.generator) * 2])
                self.values[layer][h] = torch.cat([self.values[layer][h], torch.randn(1, dim, generator=self.generator)])
                self.positions[layer][h] = torch.cat([self.positions[layer][h], torch.tensor([self.next_position])])
            q = self.queries[layer]
            self.queries[layer] = torch.cat([q, torch.randn(q.shape[0], 1, q.shape[2], generator=self.generator) * 2], 1)
        self.query_positions = torch.cat([self.query_positions, torch.tensor([self.next_position])])
        self.next_position += 1


def check_indices(kv: LayerKV, selection: Selection) -> None:
    """Sorted, unique, int64, inside each head's live suffix."""
    assert len(selection.indices) == kv.num_kv_heads
    lengths = kv.valid_lengths()
    for h, idx in enumerate(selection.indices):
        assert idx.dtype == torch.long
        if len(idx):
            assert bool((idx[1:] > idx[:-1]).all()), f"head {h} not sorted/unique: {idx}"
            assert int(idx[0]) >= kv.num_slots - int(lengths[h]), f"head {h} keeps an invalid slot"
            assert int(idx[-1]) < kv.num_slots


@pytest.fixture(name="make_policy")
def make_policy_fixture():
    """The :func:`make_policy` factory."""
    return make_policy


@pytest.fixture
def fake_request():
    """``FakeRequest.random``: build an engine stand-in for a random prompt."""
    return FakeRequest.random


@pytest.fixture(name="check_indices")
def check_indices_fixture():
    """The :func:`check_indices` assertion helper."""
    return check_indices
