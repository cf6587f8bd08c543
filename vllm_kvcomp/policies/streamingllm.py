"""``streamingllm``: StreamingLLM (Xiao et al., 2023): attention sinks + the most recent tokens.

Every head keeps its first ``sink`` live tokens and the ``B - sink`` most recent ones. During
decode the window slides: every ``interval`` steps the cache is cut back to ``B``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from vllm_kvcomp.policies.base import LayerKV, RequestState, ScorePolicy


@dataclass
class StreamingLLM(ScorePolicy):
    """Sink + recent window, same count per head."""

    name: ClassVar[str] = "streamingllm"
    READS_VALUES: ClassVar[bool] = False
    KEEPS: ClassVar[str] = "first `sink` + most recent tokens"
    PAPER: ClassVar[str] = "Xiao et al. 2023"
    TEST_PARAMS: ClassVar[Mapping[str, Any]] = {"ratio": 0.5, "sink": 4, "interval": 4}
    STREAMS: ClassVar[bool] = True
    RECOMPRESSES: ClassVar[bool] = True

    ratio: float | None = 0.5
    budget: int | None = None
    sink: int = 4
    interval: int = field(default=16, kw_only=True)

    def reads_cache(self, state: RequestState) -> bool:
        return False  # positions only

    def score(self, kv: LayerKV, state: RequestState) -> torch.Tensor:
        """[H_kv, N] recency: the logical position (later = kept)."""
        return kv.slot_positions().float()
