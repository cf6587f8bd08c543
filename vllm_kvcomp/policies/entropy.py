"""``entropy``: entropy-guided layer budgets (002_…, Algorithm 1).

1. Per layer, the Shannon entropy of each query head's window attention (last ``window``
   queries), averaged over heads and queries: the layer's importance.
2. Layer budgets proportional to that entropy, clipped to ``[min_ratio·T, max_ratio·T]`` with the
   proportionality constant solved so that the budgets still average to ``T = target_budget(N)``
   (the per-head budget a uniform policy would use), then rounded by largest remainder; in the
   engine moved onto its page grid with the same sum (each within one page:
   :func:`~vllm_kvcomp.policies.base.snap_to_pages`), as every head holds whole pages.
3. One shared token set per layer: slots ranked by attention summed over all heads and window
   queries; a layer budget B_l keeps 1 sink token, ``B_l // 2`` top-ranked tokens and the rest
   as recent window (half top-k / half recent + one sink).

Heads with equal lengths (always the case after prefill) get identical indices; with ragged
heads each head takes the shared ranking inside its own live range.

Decode: the sink and the top-ranked tokens stay pinned while the recent window slides, every
``interval`` steps, back to B_l. ``RequestState.budget`` is the largest layer budget.
Deviation: the paper measures entropy over the whole prefill attention; the engine captures only
the last ``window`` queries.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from vllm_kvcomp.params import Param, SpecError
from vllm_kvcomp.policies.base import (
    LayerKV,
    Policy,
    Ranking,
    RequestState,
    Selection,
    SlotMemory,
    budget_basis,
    keep_pinned_layers,
    kept_pins,
    protected_topk,
    slot_mask,
    snap_to_pages,
    visible_softmax,
    window_chunks,
    window_logits,
)


def row_entropies(logits: torch.Tensor) -> tuple[torch.Tensor, float, int]:
    """(softmax of window logits [H_q, w, N] (-inf = hidden; overwritten), the sum of its rows'
    Shannon entropies over the rows with a visible key, the number of those rows) on this rank.

    A row's entropy is ``lse - sum(p * logit)`` with ``lse = max logit - log(max p)``: no
    logarithm per element (``-sum(p log p)`` cost ~4x the softmax itself)."""
    probs = visible_softmax(logits)
    top = logits.amax(dim=-1)  # [H_q, w], -inf for an empty row
    live = torch.isfinite(top)
    lse = top - probs.amax(dim=-1).log()
    rows = lse - torch.linalg.vecdot(probs, logits.clamp_(min=torch.finfo(logits.dtype).min))  # 0 * hidden = 0
    return probs, float(rows[live].sum()), int(live.sum())


def _solve_scale(e: torch.Tensor, low: int, high: int, total: int) -> float:
    """Exact c with ``sum(clip(c·e, low, high)) = total``: the sum is piecewise linear in c."""
    live = e[e > 0]
    points = sorted({0.0, *(low / live).tolist(), *(high / live).tolist()})

    def filled(c: float) -> float:
        return float((c * e).clamp(low, high).sum())

    prev = points[0]
    for c in points:
        if filled(c) >= total:
            before, after = filled(prev), filled(c)
            return c if after == before else prev + (total - before) * (c - prev) / (after - before)
        prev = c
    return points[-1]


def entropy_budgets(entropies: Sequence[float], target: int, min_ratio: float, max_ratio: float) -> list[int]:
    """Integer layer budgets ∝ entropy within ``[ceil(min_ratio·T), floor(max_ratio·T)]``.

    They sum to exactly ``len(entropies) · target`` (``min_ratio ≤ 1 ≤ max_ratio``) and never
    decrease with the entropy; equal entropies differ by at most one (rounding). When the bounds
    cut the proportional sum short (zero-entropy layers, tight ``max_ratio``) the rest is spread
    over the layers below the maximum.
    """
    num = len(entropies)
    e = torch.tensor([max(float(x), 0.0) for x in entropies], dtype=torch.float64)
    if num and float(e.max()) > 0:  # relative scale; negligible entropies count as zero
        e = e / e.max()
        e = torch.where(e < 1e-12, torch.zeros_like(e), e)
    low = math.ceil(min_ratio * target - 1e-9)
    high = max(math.floor(max_ratio * target + 1e-9), low)
    if num == 0 or float(e.sum()) == 0.0 or float(e.max() - e.min()) == 0.0:
        return [target] * num
    total = num * target
    exact = (_solve_scale(e, low, high, total) * e).clamp(low, high)
    budgets = exact.floor()
    missing = int(total - budgets.sum())
    # largest remainder first, ties to the higher entropy (keeps budgets monotone in entropy);
    # repeated passes only happen when the clip bounds leave the proportional sum short
    order = sorted(range(num), key=lambda i: (-float(exact[i] - budgets[i]), -float(entropies[i]), i))
    while missing > 0:
        for i in order:
            if missing > 0 and budgets[i] < high:
                budgets[i] += 1
                missing -= 1
    return [int(b) for b in budgets]


def split_layer_budget(budget: int) -> tuple[int, int, int]:
    """(sink, top-k, recent) of a layer budget: 1 sink (from 3 tokens on), budget // 2 top-k."""
    top = budget // 2
    sink = 1 if budget - top >= 2 else 0
    return sink, top, budget - top - sink


