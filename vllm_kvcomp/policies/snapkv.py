"""``snapkv``: SnapKV (Li et al., 2024): vote with an observation window of recent queries.

Score per KV head = attention of the last ``window`` queries summed over those queries, reduced
over the GQA group by the mean (:func:`reduce_gqa`), then smoothed by a 1-D average pool of
width ``kernel`` over the prefix (the slots before the window; zero padded at both ends, as the
authors' ``snapkv_utils.py`` and kvpress do). Keeps the top scores plus the observation window
itself. One-shot after prefill.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from vllm_kvcomp.params import Param, SpecError
from vllm_kvcomp.policies.base import (
    LayerKV,
    RequestState,
    ScorePolicy,
    reduce_gqa,
    window_attention_mass,
)
from vllm_kvcomp.policies.wrappers import HEADS_PARAMS, HeadsChoice


def pool_scores(scores: torch.Tensor, kernel: int) -> torch.Tensor:
    """[H, N] -> [H, N] average over a centred window of odd width ``kernel`` (zeros outside)."""
    if kernel <= 1:
        return scores
    pooled = F.avg_pool1d(scores.unsqueeze(1), kernel, stride=1, padding=kernel // 2)
    return pooled.squeeze(1)


@dataclass
class SnapKV(HeadsChoice, ScorePolicy):
    """Observation-window voting with pooling; ``window`` queries observe and are kept."""

    name: ClassVar[str] = "snapkv"
    READS_VALUES: ClassVar[bool] = False
    KEEPS: ClassVar[str] = "tokens the last `window` queries attend to most (pooled) + that window"
    PAPER: ClassVar[str] = "Li et al. 2024"
    TEST_PARAMS: ClassVar[Mapping[str, Any]] = {"ratio": 0.5, "window": 8}
    VARIANTS: ClassVar[Mapping[str, Mapping[str, Any]]] = {"adaptive": {"heads": "adaptive"}}
    PARAMS: ClassVar[dict[str, Param]] = {
        "kernel": Param("kernel", int, 7, 1, 63, help="odd width of the 1-D average pooling"),
        **HEADS_PARAMS,
    }

    ratio: float | None = 0.5
    budget: int | None = None
    window: int = 32
    kernel: int = 7
    heads: str = "uniform"

    def check(self) -> None:
        if self.window < 1:
            raise SpecError("window", "snapkv needs at least one observation query", "integer in [1, 1048576]")
        if self.kernel % 2 == 0:
            raise SpecError("kernel", f"{self.kernel} is even", "odd integer in [1, 63]")

    def queries_needed(self) -> int:
        return self.window

    def score(self, kv: LayerKV, state: RequestState) -> torch.Tensor:
        """[H_kv, N] pooled, group-averaged attention mass from the observation window.

        Pooling runs over the prefix's votes only (the window's columns are zeroed first), as in
        SnapKV's reference and kvpress, which pool ``attn[..., -w:, :-w]``: otherwise the tokens
        just before the window borrow the window's large local attention. The window itself is
        always kept; its slots score the row maximum.
        """
        votes = reduce_gqa(window_attention_mass(kv), kv.num_kv_heads)  # [H_kv, N]
        start = kv.num_slots - min(self.window, kv.num_slots)  # right-aligned: same for every head
        prefix = votes.clone()
        prefix[:, start:] = 0.0
        pooled = pool_scores(prefix, self.kernel)
        pooled[:, start:] = pooled.amax(dim=-1, keepdim=True)
        return pooled
