"""``expected_attention``: Expected Attention (Devoto et al., 2025, "Expected Attention: KV Cache
Compression by Estimating Attention from Future Queries Distribution"; kvpress
``ExpectedAttentionPress``): keep the tokens that *future* queries are expected to attend to.

Future queries of query head q are modelled as a Gaussian N(μ_q, Σ_q). With softmax scale s the
expected unnormalised attention of key k is the Gaussian moment generating function
``E[exp(s·qᵀk)] = exp(s·μ_qᵀk + ½·s²·kᵀΣ_q k)``; per KV head h with query group G(h):

    z_{q,i}  = s·μ_qᵀk_i + ½·s²·k_iᵀ Σ_q k_i
    p_{q,i}  = softmax_i z_{q,i}          over the head's live tokens after the first ``sink``
    score_i  = (mean_{q ∈ G(h)} p_{q,i} + ε) · ||v_i||₂

exactly as kvpress's ``score`` (s = 1/√d there: ``/ math.sqrt(d)`` and ``/ d / 2``; the mean over
the group; ``(scores + epsilon) * values.norm(dim=-1)``; the first ``n_sink`` tokens left out of
the softmax and always kept). Sink tokens score +inf here (kvpress: the maximum + 1).

Query statistics — the deviation our inputs force. kvpress takes the *pre-RoPE* queries of the
whole prompt (after its first ``n_sink``), their mean and covariance (divided by the count), and
rotates both by the RoPE rotation averaged over the next ``n_future_positions`` (512) positions:
``μ ← R̄μ, Σ ← R̄ΣR̄ᵀ``. A :class:`LayerKV` carries post-RoPE queries, their positions and no
rotary frequencies, so they cannot be un-rotated. Here μ_q and Σ_q are the mean and covariance
(divided by the count, as kvpress) of the **post-RoPE** queries of the last ``observe`` prompt
tokens. If a head's pre-RoPE queries were constant, that mean is the RoPE rotation averaged over
the *window's* positions applied to it (kvpress: over the next 512), and the covariance adds the
spread of the rotated means: the mixture-of-Gaussians estimate kvpress leaves commented out.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from vllm_kvcomp.params import Param
from vllm_kvcomp.policies.base import LayerKV, RequestState, ScorePolicy, visible_softmax
from vllm_kvcomp.policies.wrappers import HEADS_PARAMS, HeadsChoice


def expected_attention_scores(kv: LayerKV, sink: int, epsilon: float, value_norm: bool = True) -> torch.Tensor:
    """[H_kv, N] ``(group-mean expected attention + epsilon) · ||v||₂`` (without the factor
    ``||v||₂`` if not ``value_norm``: kvpress ``use_vnorm=False``); +inf on each head's first
    ``sink`` live slots, 0 on invalid ones. Statistics of ``kv.queries`` [H_q, w, D], computed in
    float32 (float64 for float64 keys)."""
    if kv.queries is None:
        raise ValueError("expected_attention needs observation-window queries, none were captured")
    hq, w, d = kv.queries.shape
    hk, n = kv.num_kv_heads, kv.num_slots
    acc = torch.float64 if kv.keys.dtype == torch.float64 else torch.float32
    queries = kv.queries.to(acc).reshape(hk, hq // hk, w, d)  # query head i reads KV head i // group
    keys = kv.keys.to(acc)
    mean = queries.mean(dim=2)  # [H_kv, G, D]
    centred = queries - mean.unsqueeze(2)
    cov = torch.einsum("kgwi,kgwj->kgij", centred, centred) / w  # [H_kv, G, D, D]
    s = kv.softmax_scale
    logits = s * torch.einsum("kgd,knd->kgn", mean, keys) + 0.5 * s * s * torch.einsum(
        "kni,kgij,knj->kgn", keys, cov, keys)
    start = (n - kv.valid_lengths()).unsqueeze(1)  # [H_kv, 1] first live slot
    slots = torch.arange(n).unsqueeze(0)
    sinks = (slots >= start) & (slots < start + sink)  # [H_kv, N]
    scored = (slots >= start + sink).to(logits.device)
    probs = visible_softmax(logits.masked_fill(~scored.unsqueeze(1), float("-inf"))).mean(dim=1)
    norms = kv.values.to(acc).norm(dim=-1) if value_norm else 1.0
    scores = (probs + epsilon) * norms * scored
    return scores.cpu().masked_fill(sinks, float("inf"))


@dataclass
class ExpectedAttention(HeadsChoice, ScorePolicy):
    """Expected attention of future queries (Gaussian from the window queries) times value norm."""

    name: ClassVar[str] = "expected_attention"
    KEEPS: ClassVar[str] = "tokens with the most expected attention of future queries × value norm, + `sink`"
    PAPER: ClassVar[str] = "Devoto et al. 2025"
    TEST_PARAMS: ClassVar[Mapping[str, Any]] = {"ratio": 0.5, "sink": 4, "observe": 8}
    PARAMS: ClassVar[dict[str, Param]] = {
        "observe": Param("observe", int, 64, 1, 4096,
                         help="trailing prompt queries whose mean and covariance model future queries"),
        "epsilon": Param("epsilon", float, 0.0, 0.0, 1.0,
                         help="added to the expected attention before the value-norm product"),
        **HEADS_PARAMS,
    }

    ratio: float | None = 0.5
    budget: int | None = None
    sink: int = 4
    observe: int = 64
    epsilon: float = 0.0
    heads: str = "uniform"

    def queries_needed(self) -> int:
        return self.observe

    def score(self, kv: LayerKV, state: RequestState) -> torch.Tensor:
        """[H_kv, N] by :func:`expected_attention_scores`."""
        return expected_attention_scores(kv, self.sink, self.epsilon)
