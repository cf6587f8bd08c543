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
"""

from __future__ import annotations

import math
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
    protected_topk,
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


def projected_value_norms(kv: LayerKV, dtype: torch.dtype | None = None, start: int = 0) -> torch.Tensor:
    """[H_kv, N - start] ``mean_{q ∈ G(h)} ||v_i W_o^q||₁`` of ``kv.values[:, start:]`` [H_kv, N, D] with
    ``kv.out_proj`` [H_q, D, hidden], on the weight's device: multiplied in ``dtype`` (default
    :func:`projection_dtype`), the L1 norms summed in float32 (float64 for float64); one fused
    Triton launch per layer on a GPU (:func:`vllm_kvcomp.kernels.projected_l1_norms`)."""
    weight = kv.out_proj
    if weight is None:
        raise ValueError("criticalkv needs the layer's output projection (LayerKV.out_proj), none was given")
    hq, d, _ = weight.shape
    hk = kv.num_kv_heads
    if d != kv.values.shape[-1] or hq % hk:
        raise ValueError(f"output projection {tuple(weight.shape)} does not fit {hk} KV heads of dimension "
                         f"{kv.values.shape[-1]}")
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

    def _ranked(self, kv: LayerKV, state: RequestState) -> tuple[torch.Tensor, list[int]]:
        """The critical scores [H_kv, N] and each head's kept count b_h (the budget; AdaKV's
        allocation by the inner score under ``heads=adaptive``)."""
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
        norms = remembered_value_norms(kv, state.token_memory(kv.layer, NormMemory))
        return critical_scores(inner.scores, norms, first, self.epsilon), counts

    def score(self, kv: LayerKV, state: RequestState) -> torch.Tensor:
        """[H_kv, N] what the selection ranks by: +inf on the stage-1 picks, ``(s + ε) · n`` elsewhere."""
        return self._ranked(kv, state)[0]

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
        scores, counts = self._ranked(kv, state)
        sink, window = self.protected()
        ranking = Ranking(scores)
        return Selection(protected_topk(ranking, counts, kv.valid_lengths(), sink, window), priority=ranking)
