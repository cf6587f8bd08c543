"""``criticalkv``: CriticalKV / CriticalAdaKV (Feng et al., 2025, "Identify Critical KV Cache in LLM
Inference from an Output Perturbation Perspective", arXiv 2502.03805): an output-aware second stage
over an attention score.

A head's attention output is ``Σ_i A_i · v_i W_o^q`` (W_o^q: query head q's rows of the output
projection), so evicting token i perturbs it by up to ``A_i · ||v_i W_o^q||₁``; the paper bounds
the L1 output perturbation by such terms and selects greedily in two stages, the first by attention
alone (which keeps the bound's normalisation in check). Definition implemented — the authors' own
code (``FFY0/DefensiveKV``, ``kvpress/presses/criticalkv_press.py``) as contributed to NVIDIA
kvpress (``kvpress/presses/criticalkv_press.py``, ``CriticalKVPress`` / ``CriticalAdaKVPress``),
since the paper's text was not at hand to cite equation numbers:

    s_i      inner score of token i (``inner``: SnapKV or Expected Attention without its value
             norm, kvpress's own pairings, ``evaluation/evaluate_registry.py``)
    n_i      = mean_{q ∈ G(h)} ||v_i W_o^q||₁        (kvpress ``vwl1norm``: L1 over the hidden
             size, mean over the KV head's query group)
    stage 1  the head's top ``floor(first_stage_ratio · b)`` tokens by s, b = the head's kept
             count; the inner's sink/window lead it (kvpress pads them with the maximum score)
    stage 2  the rest of b by ``(s_i + epsilon) · n_i``   (kvpress ``(scores + epsilon) *
             projected_norm``; stage-1 picks score the maximum, here +inf)

``heads=adaptive`` is CriticalAdaKV as kvpress does it: the per-head counts b_h come from AdaKV's
allocation over the layer by the *inner* score (:func:`~vllm_kvcomp.policies.wrappers.adaptive_topk`,
every tensor-parallel rank's heads), then each head runs the two stages with its b_h; the AdaKV
safeguard tokens stay in stage 1 (kvpress scores them the maximum before both stages).

Where kvpress's numbers differ: the inner's sink/window are always kept, also when they exceed
the stage-1 share (kvpress: its padded maximum may lose in stage 2), so stage 1 takes at least
them; SnapKV's score here is the mean over the window queries (kvpress's scale, which ``epsilon``
is relative to; ``snapkv`` alone sums them, the same ranking); b is ``ceil(ratio·N)``, then rounded
up to the page grid by the critical score (kvpress: ``int(ratio·N)``, stage 1
``int(ratio·N·first_stage_ratio)``); the AdaKV safeguard is ``ceil(0.2·B)`` (kvpress ``int``).
One-shot after prefill.

Cost: the projection is ``H_q · N · D · hidden`` multiply-adds a layer (about 40 GFLOP at 2K on
the bundled model). On the host, a selection projects only the slots that can reach the depth its
ranking is read to (:func:`pruned_critical_scores`): the others are ruled out by an upper bound
of their norm (``||x||₁ ≤ √hidden · ||x||₂``, ``||v W_o^q||₂`` through a D x D factor of
``W_o^q W_o^qᵀ``), and the kept set is exactly the one every norm would give. On a GPU the fused
kernel projects every slot (no host round trip per refinement).
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from vllm_kvcomp.kernels import projected_l1_norms
from vllm_kvcomp.params import Param, SpecError
from vllm_kvcomp.policies.base import (
    LayerKV,
    Ranking,
    RequestState,
    ScorePolicy,
    Selection,
    SlotMemory,
    budget_basis,
    live_mask,
    protected_topk,
    slot_mask,
)
from vllm_kvcomp.policies.expected_attention import ExpectedAttention, expected_attention_scores
from vllm_kvcomp.policies.snapkv import SnapKV
from vllm_kvcomp.policies.wrappers import ADAPTIVE_FLOOR, HEADS_PARAMS, adaptive_topk_layers


@dataclass
class SnapKVMean(SnapKV):
    """SnapKV's pooled window votes as kvpress scores them: the mean over the window queries."""

    def score(self, kv: LayerKV, state: RequestState) -> torch.Tensor:
        return super().score(kv, state) / kv.queries.shape[1]


@dataclass
class ExpectedAttentionNoNorm(ExpectedAttention):
    """Expected attention without the value-norm factor (kvpress ``use_vnorm=False``, which
    CriticalKV asks for: the projected value norm replaces it)."""

    def score(self, kv: LayerKV, state: RequestState) -> torch.Tensor:
        return expected_attention_scores(kv, self.sink, 0.0, value_norm=False)


