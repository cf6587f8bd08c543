"""Two throwaway policies for tests/policies/test_registry.py, each added the way a new method is
(one module, one registry line, nothing else): ``oldest`` keeps the oldest tokens; ``greedy``
keeps one token over its budget, which the shared matrix must catch.

As a pytest plugin (``-p tests.policies.throwaway_policy``) this module registers both before
any test module is collected, as if their lines were in ``POLICIES``.
"""

from __future__ import annotations

import operator
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from vllm_kvcomp.policies import registry
from vllm_kvcomp.policies.base import LayerKV, Policy, RequestState, ScorePolicy, Selection


@dataclass
class Oldest(ScorePolicy):
    """The oldest tokens of each head, cut back to the budget every ``interval`` decode steps."""

    name: ClassVar[str] = "oldest"
    KEEPS: ClassVar[str] = "the oldest tokens"
    PAPER: ClassVar[str] = "none"
    RECOMPRESSES: ClassVar[bool] = True
    TEST_PARAMS: ClassVar[Mapping[str, Any]] = {"ratio": 0.5, "interval": 4}

    ratio: float | None = 0.5
    budget: int | None = None
    interval: int = 16

    def score(self, kv: LayerKV, state: RequestState) -> torch.Tensor:
        return -kv.slot_positions().float()


@dataclass
class Greedy(Policy):
    """Keeps the oldest ``budget + 1`` tokens of each head: one over the budget it fixes."""

    name: ClassVar[str] = "greedy"
    KEEPS: ClassVar[str] = "one token too many"

    ratio: float | None = 0.5
    budget: int | None = None

    def select_layer(self, kv: LayerKV, state: RequestState) -> Selection:
        if state.budget is None:
            state.budget = self.target_budget(int(kv.valid_lengths().max()))
        start = kv.num_slots - kv.valid_lengths()
        return Selection([torch.arange(int(s), min(int(s) + state.budget + 1, kv.num_slots)) for s in start])


def register(cls: type[Policy], setitem: Callable[[Any, str, Any], None] = operator.setitem) -> str:
    """Make this module ``vllm_kvcomp.policies.<name>`` and add ``cls``'s registry line, with
    ``setitem`` (``monkeypatch.setitem`` undoes both after a test)."""
    setitem(sys.modules, f"vllm_kvcomp.policies.{cls.name}", sys.modules[__name__])
    setitem(registry.POLICIES, cls.name, f"{cls.name}:{cls.__name__}")
    return cls.name


def pytest_load_initial_conftests(early_config, parser, args) -> None:
    """Plugin hook (``-p`` plugins only): register both policies before conftest.py files load."""
    register(Oldest)
    register(Greedy)
