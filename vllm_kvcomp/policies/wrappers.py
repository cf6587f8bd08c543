"""Budget schemes that compose over any :class:`ScorePolicy`.

* :func:`adaptive_topk` / :class:`AdaptiveHeads`: AdaKV-style allocation. A layer's total budget
  H·B (or every live slot, if fewer) goes to the globally best scores over all its heads, after a
  per-head floor of ``ceil(floor · B)`` tokens (AdaKV's safeguard, default 0.2) plus the inner
  policy's sink/window.
* :class:`LayerBudgets`: explicit per-layer per-head budgets.
* :class:`HeadsChoice`: mixin giving a score policy the spec extra ``heads=uniform|adaptive``.

Scores must be comparable across the heads of a layer for adaptive allocation to mean anything
(attention mass: SnapKV, H2O; key norms: KNorm).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import ClassVar

import torch

from vllm_kvcomp.params import Param, SpecError
from vllm_kvcomp.policies.base import (
    LayerKV,
    LayerRows,
    Policy,
    Ranking,
    RequestState,
    ScorePolicy,
    Selection,
    budget_basis,
    live_mask,
    page_count,
    protected_mask,
    protected_topk_layers,
    snap_to_pages,
)

#: AdaKV's safeguard: every head keeps at least this fraction of the per-head budget.
ADAPTIVE_FLOOR = 0.2

HEADS_PARAMS: dict[str, Param] = {
    "heads": Param(
        "heads", str, "uniform", choices=("uniform", "adaptive"),
        help="per-head budget: uniform (same count per head) or adaptive (AdaKV, global top-k)",
    )
}


def adaptive_topk(
    scores: torch.Tensor | Ranking,
    budget: int,
    lengths: torch.Tensor,
    sink: int = 0,
    window: int = 0,
    floor: float = ADAPTIVE_FLOOR,
    quantum: tuple[int, int] | None = None,
) -> list[torch.Tensor]:
    """AdaKV allocation of ``min(H · budget, sum_h length_h)`` slots over the H heads of one layer.

    scores [H, N] (higher = keep), lengths [H] right-aligned live slots. Each head first keeps
    ``max(sink + window, ceil(floor · budget))`` slots by :func:`protected_topk`; the rest of the
    layer's total goes to the best remaining scores over all heads. Returns H sorted index tensors.
    The total is the layer's, not each head's ``min(budget, length_h)`` summed: in a decode
    recompression a head that was given little holds less than ``budget``, and what it does not
    use stays with the layer (summed per head, the total shrank at every recompression: h2o
    adaptive held 0.19 of the cache at ratio 0.25, issue #28).

    On the engine's page grid ``quantum`` (block_size, residue) the floor is rounded up to it and
    the heads' counts move onto it with their sum kept (:func:`snap_to_pages`: a head drops its
    lowest picks or takes its next best), so the layer holds its total within one page instead of
    up to a page more per head. Several layers at once: :func:`adaptive_topk_layers`.
    """
    return adaptive_topk_layers([Ranking.of(scores)], [budget], [lengths], [(sink, window)], floor=floor,
                                quantum=quantum)[0]


def adaptive_topk_layers(
    rankings: Sequence[Ranking],
    budgets: Sequence[int],
    lengths: Sequence[torch.Tensor],
    protected: Sequence[tuple[int, int]],
    *,
    floor: float = ADAPTIVE_FLOOR,
    quantum: tuple[int, int] | None = None,
) -> list[list[torch.Tensor]]:
    """:func:`adaptive_topk` of every layer in one pass (an :class:`Allocator`): the layers'
    heads as rows of one [L·H, N] ranking, each layer's global cut one row of an [L, H·N] sort.
    The same picks as layer by layer (a layer's candidates keep their order and ties)."""
    if not rankings:
        return []
    rows = LayerRows(rankings, lengths)
    heads, n, layers = rows.heads, rows.ranking.scores.shape[1], len(rankings)
    scores = rows.ranking.scores
    layer_lengths = rows.lengths.view(layers, heads)
    totals = torch.minimum(torch.tensor([int(b) * heads for b in budgets]), layer_lengths.sum(1))
    bases = []
    for b, (s, w), ranking in zip(budgets, protected, rankings):
        base = min(int(b), max(s + w, math.ceil(floor * int(b) - 1e-9)))
        bases.append(page_count(base, ranking.scores.shape[1], quantum) if quantum is not None else base)
    sinks, windows = rows.per_row([s for s, _ in protected]), rows.per_row([w for _, w in protected])
    taken = protected_mask(rows.ranking, rows.per_row(bases), rows.lengths, sinks, windows)  # [L·H, N]
    extra = totals - taken.view(layers, -1).sum(1)
    if bool((extra > 0).any()):
        hidden = (~live_mask(rows.lengths, n) | taken).to(scores.device)
        candidates = scores.float().masked_fill(hidden, float("-inf")).view(layers, -1)  # ranked where the scores are
        best = torch.sort(candidates, dim=1, descending=True, stable=True).indices.cpu()  # [L, H·N]
        picked = torch.arange(heads * n).unsqueeze(0) < extra.clamp(min=0).unsqueeze(1)  # each layer's first `extra`
        taken.view(layers, -1).logical_or_(torch.zeros_like(picked).scatter_(1, best, picked))
    if quantum is not None:
        counts = taken.sum(1).view(layers, heads).tolist()
        snapped = [snap_to_pages(c, quantum, n_l) for c, n_l in zip(counts, layer_lengths.tolist())]
        moved = [layer for layer, (c, sn) in enumerate(zip(counts, snapped)) if c != sn]
        if moved:  # those layers' heads re-picked at their snapped counts
            again = rows.layer_rows(protected_mask(rows.ranking, rows.per_row(snapped), rows.lengths, sinks, windows))
            mine = rows.layer_rows(taken)
            for layer in moved:
                mine[layer].copy_(again[layer])
    return rows.split(taken)


class HeadsChoice:
    """Mixin for score policies with a ``heads`` field: ``adaptive`` allocates by :func:`adaptive_topk_layers`."""

    heads: str

    def allocates_across_heads(self) -> bool:
        return self.heads == "adaptive"

    def allocate(
        self, rankings: Sequence[Ranking], budgets: Sequence[int], lengths: Sequence[torch.Tensor],
        protected: Sequence[tuple[int, int]], *, quantum: tuple[int, int] | None = None,
    ) -> list[list[torch.Tensor]]:
        if self.heads == "adaptive":
            return adaptive_topk_layers(rankings, budgets, lengths, protected, quantum=quantum)
        return protected_topk_layers(rankings, budgets, lengths, protected)


@dataclass
class _Wrapper(Policy):
    """Delegates the engine-facing questions to ``inner``."""

    inner: ScorePolicy | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.inner, ScorePolicy):
            raise SpecError("inner", "a wrapper needs a score policy", "a ScorePolicy instance")
        self.RECOMPRESSES, self.decode = self.inner.RECOMPRESSES, self.inner.decode  # the engine asks `recompresses`
        self.READS_VALUES, self.NEEDS_OUT_PROJ = self.inner.READS_VALUES, self.inner.NEEDS_OUT_PROJ  # what it reads
        self.OBSERVES_ATTENTION = self.inner.OBSERVES_ATTENTION
        self.check()

    def queries_needed(self) -> int:
        return self.inner.queries_needed()

    def kept_for(self, n_tokens: int) -> int:
        return self.inner.kept_for(n_tokens)

    def target_budget(self, n_tokens: int) -> int:
        return self.inner.target_budget(n_tokens)

    def due(self, state: RequestState, num_tokens: int, steps_since: int) -> bool:
        return self.inner.due(state, num_tokens, steps_since)

    def commit_kept(self, layers: Sequence[LayerKV], state: RequestState, picks: Sequence[Selection],
                    kept: Sequence[Selection]) -> None:
        self.inner.commit_kept(layers, state, picks, kept)


