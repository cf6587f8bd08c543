"""``tova``: TOVA (Oren et al., 2024, "Transformers are Multi-State RNNs", its TOVA policy): a
fixed-size cache that evicts the token the *last* query attends to least.

Score of a token = the softmax attention of the most recent query (its own token included),
averaged over query heads, per token (by logical position, so heads holding different tokens
still average the same token's weights):

* ``average=layer`` (default): over **every** query head of the layer, so all KV heads rank
  alike — TOVA's own ``tova_cache.py`` and kvpress ``TOVAPress`` (``attn_weights.mean(1)``); a
  head that does not hold a token contributes 0 for it. Under tensor parallelism the mean runs
  over every rank's heads.
* ``average=group``: over the KV head's query group, the project's GQA rule (:func:`reduce_gqa`).

The last token itself is always kept, as in kvpress (which pads it with the maximum score;
TOVA's ``TOVACache.reduce`` ranks it like the others, ``topk`` of the mean attention). Each head keeps
the ``B`` best (``ratio`` / ``budget``, fixed at the prompt-end compression).

Decode: recompresses every ``interval`` steps (default 16, the server's default
``bounds.min_interval``) with the attention of the newest query only. The paper evicts one token
per step with that step's query (``interval=1``; the engine still compresses only once a whole
page is over the budget); between two compressions here, the tokens decoded since stay and are
then cut back to ``B`` by the latest query alone.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

import torch

from vllm_kvcomp.params import Param
from vllm_kvcomp.policies.base import (
    LayerKV,
    RequestState,
    ScorePolicy,
    reduce_gqa,
    window_attention,
)


def by_position(per_slot: torch.Tensor, positions: torch.Tensor, width: int) -> torch.Tensor:
    """[width] sum over heads of ``per_slot`` [H, N] at each logical position (``positions``
    [H, N], -1 = invalid, all < width)."""
    live = positions >= 0
    out = torch.zeros(width, dtype=per_slot.dtype, device=per_slot.device)
    return out.index_add_(0, positions[live], per_slot[live])


@dataclass
class TOVA(ScorePolicy):
    """Last-query attention, averaged over the layer's (or group's) query heads; fixed budget."""

    name: ClassVar[str] = "tova"
    READS_VALUES: ClassVar[bool] = False
    KEEPS: ClassVar[str] = "tokens the last query attends to most, head-averaged (recompresses)"
    PAPER: ClassVar[str] = "Oren et al. 2024"
    TEST_PARAMS: ClassVar[Mapping[str, Any]] = {"ratio": 0.5, "interval": 4}
    RECOMPRESSES: ClassVar[bool] = True
    PARAMS: ClassVar[dict[str, Param]] = {
        "average": Param(
            "average", str, "layer", choices=("layer", "group"),
            help="query heads a token's attention is averaged over: every head of the layer (TOVA, kvpress) "
            "or the KV head's query group",
        ),
    }

    ratio: float | None = 0.5
    budget: int | None = None
    interval: int = field(default=16, kw_only=True)
    average: str = "layer"

    def queries_needed(self) -> int:
        return 1

    def protected(self) -> tuple[int, int]:
        """The last live token (the scoring query's own) is always kept."""
        return 0, 1

    def score(self, kv: LayerKV, state: RequestState) -> torch.Tensor:
        """[H_kv, N] attention of the newest query, averaged over the layer's or the group's heads."""
        newest = None if kv.queries is None else kv.queries[:, -1:]
        last = replace(kv, queries=newest, query_positions=kv.window_query_positions()[-1:])
        probs = window_attention(last)[:, 0].double()  # [H_q, N], where the cache is
        if self.average == "group":
            return reduce_gqa(probs, kv.num_kv_heads)
        positions = kv.slot_positions()
        width = int(state.ranks.reduce(int(positions.max()) + 1, max))
        positions = positions.to(probs.device)
        group = probs.shape[0] // kv.num_kv_heads
        per_head = probs.reshape(kv.num_kv_heads, group, -1).sum(dim=1)  # [H_kv, N]
        total = state.ranks.sum_tensor(by_position(per_head, positions, width))  # [width]
        heads = state.ranks.reduce(probs.shape[0], sum)
        mean = total / heads
        return torch.where(positions >= 0, mean[positions.clamp(min=0)], 0.0)