#: ``inner`` -> the score policy of stage 1, and the keys of it a spec may set
INNER_SCORERS: dict[str, tuple[type[ScorePolicy], tuple[str, ...]]] = {
    "snapkv": (SnapKVMean, ("window", "kernel")),
    "expected_attention": (ExpectedAttentionNoNorm, ("sink", "observe")),
}


def projection_dtype(values: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype ``v W_o`` is multiplied in: float64 for float64 values (tests); on a GPU the
    weight's own (the model's dtype, as its ``o_proj`` and kvpress's ``vwl1norm`` multiply: bf16 on
    tensor cores; float32 took 1.6 s of GPU time per 32K prompt on an H100); float32 on the host."""
    if values.dtype == torch.float64:
        return torch.float64
    if weight.device.type == "cuda" and weight.dtype in (torch.float16, torch.bfloat16):
        return weight.dtype
    return torch.float32


def out_projection(kv: LayerKV) -> torch.Tensor:
    """``kv.out_proj`` [H_q, D, hidden], checked against the layer's heads."""
    weight = kv.out_proj
    if weight is None:
        raise ValueError("criticalkv needs the layer's output projection (LayerKV.out_proj), none was given")
    hq, d, _ = weight.shape
    hk = kv.num_kv_heads
    if d != kv.values.shape[-1] or hq % hk:
        raise ValueError(f"output projection {tuple(weight.shape)} does not fit {hk} KV heads of dimension "
                         f"{kv.values.shape[-1]}")
    return weight


def projected_value_norms(kv: LayerKV, dtype: torch.dtype | None = None, start: int = 0) -> torch.Tensor:
    """[H_kv, N - start] ``mean_{q ∈ G(h)} ||v_i W_o^q||₁`` of ``kv.values[:, start:]`` [H_kv, N, D] with
    ``kv.out_proj`` [H_q, D, hidden], on the weight's device: multiplied in ``dtype`` (default
    :func:`projection_dtype`), the L1 norms summed in float32 (float64 for float64); one fused
    Triton launch per layer on a GPU (:func:`vllm_kvcomp.kernels.projected_l1_norms`)."""
    weight = out_projection(kv)
    return projected_l1_norms(kv.values[:, start:], weight, dtype or projection_dtype(kv.values, weight))


@dataclass
class NormMemory:
    """One layer's projected value norms by logical position: n_i depends on token i's value
    alone, so a recompression projects only the tokens it has not seen (a decode recompression its
    page of generated tokens, a ``prefill=block`` chunk its own), and a restart keeps them."""

    norms: SlotMemory | None = None
    pending: torch.Tensor | None = None  # [H_kv, N] this compression's norms, until the commit


def remembered_value_norms(kv: LayerKV, memory: NormMemory) -> torch.Tensor:
    """[H_kv, N] host :func:`projected_value_norms` of ``kv``, those of remembered positions
    looked up in ``memory``: only the slots from the first one some head has not seen are
    projected. Pending in ``memory`` until :meth:`CriticalKV.commit_kept`."""
    positions = kv.slot_positions().to(torch.long).cpu()
    if memory.norms is None:
        norms = projected_value_norms(kv).cpu()
    else:
        norms = memory.norms.lookup(positions, fill=float("nan"))
        unseen = (norms.isnan() & (positions >= 0)).any(0).nonzero()
        norms = norms.nan_to_num(0.0)
        if len(unseen):
            start = int(unseen[0])
            norms[:, start:] = projected_value_norms(kv, start=start).cpu().to(norms.dtype)
    memory.pending = norms
    return norms


def critical_scores(inner: torch.Tensor, norms: torch.Tensor, first: list[torch.Tensor],
                    epsilon: float) -> torch.Tensor:
    """[H, N] stage 2 ``(inner + epsilon) · norms``; +inf on each head's stage-1 picks ``first``
    and where the inner score is infinite (a slot the inner policy always keeps)."""
    scores = torch.where(torch.isinf(inner), inner, (inner + epsilon) * norms.to(inner.device, inner.dtype))
    for h, idx in enumerate(first):
        scores[h, idx.to(scores.device)] = float("inf")
    return scores


#: relative slack of :func:`projected_norm_bounds` over the exact product's rounding (float32:
#: at most ~hidden · 2^-24 ≈ 4e-5 relative for hidden = 576; bf16 products are never pruned)
BOUND_SLACK = 1e-3
#: slots projected per head in a pruned selection's first round beyond 1.25x what it needs (then
#: 1.5x as many until exact)
FIRST_ROUND = 16


