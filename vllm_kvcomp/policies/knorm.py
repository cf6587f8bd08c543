"""``knorm``: keep the keys with the lowest L2 norm (Devoto et al., 2024; kvpress ``KnormPress``).

Attention-free: score = -||k||₂ per head and slot. ``sink``/``window`` optionally protect the
first / last live tokens (both 0 by default, as in kvpress). One-shot after prefill.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from vllm_kvcomp.params import Param
from vllm_kvcomp.policies.base import LayerKV, RequestState, ScorePolicy
from vllm_kvcomp.policies.wrappers import HEADS_PARAMS, HeadsChoice


@dataclass
class KNorm(HeadsChoice, ScorePolicy):
    """Lowest key norms, optionally plus sink and recent window."""

    name: ClassVar[str] = "knorm"
    READS_VALUES: ClassVar[bool] = False
    KEEPS: ClassVar[str] = "keys with the lowest L2 norm (+ optional sink/window)"
    PAPER: ClassVar[str] = "Devoto et al. 2024"
    TEST_PARAMS: ClassVar[Mapping[str, Any]] = {"ratio": 0.25, "sink": 4, "window": 8}
    STREAMS: ClassVar[bool] = True
    PARAMS: ClassVar[dict[str, Param]] = {**HEADS_PARAMS}

    ratio: float | None = 0.5
    budget: int | None = None
    sink: int = 0
    window: int = 0
    heads: str = "uniform"

    def score(self, kv: LayerKV, state: RequestState) -> torch.Tensor:
        """[H_kv, N] = -||k||₂ (smaller norm = more important)."""
        return -kv.keys.float().norm(dim=-1)