@dataclass
class AdaptiveHeads(_Wrapper):
    """AdaKV over ``inner``: per-layer total H·B, spread over heads by a global top-k."""

    name: ClassVar[str] = "adaptive"

    floor: float = ADAPTIVE_FLOOR

    def check(self) -> None:
        if not 0.0 <= self.floor <= 1.0:
            raise SpecError("floor", f"{self.floor:g} is out of range", "a number in [0, 1]")

    def mean_kept_bound(self, prompt_len: int, num_heads: int | None = None) -> int | None:
        return self.target_budget(prompt_len)  # spread over heads, the layer total is H·B

    def budgets_on_pages(self) -> bool:
        return True

    def select(self, layers: Sequence[LayerKV], state: RequestState) -> list[Selection]:
        if layers and state.budget is None:
            state.budget = self.target_budget(budget_basis(layers, state))
        return self.inner.select_scored(layers, state, [state.budget] * len(layers),
                                        partial(adaptive_topk_layers, floor=self.floor), True)


@dataclass
class LayerBudgets(_Wrapper):
    """``inner`` with an explicit per-head budget per layer: ``budgets[layer]`` kept tokens.

    ``RequestState.budget`` is the largest of them (decode recompression is due past it); the
    inner policy's own allocation (e.g. ``heads=adaptive``) is kept.
    """

    name: ClassVar[str] = "layer_budgets"

    budgets: Sequence[int] = ()

    def check(self) -> None:
        if not self.budgets or any(int(b) < 1 for b in self.budgets):
            raise SpecError("budgets", f"invalid per-layer budgets {self.budgets!r}", "positive integers, one per layer")

    def mean_kept_bound(self, prompt_len: int, num_heads: int | None = None) -> int | None:
        return min(prompt_len, -(-sum(int(b) for b in self.budgets) // len(self.budgets)))

    def budgets_on_pages(self) -> bool:
        return self.inner.budgets_on_pages()

    def select(self, layers: Sequence[LayerKV], state: RequestState) -> list[Selection]:
        if layers and len(self.budgets) < layers[0].num_layers:
            raise SpecError(
                "budgets", f"{len(self.budgets)} budgets for {layers[0].num_layers} layers", "one per layer"
            )
        if state.budget is None:
            state.budget = max(int(b) for b in self.budgets)
        return self.inner.select_scored(layers, state, [int(self.budgets[kv.layer]) for kv in layers],
                                        self.inner.allocate, self.inner.allocates_across_heads())
