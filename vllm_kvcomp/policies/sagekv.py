"""``sagekv``: SAGE-KV (001_…, Wang et al., 2025): one-shot self-attention guided eviction.

§2 steps 1–4 with the Appendix A.2 split of a per-KV-head budget B among G = H_q / H_kv query
heads: sink ``B/4``, top-``k`` per query head with ``k = B/(2G)`` rounded down to a power of
two (this reproduces both published settings: G=4 -> 1024, G=7 -> 585 -> 512), and the recent
window gets the rest, ``B - sink - G·k``, which includes the last token (so the total is exactly
B, as in A.2: 8192 - 2048 - 7·512 = 2560).

Scores are the attention of the *last* query. Each query head ranks the eviction region (between
sink and recent window) on its own; its KV head keeps the union of the G top-k sets. When those
sets overlap the union is smaller than G·k: the free slots go to the next-ranked tokens (the
best rank any query head of the group gives a token, ties by the larger attention), so every
head keeps exactly B.

Deliberate choices (issue #17, pinned in ``tests/policies/test_sagekv.py``):

* **Union per KV head, not a cache per query head.** The paper selects per query head ("H_q
  groups of the top-k KV caches"). The engine's cache is per KV head, so a query head attends to
  the union: a superset of its own top-k (it also sees its group's picks), never less. Storing G
  separate sets would cost up to G copies of shared tokens; the budget B stays the paper's
  ``sink + G·k + recent``.
* **k rounded down to a power of two.** A.2's rule ``k = B/(2G)`` gives 585 for Qwen2.5 (G=7,
  B=8192), where the paper uses 512; rounding down to a power of two is the one rule that gives
  both published settings (1024 for G=4, 512 for G=7). On the bundled SmolLM2 (G=3) the top-k
  part is then 37.5 % of B at B=512 or 1024 (k=64/128), not 50 %; the recent window takes the rest.

Decode: sink and the selected set stay pinned (per-slot memory keyed by position) while the
recent window slides; every ``interval`` steps the cache is cut back to B. If the first
selection compressed nothing (prompt ≤ B), the first decode recompression makes the selection.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from vllm_kvcomp.policies.base import (
    LayerKV,
    RequestState,
    ScorePolicy,
    Selection,
    SlotMemory,
    keep_pinned_layers,
    kept_pins,
    slot_mask,
    window_attention,
)


def sagekv_split(budget: int, group: int, sink: int | None = None) -> tuple[int, int, int]:
    """(sink, k per query head, recent window incl. last token) summing to ``budget``.

    ``group`` = query heads per KV head; ``sink`` overrides B/4. Recent keeps at least 1 token.
    """
    if budget <= 0:
        return 0, 0, 0
    keep_sink = budget // 4 if sink is None else min(int(sink), budget - 1)
    share = budget // (2 * group)
    k = 1 << (share.bit_length() - 1) if share else 0
    k = min(k, (budget - keep_sink - 1) // group)
    return keep_sink, k, budget - keep_sink - group * k


@dataclass
class SageKV(ScorePolicy):
    """Sink B/4 + union of per-query-head top-k (last-token attention) + recent window."""

    name: ClassVar[str] = "sagekv"
    READS_VALUES: ClassVar[bool] = False
    KEEPS: ClassVar[str] = (
        "sink B/4 + union of per-query-head top-k of the last token + recent (recompresses)")
    PAPER: ClassVar[str] = "Wang et al. 2025 (paper 001)"
    IMPLICIT_DEFAULTS: ClassVar[Mapping[str, str]] = {**ScorePolicy.IMPLICIT_DEFAULTS, "sink": "B/4"}
    TEST_PARAMS: ClassVar[Mapping[str, Any]] = {"ratio": 0.5, "interval": 4}
    RECOMPRESSES: ClassVar[bool] = True

    ratio: float | None = 0.5
    budget: int | None = None
    sink: int | None = None
    interval: int = field(default=16, kw_only=True)

    def queries_needed(self) -> int:
        return 1

    def split(self, kv: LayerKV, state: RequestState) -> tuple[int, int, int]:
        """(sink, k, recent) for this layer's GQA group size and ``state.budget``."""
        group = 1 if kv.queries is None else kv.queries.shape[0] // kv.num_kv_heads
        return sagekv_split(int(state.budget or 0), group, self.sink)

    def protected_for(self, kv: LayerKV, state: RequestState) -> tuple[int, int]:
        sink, _, recent = self.split(kv, state)
        return sink, recent

    def eviction_region(self, kv: LayerKV, state: RequestState) -> torch.Tensor:
        """[H_kv, N] bool: live slots between each head's sink and recent window."""
        sink, _, recent = self.split(kv, state)
        start = kv.num_slots - kv.valid_lengths()
        slots = torch.arange(kv.num_slots).unsqueeze(0)
        return (slots >= (start + sink).unsqueeze(1)) & (slots < kv.num_slots - recent)

    def score(self, kv: LayerKV, state: RequestState) -> torch.Tensor:
        """[H_kv, N] = -(best rank over the group's query heads) + attention/2 (a tie-break < 1).

        Ranks are taken inside the eviction region, so the top ``G·k`` scores are the union of
        the per-query-head top-k sets, filled up with the next ranks when they overlap.
        """
        last = window_attention(kv)[:, -1].float()  # [H_q, N], ranked where the keys are
        group = last.shape[0] // kv.num_kv_heads
        region = self.eviction_region(kv, state).repeat_interleave(group, dim=0).to(last.device)
        order = torch.sort(last.masked_fill(~region, -1.0), dim=-1, descending=True, stable=True).indices
        rank = torch.empty_like(order)
        rank.scatter_(1, order, torch.arange(kv.num_slots, device=order.device).expand_as(order).contiguous())
        best_rank = rank.view(kv.num_kv_heads, group, -1).amin(dim=1).float()
        top_attn = last.view(kv.num_kv_heads, group, -1).amax(dim=1)
        return (-best_rank + 0.5 * top_attn).cpu()

    def reads_cache(self, state: RequestState) -> bool:
        memories = state.memories(SageKVMemory)  # once every layer is pinned, the window only slides
        return not memories or any(memory.pinned is None for memory in memories)

    def select(self, layers: Sequence[LayerKV], state: RequestState) -> list[Selection]:
        """The top-k by score (:meth:`ScorePolicy.select`) for layers not yet pinned; a pinned
        layer keeps its pins and the recent window slides."""
        fresh = [kv for kv in layers if state.layer(kv.layer, SageKVMemory).pinned is None]
        sliding = [kv for kv in layers if state.layer(kv.layer, SageKVMemory).pinned is not None]
        picks = dict(zip((kv.layer for kv in fresh), super().select(fresh, state)))
        picks.update(zip((kv.layer for kv in sliding), self._slide(sliding, state)))
        return [picks[kv.layer] for kv in layers]

    def _slide(self, layers: Sequence[LayerKV], state: RequestState) -> list[Selection]:
        """Pinned layers, all at once: sink + pins + the most recent, back to the budget."""
        memories = [state.layer(kv.layer, SageKVMemory) for kv in layers]
        found = SlotMemory.lookup_layers([m.pinned for m in memories], [kv.slot_positions() for kv in layers])
        for memory, pins in zip(memories, found):
            memory.sliding = pins > 0
        kept = keep_pinned_layers(layers, [m.sliding for m in memories], [m.sink for m in memories],
                                  [int(state.budget or 0)] * len(layers))
        for memory, pick in zip(memories, kept):
            if pick.holds_pins:  # its pins, by position, are what they were: nothing to commit
                memory.sliding = None
        return [Selection(pick.chosen, priority=pick.priority) for pick in kept]

    def commit_kept(self, layers: Sequence[LayerKV], state: RequestState, picks: Sequence[Selection],
                    kept: Sequence[Selection]) -> None:
        """A sliding layer that lost pinned tokens pins those it kept (every such layer at once;
        one that kept them all stays as it is); a fresh pick pins what it chose (:meth:`commit`)."""
        memories = [state.layer(kv.layer, SageKVMemory) for kv in layers]
        slid = [i for i, memory in enumerate(memories) if memory.sliding is not None]
        fresh = [i for i, memory in enumerate(memories) if memory.pinned is None]
        pinned = SlotMemory.kept_layers([memories[i].sliding.float() for i in slid],
                                        [layers[i].slot_positions() for i in slid],
                                        [kept_pins(memories[i].sliding, kept[i]) for i in slid])
        for i, memory in zip(slid, pinned):
            memories[i].pinned, memories[i].sliding = memory, None
        for i in fresh:
            self.commit(layers[i], state, kept[i], picks[i].indices)

    def commit(self, kv: LayerKV, state: RequestState, selection: Selection, chosen: list[torch.Tensor]) -> None:
        """Pin the tokens the top-k chose (not the page-rounding extras) once a selection
        really evicted something."""
        if int(kv.valid_lengths().max()) <= int(state.budget or 0):
            return
        memory = state.layer(kv.layer, SageKVMemory)
        pinned = slot_mask(chosen, kv.num_slots) & self.eviction_region(kv, state)
        memory.pinned = SlotMemory.kept(pinned.float(), kv.slot_positions(), kept_pins(pinned, selection))
        memory.sink = self.split(kv, state)[0]


@dataclass
class SageKVMemory:
    """One layer's pinned selection (its positions, :func:`kept_pins`) once a compression evicted something."""

    pinned: SlotMemory | None = None
    sink: int = 0
    #: [H_kv, N] pinned slots of a decode pick that left some out, until committed
    sliding: torch.Tensor | None = None