@dataclass
class EntropyBudget(Policy):
    """Entropy-scaled per-layer budgets with one shared token set per layer."""

    name: ClassVar[str] = "entropy"
    KEEPS: ClassVar[str] = "layer budgets ∝ attention entropy; one shared top-k set per layer + recent"
    PAPER: ClassVar[str] = "paper 002"
    TEST_PARAMS: ClassVar[Mapping[str, Any]] = {"ratio": 0.5, "window": 8, "interval": 4}
    RECOMPRESSES: ClassVar[bool] = True
    READS_VALUES: ClassVar[bool] = False
    PARAMS: ClassVar[dict[str, Param]] = {
        "min_ratio": Param("min_ratio", float, 0.25, 0.0, 1.0, help="smallest layer budget / average budget"),
        "max_ratio": Param("max_ratio", float, 2.0, 1.0, 64.0, help="largest layer budget / average budget"),
    }

    ratio: float | None = 0.5
    budget: int | None = None
    window: int = 32
    interval: int = field(default=16, kw_only=True)
    min_ratio: float = 0.25
    max_ratio: float = 2.0

    def check(self) -> None:
        if self.window < 1:
            raise SpecError("window", "entropy needs at least one observation query", "integer in [1, 1048576]")

    def queries_needed(self) -> int:
        return self.window

    def budgets_on_pages(self) -> bool:
        return True  # the layer budgets are snapped (snap_to_pages)

    def mean_kept_bound(self, prompt_len: int, num_heads: int | None = None) -> int | None:
        """The layer budgets sum to (layers) x target (:func:`entropy_budgets`)."""
        return self.target_budget(prompt_len)

    def reads_cache(self, state: RequestState) -> bool:
        memories = state.memories(EntropyMemory)  # once every layer has its budget, the window only slides
        return not memories or any(memory.budget is None for memory in memories)

    def select(self, layers: Sequence[LayerKV], state: RequestState) -> list[Selection]:
        if layers and all(state.layer(kv.layer, EntropyMemory).budget is not None for kv in layers):
            return self._slide(layers, state)
        stats = [self._layer_stats(kv, state) for kv in layers]  # one layer's attention held at a time
        longest = budget_basis(layers, state)
        target = self.target_budget(longest)
        budgets = entropy_budgets([e for _, e in stats], target, self.min_ratio, self.max_ratio)
        budgets = snap_to_pages(budgets, state.page_quantum, longest)  # whole pages, the same sum
        state.budget = max(budgets, default=target)
        return [self._select_shared(kv, shared, b, state) for kv, (shared, _), b in zip(layers, stats, budgets)]

    @staticmethod
    def _layer_stats(kv: LayerKV, state: RequestState) -> tuple[torch.Tensor, float]:
        """(the layer's shared ranking [N]: its window attention summed over heads and queries, of
        every rank's heads, where the cache is; the mean of its rows' entropies over every rank),
        the window attended ``WINDOW_ROWS`` queries at a time."""
        shared, total, count = None, 0.0, 0
        for part in window_chunks(kv):
            probs, part_total, part_count = row_entropies(window_logits(part))
            mass = probs.float().sum(dim=(0, 1))
            shared = mass if shared is None else shared.add_(mass)
            total, count = total + part_total, count + part_count
        count = state.ranks.reduce(count, sum)
        entropy = state.ranks.reduce(total, sum) / count if count else 0.0
        return state.ranks.sum_tensor(shared), entropy

    def _select_shared(self, kv: LayerKV, shared: torch.Tensor, budget: int, state: RequestState) -> Selection:
        """Shared ranking ``shared`` [N] -> sink + top + recent."""
        sink, _, recent = split_layer_budget(budget)
        lengths = kv.valid_lengths()
        priority = Ranking(shared.expand(kv.num_kv_heads, -1))
        chosen = protected_topk(priority, budget, lengths, sink, recent)
        start = kv.num_slots - lengths
        slots = torch.arange(kv.num_slots).unsqueeze(0)
        middle = (slots >= (start + sink).unsqueeze(1)) & (slots < kv.num_slots - recent)
        memory = state.layer(kv.layer, EntropyMemory)  # the top-ranked picks are pinned, page-rounding extras are not
        memory.budget, memory.sink, memory.picked = budget, sink, slot_mask(chosen, kv.num_slots) & middle
        return Selection(chosen, priority=priority)

    def _slide(self, layers: Sequence[LayerKV], state: RequestState) -> list[Selection]:
        """Decode, every layer at once: sink + pinned top tokens + the most recent, back to each
        layer's budget."""
        memories = [state.layer(kv.layer, EntropyMemory) for kv in layers]
        found = SlotMemory.lookup_layers([m.pinned for m in memories], [kv.slot_positions() for kv in layers])
        for memory, pins in zip(memories, found):
            memory.picked = pins > 0
        kept = keep_pinned_layers(layers, [m.picked for m in memories], [m.sink for m in memories],
                                  [m.budget for m in memories])
        for memory, pick in zip(memories, kept):
            if pick.holds_pins:  # its pins, by position, are what they were: nothing to commit
                memory.picked = None
        return [Selection(pick.chosen, priority=pick.priority) for pick in kept]

    def commit_kept(self, layers: Sequence[LayerKV], state: RequestState, picks: Sequence[Selection],
                    kept: Sequence[Selection]) -> None:
        """The picked tokens that are kept stay pinned (by logical position; every layer that
        picked at once; a slide that kept every pin leaves its layer as it is)."""
        memories = [state.layer(kv.layer, EntropyMemory) for kv in layers]
        picked = [i for i, memory in enumerate(memories) if memory.picked is not None]
        pinned = SlotMemory.kept_layers([memories[i].picked.float() for i in picked],
                                        [layers[i].slot_positions() for i in picked],
                                        [kept_pins(memories[i].picked, kept[i]) for i in picked])
        for i, pins in zip(picked, pinned):
            memories[i].pinned, memories[i].picked = pins, None


@dataclass
class EntropyMemory:
    """One layer's budget, sink and pinned top tokens (by logical position)."""

    budget: int | None = None
    sink: int = 0
    pinned: SlotMemory | None = None
    #: [H_kv, N] bool pinned slots of this pick, until committed (None after a slide that kept every pin)
    picked: torch.Tensor | None = None