#: id(weight) -> (a weak reference to it, its :func:`norm_factor`): a model's weights are read-only
#: while served and factored once (an entry goes when its weight does)
_FACTORS: dict[int, tuple[weakref.ref, tuple[torch.Tensor, torch.Tensor]]] = {}


def norm_factor(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``F`` [H_q, D, D] with ``F_q F_qᵀ = W_o^q W_o^qᵀ`` (eigen-factor, float64) and each query
    head's largest singular value [H_q, 1], of ``weight`` [H_q, D, hidden]; made once per weight."""
    entry = _FACTORS.get(id(weight))
    if entry is not None and entry[0]() is weight:
        return entry[1]
    w = weight.to(torch.float64)
    eigenvalues, vectors = torch.linalg.eigh(w @ w.transpose(1, 2))  # [H_q, D], [H_q, D, D]
    eigenvalues = eigenvalues.clamp(min=0)
    made = (vectors * eigenvalues.sqrt().unsqueeze(1), eigenvalues.amax(dim=-1, keepdim=True).sqrt())
    key = id(weight)
    _FACTORS[key] = (weakref.ref(weight, lambda _: _FACTORS.pop(key, None)), made)
    return made


def projected_norm_bounds(kv: LayerKV) -> torch.Tensor:
    """[H_kv, N] upper bounds of :func:`projected_value_norms`: per query head
    ``||v W_o^q||₁ ≤ √hidden · ||v W_o^q||₂ = √hidden · ||v F_q||₂`` (:func:`norm_factor`): D²
    multiply-adds per slot and query head instead of D · hidden, in the values' dtype (float32:
    its rounding is below 1/30 of the absolute slack), then :data:`BOUND_SLACK` relative and the
    same share of the largest norm ``||v|| · σ_max`` absolute."""
    weight = out_projection(kv)
    hq, _, hidden = weight.shape
    hk, n = kv.num_kv_heads, kv.values.shape[1]
    group = hq // hk
    factor, sigma = norm_factor(weight)
    dtype = torch.float64 if kv.values.dtype == torch.float64 else torch.float32
    values = kv.values.to(dtype)  # [H_kv, N, D]; one product per KV head for its whole group
    grouped = factor.to(values.device, dtype).view(hk, group, -1, factor.shape[-1]).transpose(1, 2).flatten(2)
    l2 = torch.bmm(values, grouped).view(hk, n, group, -1).square().sum(-1).sqrt().transpose(1, 2)  # [H_kv, G, N]
    largest = values.norm(dim=-1).unsqueeze(1).double() * sigma.to(values.device).view(hk, group, 1)
    bound = (l2.double() * (1 + BOUND_SLACK) + largest * BOUND_SLACK) * math.sqrt(hidden)
    return bound.mean(dim=1)


def pruned_critical_scores(inner: torch.Tensor, kv: LayerKV, memory: NormMemory, first: list[torch.Tensor],
                           depth: torch.Tensor, epsilon: float) -> torch.Tensor:
    """[H, N] host :func:`critical_scores` exact down to each head's ``depth`` best live slots
    (+inf first) and -inf below: only slots whose score could reach that depth are projected.

    Rounds: per head, the candidates (live, finite inner, not stage 1) in the order of an upper
    bound of their score ``max(s + ε, 0) · bound(n)`` (:func:`projected_norm_bounds`); the first
    ``M`` are projected (remembered norms are not projected again), and the head is exact once the
    next candidate's bound is below its ``need``-th best projected score (``need``: ``depth`` less
    its +inf slots), else ``M`` grows by half. Every slot scoring at least that is projected, so the top
    ``depth`` is the one every norm gives, ties included. Pending in ``memory`` as
    :func:`remembered_value_norms`, NaN where not projected."""
    hk, n = inner.shape
    inner = inner.cpu()
    live = live_mask(kv.valid_lengths(), n)
    positions = kv.slot_positions().to(torch.long).cpu()
    norms = (memory.norms.lookup(positions, fill=float("nan")) if memory.norms is not None
             else torch.full((hk, n), float("nan"), dtype=torch.float64 if kv.values.dtype == torch.float64
                             else torch.float32))  # what projected_l1_norms sums in
    stage1 = slot_mask(first, n)
    fixed = live & (torch.isposinf(inner) | stage1)  # +inf: ranked first whatever the norm
    candidates = live & torch.isfinite(inner) & ~stage1
    need = (depth - fixed.sum(dim=1)).clamp(min=0)
    gain = (inner + epsilon).clamp(min=0).to(torch.float64)  # a negative one scores at most 0
    bound = torch.where(candidates, gain * projected_norm_bounds(kv).cpu(), -math.inf)
    order = bound.argsort(dim=1, descending=True, stable=True)  # candidates first
    available = candidates.sum(dim=1)
    reach = torch.minimum(need + need // 4 + FIRST_ROUND, available)
    reach = torch.where(need > 0, reach, 0)
    group = kv.out_proj.shape[0] // hk
    while True:
        chosen = torch.arange(n).unsqueeze(0) < reach.unsqueeze(1)  # in bound order
        wanted = torch.zeros(hk, n, dtype=torch.bool).scatter_(1, order, chosen) & norms.isnan()
        for h in wanted.any(dim=1).nonzero().flatten().tolist():  # one head at a time: no padding rows
            rows = wanted[h].nonzero().flatten()
            values = kv.values[h, rows.to(kv.values.device)].unsqueeze(0)
            weight = kv.out_proj[h * group:(h + 1) * group]
            norms[h, rows] = projected_l1_norms(values, weight, projection_dtype(values, weight))[0].cpu().to(norms.dtype)
        exact = torch.where(candidates & ~norms.isnan(), (inner + epsilon) * norms.to(inner.dtype), -math.inf)
        kth = exact.sort(dim=1, descending=True).values.gather(1, (need - 1).clamp(0, n - 1).unsqueeze(1)).squeeze(1)
        next_bound = torch.where(reach < available, bound.gather(1, reach.clamp(max=n - 1).unsqueeze(1)).squeeze(1),
                                 -math.inf)
        open_heads = (need > 0) & (reach < available) & ~(next_bound < kth.to(torch.float64))
        if not bool(open_heads.any()):
            break
        reach = torch.where(open_heads, torch.minimum(reach + reach // 2, available), reach)
    memory.pending = norms
    scores = torch.where(candidates, exact, -math.inf).to(inner.dtype)
    scores = torch.where(live & torch.isinf(inner), inner, scores)  # as critical_scores: the inner's own
    return scores.masked_fill(stage1, math.inf)


@dataclass
class CriticalKV(ScorePolicy):
    """Two-stage selection: the inner score's top share, then inner score × ||W_o v||₁."""

    name: ClassVar[str] = "criticalkv"
    KEEPS: ClassVar[str] = ("top `first_stage_ratio` of the budget by the `inner` score, the rest by inner score "
                            "× ‖W_o·v‖₁ (+ the inner's window / sink)")
    PAPER: ClassVar[str] = "Feng et al. 2025"
    #: 0.4, not 0.5: at 0.5 the engine's oracle-equality prompt has two tokens whose critical
    #: scores differ by 1e-8 (0.22487736 vs 0.22487737), less than vLLM's and HF's forward differ
    TEST_PARAMS: ClassVar[Mapping[str, Any]] = {"ratio": 0.4}
    VARIANTS: ClassVar[Mapping[str, Mapping[str, Any]]] = {
        "adaptive": {"heads": "adaptive"}, "expected_attention": {"inner": "expected_attention"}}
    NEEDS_OUT_PROJ: ClassVar[bool] = True
    IMPLICIT_DEFAULTS: ClassVar[Mapping[str, str]] = {
        **ScorePolicy.IMPLICIT_DEFAULTS, "window": "32 (snapkv)", "kernel": "7 (snapkv)", "sink": "4 (expected_attention)",
        "observe": "64 (expected_attention)"}
    PARAMS: ClassVar[dict[str, Param]] = {
        "inner": Param("inner", str, "snapkv", choices=tuple(INNER_SCORERS),
                       help="the attention score of stage 1: snapkv (window votes) or expected_attention "
                       "(without its value norm)"),
        "kernel": Param("kernel", int, None, 1, 63, help="inner=snapkv: odd width of the 1-D average pooling"),
        "observe": Param("observe", int, None, 1, 4096,
                         help="inner=expected_attention: trailing prompt queries the Gaussian is fitted to"),
        "first_stage_ratio": Param("first_stage_ratio", float, 0.5, 0.0, 1.0,
                                   help="share of each head's budget picked by the inner score alone (stage 1)"),
        "epsilon": Param("epsilon", float, 1e-4, 0.0, 1.0,
                         help="added to the inner score before the product with ||W_o v||_1 (stage 2)"),
        **HEADS_PARAMS,
    }

    ratio: float | None = 0.5
    budget: int | None = None
    inner: str = "snapkv"
    window: int | None = None
    kernel: int | None = None
    sink: int | None = None
    observe: int | None = None
    first_stage_ratio: float = 0.5
    epsilon: float = 1e-4
    heads: str = "uniform"

    def __post_init__(self) -> None:
        self.scorer = self._inner_scorer()

    def _inner_scorer(self) -> ScorePolicy:
        """The stage-1 score policy of ``inner`` with this spec's size and the inner's own keys
        (its checks apply); SpecError for an unknown ``inner`` or another inner's key."""
        if self.inner not in INNER_SCORERS:
            raise SpecError("inner", f"unknown inner score policy {self.inner!r}", ", ".join(INNER_SCORERS))
        cls, own = INNER_SCORERS[self.inner]
        for other, (_, keys) in INNER_SCORERS.items():
            for key in keys:
                if key not in own and getattr(self, key) is not None:
                    raise SpecError(key, f"is a setting of inner={other}, not of inner={self.inner}",
                                    f"{', '.join(own)}, or inner={other}")
        size = {"ratio": self.ratio} if self.budget is None else {"budget": self.budget}
        return cls.from_settings({**size, **{k: getattr(self, k) for k in own if getattr(self, k) is not None}})

    def queries_needed(self) -> int:
        return self.scorer.queries_needed()

    def protected(self) -> tuple[int, int]:
        """The inner policy's (sink, window)."""
        return self.scorer.protected()

    def allocates_across_heads(self) -> bool:
        return self.heads == "adaptive"

    def _ranked(self, kv: LayerKV, state: RequestState, prune: bool) -> tuple[torch.Tensor, list[int]]:
        """The critical scores [H_kv, N] and each head's kept count b_h (the budget; AdaKV's
        allocation by the inner score under ``heads=adaptive``); ``prune``: on the host, exact only
        as deep as the selection reads them (:func:`pruned_critical_scores`)."""
        if state.budget is None:
            state.budget = self.target_budget(budget_basis([kv], state))
        lengths = kv.valid_lengths()
        sink, window = self.protected()
        if self.heads == "adaptive":
            pick = self.scorer.select_scored([kv], state, [state.budget], adaptive_topk_layers, across_heads=True)[0]
            inner, counts = pick.priority, pick.counts().tolist()  # its ranking: stage 1 reads its order
            safeguard = max(sink + window, math.ceil(ADAPTIVE_FLOOR * state.budget - 1e-9))
        else:
            inner, counts = Ranking(self.scorer.score(kv, state).float()), lengths.clamp(max=state.budget).tolist()
            safeguard = sink + window  # always kept: they lead stage 1 (kvpress scores them the maximum)
        first_counts = [max(int(self.first_stage_ratio * b + 1e-9), min(safeguard, b)) for b in counts]
        first = protected_topk(inner, first_counts, lengths, sink, window)
        memory = state.token_memory(kv.layer, NormMemory)
        if prune and out_projection(kv).device.type == "cpu":  # read to the budget, the page rounding after it
            depth = torch.tensor(counts) + sink + window + 2 * state.page_size
            return pruned_critical_scores(inner.scores, kv, memory, first, depth, self.epsilon), counts
        norms = remembered_value_norms(kv, memory)
        return critical_scores(inner.scores, norms, first, self.epsilon), counts

    def score(self, kv: LayerKV, state: RequestState) -> torch.Tensor:
        """[H_kv, N] what the selection ranks by: +inf on the stage-1 picks, ``(s + ε) · n`` elsewhere
        (every slot projected; a selection on the host projects only what it reads)."""
        return self._ranked(kv, state, prune=False)[0]

    def select(self, layers: Sequence[LayerKV], state: RequestState) -> list[Selection]:
        """Layer by layer: each layer's stage 1 needs its own counts before its scores exist."""
        return [self.select_layer(kv, state) for kv in layers]

    def commit_kept(self, layers: Sequence[LayerKV], state: RequestState, picks: Sequence[Selection],
                    kept: Sequence[Selection]) -> None:
        """Every layer's projected norms, remembered at its kept slots (one gather for all)."""
        memories = [state.token_memory(kv.layer, NormMemory) for kv in layers]
        norms = SlotMemory.kept_layers([m.pending for m in memories], [kv.slot_positions() for kv in layers],
                                       [selection.indices for selection in kept])
        for memory, remembered in zip(memories, norms):
            memory.norms, memory.pending = remembered, None

    def select_layer(self, kv: LayerKV, state: RequestState) -> Selection:
        scores, counts = self._ranked(kv, state, prune=True)
        sink, window = self.protected()
        ranking = Ranking(scores)
        return Selection(protected_topk(ranking, counts, kv.valid_lengths(), sink, window), priority=ranking)
