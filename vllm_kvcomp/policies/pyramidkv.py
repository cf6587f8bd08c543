"""``pyramidkv``: PyramidKV (Cai et al., 2024, "PyramidKV: Dynamic KV Cache Compression based on
Pyramidal Information Funneling"): per-layer budgets that decrease linearly with depth (the
paper's arithmetic sequence), SnapKV scores inside each layer.

Budgets (per head, layer l of L, T = the mean per-head budget from ``ratio`` / ``budget``, w =
``window``): the observation window is kept in every layer and the selected part follows the
paper's arithmetic sequence (the authors' ``pyramidkv_utils.py``, whose ``max_capacity_prompt``
is T and whose sequence runs over ``T - w``):

    top     = T - w                      (mean selected tokens per layer)
    k_min   = top / beta,  k_max = 2·top - k_min
    if k_max > N - w:  k_max = N - w,  k_min = 2·top - k_max      (a layer holds at most N)
    B_l     = w + k_max - l·(k_max - k_min)/(L - 1)

rounded by largest remainder (ties to the lower layer) so the budgets sum to exactly ``L·T``:
``ratio`` stays the mean fraction kept. In the engine they are then moved onto its page grid
(:func:`~vllm_kvcomp.policies.base.snap_to_pages`: each within one page of the sequence, the sum
kept), since every head holds whole pages: without it each layer would round up by half a page
on average and hold ~3 % more than ``ratio`` at 2K (54 vs 57 requests admitted). ``T ≤ w`` or
``T ≥ N``: every layer keeps T; otherwise the pyramid is always built (the last layer holds
``w + (T - w)/beta ≥ w``). L counts the layers the policy is given (a hybrid model's
full-attention layers), in model order.

Differences from kvpress 0.5.5 ``PyramidKVPress.get_layer_budget``: it runs the sequence over the
whole mean budget ``K = N·(1 - compression_ratio)``, window included (``min = K/beta``,
``max = 2K - min``, capped at ``N - w``), ``round()``s each layer, and **falls back to SnapKV**
(``round(K)`` in every layer) unless ``N ≥ max ≥ min ≥ w``: uncapped whenever ``K < beta·w``
(at its defaults w = 64, beta = 20: under 1280 kept tokens, every prompt under 5120 tokens at
compression_ratio 0.75), capped whenever ``K < N/2`` or ``K > N - w``. On a 619-token prompt at
ratio 0.25 (w = 64, beta = 20, 30 layers) kvpress keeps 155 in every layer, this policy 241 → 69
(mean 155). The sequence over ``T - w`` plus the window in every layer is the authors' code and
the paper's; the authors' own fallbacks (no compression when ``N < T``, a uniform T when
``N < 2(T - w)``) are not followed either. ``tests/policies/test_pyramidkv.py`` pins the differences from kvpress.

Scores: :class:`~vllm_kvcomp.policies.snapkv.SnapKV` (window votes, pooling, ``heads``), applied
through :class:`~vllm_kvcomp.policies.wrappers.LayerBudgets`. One-shot after prefill; with
``decode=recompress`` every later compression returns each layer to the budget its first gave it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, ClassVar

from vllm_kvcomp.params import Param
from vllm_kvcomp.policies.base import (
    LayerKV,
    Policy,
    RequestState,
    Selection,
    budget_basis,
    snap_to_pages,
)
from vllm_kvcomp.policies.snapkv import SnapKV
from vllm_kvcomp.policies.wrappers import LayerBudgets


@dataclass
class PyramidBudget:
    """A layer's per-head budget, fixed by the request's first compression."""

    budget: int = 0


def pyramid_budgets(num_layers: int, target: int, length: int, window: int, beta: int) -> list[int]:
    """Per-head budgets of ``num_layers`` layers (first layer first) for ``length`` live tokens:
    ``window`` plus a linearly decreasing selected part, summing to ``num_layers · target``."""
    top = target - window
    if num_layers <= 1 or top <= 0 or top >= length - window:
        return [target] * num_layers
    low = Fraction(top, beta)
    high = 2 * top - low
    if high > length - window:
        high = Fraction(length - window)
        low = 2 * top - high
    step = (high - low) / (num_layers - 1)
    exact = [high - layer * step for layer in range(num_layers)]
    floors = [int(b) for b in exact]  # floor: every part is positive
    missing = num_layers * top - sum(floors)
    for layer in sorted(range(num_layers), key=lambda i: (floors[i] - exact[i], i))[:missing]:
        floors[layer] += 1
    return [window + b for b in floors]


@dataclass
class PyramidKV(Policy):
    """SnapKV inside each layer, per-layer budgets decreasing linearly with depth (mean = T)."""

    name: ClassVar[str] = "pyramidkv"
    KEEPS: ClassVar[str] = "SnapKV per layer, budgets decreasing linearly with depth (mean = `ratio`)"
    PAPER: ClassVar[str] = "Cai et al. 2024"
    TEST_PARAMS: ClassVar[Mapping[str, Any]] = {"ratio": 0.5, "window": 8}
    READS_VALUES: ClassVar[bool] = False
    PARAMS: ClassVar[dict[str, Param]] = {
        **SnapKV.PARAMS,
        "beta": Param("beta", int, 20, 1, 1024,
                      help="pyramid steepness: the last layer's selected part is the mean's / beta"),
    }

    ratio: float | None = 0.5
    budget: int | None = None
    window: int = 32
    kernel: int = 7
    beta: int = 20
    heads: str = "uniform"

    def check(self) -> None:
        """``window`` and ``kernel`` are SnapKV's, with its rules."""
        self.scorer().check()

    def scorer(self) -> SnapKV:
        """The SnapKV policy that scores (and allocates within) each layer."""
        return SnapKV(ratio=self.ratio, budget=self.budget, window=self.window, kernel=self.kernel,
                      heads=self.heads)

    def queries_needed(self) -> int:
        return self.window

    def budgets_on_pages(self) -> bool:
        return True  # the pyramid is snapped (snap_to_pages)

    def mean_kept_bound(self, prompt_len: int, num_heads: int | None = None) -> int | None:
        """The layer budgets average exactly ``target_budget`` (:func:`pyramid_budgets`)."""
        return min(prompt_len, self.target_budget(prompt_len))

    def select(self, layers: Sequence[LayerKV], state: RequestState) -> list[Selection]:
        if not layers:
            return []
        if state.budget is None:  # the first compression lays the pyramid over the prompt
            longest = budget_basis(layers, state)
            ordered = sorted(layers, key=lambda kv: kv.layer)
            pyramid = pyramid_budgets(len(ordered), self.target_budget(longest), longest, self.window, self.beta)
            pyramid = snap_to_pages(pyramid, state.page_quantum, longest)
            for kv, budget in zip(ordered, pyramid):
                state.layer(kv.layer, PyramidBudget).budget = budget
        budgets = [1] * layers[0].num_layers  # layers not given (sliding-window ones) are never read
        for kv in layers:
            budgets[kv.layer] = state.layer(kv.layer, PyramidBudget).budget
        return LayerBudgets(inner=self.scorer(), budgets=budgets).select(layers, state)

    def commit_kept(self, layers: Sequence[LayerKV], state: RequestState, picks: Sequence[Selection],
                    kept: Sequence[Selection]) -> None:
        self.scorer().commit_kept(layers, state, picks, kept)
