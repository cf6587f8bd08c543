"""Shared helpers for policy tests: every registered policy and variant as a test case, built
from its class's ``TEST_PARAMS`` (:func:`make_policy`, :data:`CASES`), and a small engine stand-in.

``FakeRequest`` keeps, per layer and KV head, the live tokens (K, V, logical position), lays them
out right-aligned like the engine, compacts them to a policy's selection and appends decode
tokens; queries roll across prefill and decode.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from vllm_kvcomp.calibration.profiles import (
    HeadGatesProfile,
    LayerGroupsProfile,
    ModelIdentity,
    Profile,
    RetrievalHeadsProfile,
    ScorerProfile,
    bind_profile,
)
from vllm_kvcomp.policies.base import LayerKV, Policy, RequestState, ScorePolicy, Selection
from vllm_kvcomp.policies.registry import get_policy_class, policy_variants
from vllm_kvcomp.spec import CompressionSpec


@pytest.fixture(autouse=True)
def _one_thread():
    """The tensors here are tiny: one thread avoids OpenMP contention on shared cores (100x faster)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


#: hidden size of the fake requests' output projections
OUT_HIDDEN = 16
#: a model of the test requests' shape: 2 layers, up to 4 KV heads
TEST_MODEL = ModelIdentity.from_config({"model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 8,
                                        "num_key_value_heads": 4, "hidden_size": 64})
#: seeded kvzap weights [2][4][12] and bias [2][4] for :data:`TEST_MODEL` (head_dim 8)
_SCORER = torch.Generator().manual_seed(0)
#: calibration data per profile kind (``Policy.PROFILE``): retrieval heads in both layers and in
#: both tensor-parallel halves of 4 heads; one group of both layers; DuoAttention gates whose
#: retrieval heads (gate ≥ 0.5) are razor's; a seeded kvzap scorer
TEST_PROFILES: dict[str, Profile] = {
    "razor": RetrievalHeadsProfile(model=TEST_MODEL, kv_heads=frozenset({(0, 0), (0, 3), (1, 2)})),
    "pod": LayerGroupsProfile(model=TEST_MODEL, groups=((0, 1),)),
    "duoattention": HeadGatesProfile(model=TEST_MODEL, gates=((0.9, 0.1, 0.2, 0.8), (0.3, 0.0, 0.7, 0.4))),
    "kvzap": ScorerProfile.from_arrays(TEST_MODEL, torch.randn(2, 4, 12, generator=_SCORER),
                                       torch.randn(2, 4, generator=_SCORER)),
}


def make_policy(name: str, **settings) -> Policy:
    """A policy by public name, built through the spec from its class's ``TEST_PARAMS`` (small
    settings for short prompts; ``settings`` win) and bound to the test profile of its kind."""
    cls = get_policy_class(name)
    policy = CompressionSpec.from_mapping({"policy": name, **cls.TEST_PARAMS, **settings}).build_policy()
    return policy if cls.PROFILE is None else bind_profile(policy, TEST_PROFILES[cls.PROFILE])


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
    #: [layer] -> [H_q, D, OUT_HIDDEN] output projection per query head (``LayerKV.out_proj``)
    out_proj: list[torch.Tensor] = field(default_factory=list)

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
        weights = torch.Generator().manual_seed(seed + 7919)  # its own stream: K/V/queries stay as they were
        out_proj = [torch.randn(num_kv_heads * group, dim, OUT_HIDDEN, generator=weights) * dim ** -0.5
                    for _ in range(num_layers)]
        return cls(keys, values, positions, queries, torch.arange(num_tokens), num_tokens, gen, out_proj)

    @property
    def num_layers(self) -> int:
        return len(self.keys)

    def lengths(self, layer: int) -> list[int]:
        return [len(p) for p in self.positions[layer]]

    def max_live(self) -> int:
        return max(max(self.lengths(layer)) for layer in range(self.num_layers))

    def layer_kv(self, layer: int, window: int, out_proj: bool = False, values_wanted: bool = True) -> LayerKV:
        """Right-aligned [H, N, D] view as the engine passes it, with the last ``window`` queries
        (and the layer's output projection if ``out_proj``, as the engine gives a policy that asks;
        values None unless ``values_wanted``, as the engine gives a policy that does not read them)."""
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
            keys, values if values_wanted else None, layer=layer, num_layers=self.num_layers, lengths=torch.tensor(lengths),
            positions=pos, queries=queries, query_positions=qpos,
            out_proj=self.out_proj[layer] if out_proj else None,
        )

    def layers(self, window: int, out_proj: bool = False, values: bool = True) -> list[LayerKV]:
        return [self.layer_kv(i, window, out_proj, values) for i in range(self.num_layers)]

    def inputs(self, policy: Policy, state: RequestState | None = None) -> list[LayerKV]:
        """Every layer as the engine gives it to ``policy``: its window of queries, the output
        projection if it asks (``NEEDS_OUT_PROJ``), no values unless it reads them (``READS_VALUES``),
        NaN keys and no values when its next decision with ``state`` reads neither (``reads_cache``)."""
        layers = self.layers(policy.queries_needed(), policy.NEEDS_OUT_PROJ, policy.READS_VALUES)
        if state is not None and not policy.reads_cache(state):
            for kv in layers:
                kv.keys, kv.values = torch.full_like(kv.keys, float("nan")), None
        return layers

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


