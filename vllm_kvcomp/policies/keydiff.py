"""``keydiff``: KeyDiff (Park et al., 2025, "KeyDiff: Key Similarity-Based KV Cache Eviction for
Long-Context LLM Inference in Resource-Constrained Environments"): keep the most *distinctive* keys.

Attention-free. Per KV head, the anchor is the mean of the head's live keys after L2
normalisation, and a token's score is the negative cosine similarity of its key to that anchor
(the paper's key-similarity eviction score, computed as kvpress ``KeyDiffPress`` does):

    a = mean_i k_i / ||k_i||,        score_i = -cos(k_i, a) = -(k_i · a) / (||k_i|| ||a||)

The keys are the cached, post-RoPE ones (as in kvpress). Keys least similar to the anchor are kept.
``sink``/``window`` optionally protect the first / last live tokens (0 by default, as in
kvpress). One-shot after prefill.

Not offered with ``prefill=stream``: the anchor is the mean over the cache, so compressing
chunk by chunk (the paper's block-wise prefill; kvpress ``BlockPress(KeyDiffPress)``) keeps a
different set than compressing the whole prompt, which the streaming contract requires
(``Policy.STREAMS``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from vllm_kvcomp.policies.base import LayerKV, RequestState, ScorePolicy


def keydiff_scores(keys: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
    """[H, N] negative cosine similarity of each key to its head's anchor.

    keys [H, N, D]; live [H, N] bool (the anchor averages the live keys only). Computed in
    float32 (float64 for float64 keys); norms are clamped at 1e-12 as ``F.normalize`` does, so a
    zero key scores 0.
    """
    acc = torch.float64 if keys.dtype == torch.float64 else torch.float32
    unit = F.normalize(keys.to(acc), dim=-1) * live.unsqueeze(-1).to(keys.device)  # [H, N, D]
    count = live.sum(dim=1, keepdim=True).clamp(min=1).to(unit.device, acc)  # [H, 1]
    anchor = F.normalize(unit.sum(dim=1) / count, dim=-1)  # [H, D]
    return -torch.einsum("hnd,hd->hn", unit, anchor)


@dataclass
class KeyDiff(ScorePolicy):
    """Keys least similar to the head's mean key direction, optionally plus sink and recent window."""

    name: ClassVar[str] = "keydiff"
    READS_VALUES: ClassVar[bool] = False
    KEEPS: ClassVar[str] = "keys least cosine-similar to the head's mean key (+ optional sink/window)"
    PAPER: ClassVar[str] = "Park et al. 2025"
    TEST_PARAMS: ClassVar[Mapping[str, Any]] = {"ratio": 0.25, "sink": 4, "window": 8}

    ratio: float | None = 0.5
    budget: int | None = None
    sink: int = 0
    window: int = 0

    def score(self, kv: LayerKV, state: RequestState) -> torch.Tensor:
        """[H_kv, N] = -cos(k, anchor) (less similar to the anchor = more important)."""
        return keydiff_scores(kv.keys, kv.valid_mask())
