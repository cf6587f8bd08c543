"""``kvzap``: a trained scorer that predicts KVzip's context-reconstruction scores from the cache
itself (KVzap, arXiv 2601.07891; Fast KVzip, arXiv 2601.17668): query-agnostic, attention-free,
no second pass at serving time.

KVzip (Kim et al. 2025, arXiv 2505.23416) scores a context's KV pair by the attention it receives
while the model *repeats the context*: the context, a repeat prompt, then the context again fed as
queries; a pair's score is the maximum of that attention over the repeated tokens and the query
heads of its KV head. KVzap trains a small per-layer model to predict (the log of) those scores,
so serving needs no replay. Ours follows kvpress ``KVzapPress``'s linear variant
(``module_list[layer]``: ``score = W x + b``, ridge regression per layer, ``kvzap/train.py``) with
one deviation forced by where a vLLM plugin sits: kvpress's ``x`` is the layer's input hidden state,
which vLLM's attention layer never sees; ours is what the cache holds of it, per KV head h
(:func:`cache_features`):

    x_i = [ v_i ,  (sqrt(k_{i,j}² + k_{i,j+D/2}²))_{j < D/2} ]        (3D/2 numbers)
    score_{h,i} = w_{l,h} · x_i + b_{l,h}                                 ≈ log max-attention (KVzip)

``v = W_v h`` is a linear image of the hidden state; the key's rotary pairs (NeoX layout: j and
j + D/2, the layout of Llama, Qwen, Mistral and Gemma) have norms RoPE leaves unchanged (rounded to
bfloat16, so that its rounding noise does not either), so the features do not depend on the
token's position. The weights come from a ``kvzap`` calibration
profile (``vllm-kvcomp calibrate --kind kvzap``: the teacher's scores on locally made text,
:mod:`vllm_kvcomp.calibration.kvzap`); a model without one is refused with the command that makes it.

Selection: the highest predicted scores per KV head (``heads=uniform``) or per layer over its heads
(``heads=adaptive``, the default: KVzip's budgets are non-uniform over heads; its cross-layer
allocation is not applied here, each layer keeps its share), plus ``sink`` leading tokens (KVzip's
4) and the last ``window`` (the question, with ``scope=all``; 0 for KVzip's own). A token's score
depends on its own K and V only, so the prompt may be compressed chunk by chunk (``prefill=stream``)
and recompressed during decode.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from vllm_kvcomp.params import Param
from vllm_kvcomp.policies.base import LayerKV, RequestState, ScorePolicy
from vllm_kvcomp.policies.razor import PROFILE_PARAM, check_profile_name
from vllm_kvcomp.policies.wrappers import HeadsChoice


def feature_count(head_dim: int) -> int:
    """Numbers per token :func:`cache_features` gives for heads of dimension ``head_dim``."""
    return head_dim + head_dim // 2


def cache_features(keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """[H, N, 3D/2]: each token's value, then its key's rotary-pair norms (NeoX layout: dims j and
    j + D/2), unchanged by RoPE. The norms are rounded to bfloat16 (8 significant bits): RoPE's
    rotation, done in the cache's precision, leaves copies of one token at two positions with norms
    that differ in their last bits, and the rounding makes them equal again, so equal tokens tie
    exactly (and the later is kept first) wherever the scores are computed. float32 (float64 for
    float64 inputs)."""
    dtype = torch.float64 if keys.dtype == torch.float64 else torch.float32
    keys, half = keys.to(dtype), keys.shape[-1] // 2
    pairs = (keys[..., :half].square() + keys[..., half:2 * half].square()).sqrt()
    return torch.cat([values.to(dtype), pairs.to(torch.bfloat16).to(dtype)], dim=-1)


def predicted_scores(keys: torch.Tensor, values: torch.Tensor, weights: torch.Tensor,
                     bias: torch.Tensor) -> torch.Tensor:
    """[H, N] ``w_h · x_i + b_h`` of :func:`cache_features`; ``weights`` [H, F], ``bias`` [H]. A
    product and a sum over the features per token (not a matrix product, whose blocking may sum
    two equal rows in different orders): equal features give equal scores."""
    features = cache_features(keys, values)
    w, b = weights.to(features.device, features.dtype), bias.to(features.device, features.dtype)
    return (features * w.unsqueeze(1)).sum(-1) + b.unsqueeze(1)


#: (id of a profile's weights, device, dtype) -> (those weights, their tensors there): a served
#: profile's scorer is placed once, not at every decision (the policy is built per request)
_PLACED: dict[tuple[int, torch.device, torch.dtype], tuple[Any, tuple[torch.Tensor, torch.Tensor]]] = {}


def placed_scorer(weights: Any, bias: Any, device: torch.device, dtype: torch.dtype
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """``weights`` [L][H][F] and ``bias`` [L][H] (a profile's nested tuples) as tensors on ``device``."""
    key = (id(weights), device, dtype)
    entry = _PLACED.get(key)
    if entry is None or entry[0] is not weights:
        entry = _PLACED[key] = (weights, (torch.tensor(weights, dtype=dtype).to(device),
                                          torch.tensor(bias, dtype=dtype).to(device)))
    return entry[1]


@dataclass
class KVzap(HeadsChoice, ScorePolicy):
    """Predicted KVzip scores from each token's K and V (trained linear model per layer and head)."""

    name: ClassVar[str] = "kvzap"
    KEEPS: ClassVar[str] = ("tokens a trained per-layer model scores highest from their K and V, predicting "
                            "KVzip's context-reconstruction attention (+ sink/window)")
    PAPER: ClassVar[str] = "KVzap 2026 (after Kim et al. 2025)"
    TEST_PARAMS: ClassVar[Mapping[str, Any]] = {"ratio": 0.25, "sink": 2, "window": 4}
    VARIANTS: ClassVar[Mapping[str, Mapping[str, Any]]] = {"uniform": {"heads": "uniform"}}
    PROFILE: ClassVar[str | None] = "kvzap"
    STREAMS: ClassVar[bool] = True
    PARAMS: ClassVar[dict[str, Param]] = {
        "profile": PROFILE_PARAM,
        "heads": Param("heads", str, "adaptive", choices=("uniform", "adaptive"),
                       help="per-head budget: adaptive (the layer's budget to its best scores over every head, "
                       "KVzip's non-uniform heads) or uniform (the same count per head)"),
    }

    #: [L][H_kv][3D/2] and [L][H_kv] from the bound ``kvzap`` profile
    weights: tuple[tuple[tuple[float, ...], ...], ...] | None = None
    bias: tuple[tuple[float, ...], ...] | None = None
    ratio: float | None = 0.5
    budget: int | None = None
    sink: int = 4
    window: int = 32
    heads: str = "adaptive"
    profile: str = "default"

    def check(self) -> None:
        check_profile_name(self.profile)

    def _layer_weights(self, kv: LayerKV, state: RequestState, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's [H_kv, F] weights and [H_kv] bias of this rank's KV heads (the profile names
        the model's), checked against them, where ``keys`` are and in the precision they are scored in."""
        if self.weights is None or self.bias is None:
            raise ValueError("kvzap has no trained scorer bound: create one with `vllm-kvcomp calibrate --kind kvzap`")
        weights, bias = placed_scorer(self.weights, self.bias, keys.device,
                                      torch.float64 if keys.dtype == torch.float64 else torch.float32)
        h, _, d = kv.key_shape
        first = state.ranks.rank * h
        if kv.layer >= weights.shape[0] or weights.shape[1] < first + h or weights.shape[2] != feature_count(d):
            raise ValueError(f"the kvzap scorer ({tuple(weights.shape)}: layers, KV heads, features) does not fit "
                             f"layer {kv.layer}'s KV heads {first}..{first + h - 1} of dimension {d}")
        return weights[kv.layer, first:first + h], bias[kv.layer, first:first + h]

    def streaming_bound(self, prompt_len: int) -> int | None:
        """Per head: the budget (``heads=uniform``); with ``heads=adaptive`` a head may take what
        the others leave, up to the layer's total, which the spec alone cannot tell (None)."""
        return None if self.heads == "adaptive" else super().streaming_bound(prompt_len)

    def score(self, kv: LayerKV, state: RequestState) -> torch.Tensor:
        """[H_kv, N] predicted log KVzip score (higher = keep)."""
        keys = kv.keys
        weights, bias = self._layer_weights(kv, state, keys)
        return predicted_scores(keys, kv.values, weights, bias)