def keeps_budget_per_head(policy: Policy) -> bool:
    """A score policy with the same budget for every head (no allocation across heads)."""
    return isinstance(policy, ScorePolicy) and not policy.allocates_across_heads()


def cases(keep: Callable[[Policy], bool] = lambda policy: True) -> list:
    """A ``pytest.param`` of (label, policy name, spec settings) for every registered policy and
    each of its ``VARIANTS`` whose default instance passes ``keep``."""
    return [pytest.param(case, id=case[0].replace(" ", "-")) for case in policy_variants()
            if keep(get_policy_class(case[1])(**case[2]))]


#: every registered policy and variant, when collected
CASES = cases()


def recompressing_cases() -> list:
    """Every case whose policy recompresses during decode: its own (``RECOMPRESSES``), or asked
    to with ``decode=recompress`` (label suffix ``decode=recompress``)."""
    out = []
    for label, name, settings in policy_variants():
        cls = get_policy_class(name)
        if cls.RECOMPRESSES:
            out.append(pytest.param((label, name, settings), id=label.replace(" ", "-")))
        elif cls.CAN_RECOMPRESS:
            case = (f"{label} decode=recompress", name, {**settings, "decode": "recompress"})
            out.append(pytest.param(case, id=case[0].replace(" ", "-")))
    return out


def make_case(case: tuple[str, str, Mapping[str, Any]]) -> Policy:
    """The policy of a (label, policy name, spec settings) case, by :func:`make_policy`."""
    _, name, settings = case
    return make_policy(name, **settings)


#: (prompt tokens, KV heads, query heads per KV head, ragged heads): the shapes every policy runs on
SHAPES = list(itertools.product((1, 7, 40, 97), (1, 3), (1, 3), (False, True)))
SHAPE_IDS = [f"n{n}-h{h}-g{g}-{'ragged' if r else 'equal'}" for n, h, g, r in SHAPES]


@dataclass
class Compression:
    """One compression of a :class:`FakeRequest`: what the policy saw and chose."""

    layers: list[LayerKV]
    selections: list[Selection]
    state: RequestState
    totals: list[list[int]]  # [layer][head]: tokens the head has seen (prompt + decode)


def compressions(policy: Policy, request: FakeRequest, decode_steps: int = 0) -> Iterator[Compression]:
    """The prompt-end compression of ``request``, then every recompression that falls due in
    ``decode_steps`` decode steps; each selection is applied once the caller has looked at it."""
    prompt = [request.lengths(layer) for layer in range(request.num_layers)]
    state = RequestState(prompt_len=request.next_position)
    steps_since = 0
    for step in range(decode_steps + 1):
        if step:
            request.decode_step()
            steps_since += 1
            if not (policy.recompresses and policy.due(state, request.max_live(), steps_since)):
                continue
        layers = request.inputs(policy, state)
        selections = policy.decide(layers, state)
        yield Compression(layers, selections, state, [[n + step for n in heads] for heads in prompt])
        request.apply(selections)
        steps_since = 0


def protected_slots(length: int, n: int, keep: int, sink: int, window: int) -> list[int]:
    """The first ``sink`` and last ``window`` of a head's ``length`` live (right-aligned) slots out
    of ``n``, as many as fit in ``keep``: what it must keep when it keeps ``keep``."""
    start = n - length
    s = min(sink, keep)
    w = min(window, keep - s)
    return [*range(start, start + s), *range(n - w, n)]


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


@pytest.fixture
def fake_request():
    """``FakeRequest.random``: build an engine stand-in for a random prompt."""
    return FakeRequest.random


@pytest.fixture(name="check_indices")
def check_indices_fixture():
    """The :func:`check_indices` assertion helper."""
    return check_indices


def assert_refuses_infeasible_ratio(config, policy: str, ratio: float, allowed_low: str) -> None:
    """``ratio`` of ``policy`` is refused by the server's profile check (HTTP 400 naming ``ratio``
    where the client wrote it, header or ``vllm_xargs``, allowing ratios above ``allowed_low``)."""
    import json

    from vllm_kvcomp.server import protocol

    with pytest.raises(protocol.RequestError) as err:
        protocol.resolve(config, [f"policy={policy}; ratio={ratio}"], {})
    assert err.value.param == "X-KV-Compression.ratio"
    body = json.loads(err.value.to_json())["error"]
    assert body["code"] == 400 and f"(allowed: a number in ({allowed_low}, 1]" in body["message"]
    with pytest.raises(protocol.RequestError) as err:
        protocol.resolve(config, [], {"vllm_xargs": {"kvcomp_policy": policy, "kvcomp_ratio": ratio}})
    assert err.value.param == "vllm_xargs.kvcomp_ratio"


def served_model_dir(tmp_path, monkeypatch):
    """A model folder of 3 layers x 2 KV heads (no weights) and an empty package profile store:
    what a server's profile checks read."""
    import json

    from vllm_kvcomp.calibration import profiles

    monkeypatch.setattr(profiles, "STORE", tmp_path / "store")
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 3,
                                                   "num_attention_heads": 4, "num_key_value_heads": 2,
                                                   "hidden_size": 64}))
    return model
