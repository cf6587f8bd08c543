"""KVzap scorers (``vllm-kvcomp calibrate --kind kvzap``): KVzip's context-reconstruction scores
on locally made text as the teacher, and per (layer, KV head) a linear model fitted to their log
from each token's cache features (:func:`vllm_kvcomp.policies.kvzap.cache_features`).

Teacher — KVzip (Kim et al. 2025, arXiv 2505.23416; kvpress ``KVzipPress.score_kvzip``): the
model reads ``prefix + context + REPEAT + context`` and a context token i of KV head h scores

    s_{l,h,i} = max_{t ∈ repeated context, q ∈ G(h)} A_l[q, t, i]

(A_l: layer l's attention probabilities; kvpress's prompt without a chat template, one chunk:
kvpress replays contexts in chunks of 2048 tokens, ours are shorter, so its softmax over sinks +
chunk + replay is the whole sequence's). KVzap (arXiv 2601.07891, kvpress ``kvzap/train.py``)
fits the log of the score; its inputs are the hidden states, ours the cache (see the policy).

Data: ``samples`` seeded pseudo-texts of about ``words`` words (:func:`layer_groups.pseudo_text`)
with ``needles`` facts ("The code of the <word> is <digits>.") at random sentence breaks, the
retrieval targets long-context tasks ask for; no downloads. The first ``SINK`` positions of each
sequence (always kept by the policy) are not fitted.

Fit: ridge regression on standardised features, ``ridge · M`` on the diagonal (M rows), solved in
float64 per (layer, KV head), then folded back to raw features. The last ``holdout`` samples are
held out: the profile records their R² (mean over layers and heads, and per layer).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from tqdm.auto import tqdm

from vllm_kvcomp.calibration.layer_groups import pseudo_text
from vllm_kvcomp.calibration.probe import AttentionProvider
from vllm_kvcomp.calibration.profiles import ModelIdentity, ScorerProfile
from vllm_kvcomp.policies.kvzap import cache_features

#: KVzip's repeat prompt (kvpress ``KVzipPress.prepare``, first chunk) and suffix without a chat template
REPEAT = "\n\nRepeat the previous context exactly.\n"
#: leading positions the policy always keeps (KVzip's ``n_sink``): not fitted
SINK = 4
DEFAULTS: dict[str, Any] = {
    "samples": 24,
    "holdout": 4,
    "words": 320,
    "needles": 4,
    "ridge": 1e-3,
    "seed": 0,
}

Encode = Callable[[str], list[int]]


def needle_text(words: int, needles: int, seed: int) -> str:
    """:func:`pseudo_text` with ``needles`` facts "The code of the <word> is <5 digits>." at random
    sentence breaks (deterministic in ``seed``)."""
    rng = random.Random(seed)
    sentences = [s.strip() for s in pseudo_text(words, seed).split(".") if s.strip()]
    for _ in range(needles):
        fact = f"The code of the {rng.choice(sentences).split()[-1].lower()} is {rng.randrange(10_000, 100_000)}"
        sentences.insert(rng.randrange(len(sentences) + 1), fact)
    return ". ".join(sentences) + "."


def replay_sequence(encode: Encode, context: Sequence[int], prefix: Sequence[int] = ()
                    ) -> tuple[torch.Tensor, slice, slice]:
    """``prefix + context + REPEAT + context`` [T] int64, the first context's slice and the repeat's."""
    repeat = encode(REPEAT)
    ids = [*prefix, *context, *repeat, *context]
    first = slice(len(prefix), len(prefix) + len(context))
    again = slice(first.stop + len(repeat), len(ids))
    return torch.tensor(ids, dtype=torch.long), first, again


def kvzip_scores(probs: torch.Tensor, num_kv_heads: int, context: slice, replay: slice) -> torch.Tensor:
    """[H_kv, n] KVzip scores of the ``context`` keys: the maximum over the ``replay`` query rows
    and each KV head's query group of ``probs`` [H_q, T, T]."""
    h_q = probs.shape[0]
    rows = probs[:, replay, context]  # [H_q, r, n]
    return rows.amax(dim=1).view(num_kv_heads, h_q // num_kv_heads, -1).amax(dim=1)


def teacher_data(provider: AttentionProvider, encode: Encode, identity: ModelIdentity, texts: Sequence[str],
                 prefix: Sequence[int] = (), progress: bool = True) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per text: (features [L, H_kv, n, F], log KVzip scores [L, H_kv, n]) of its context tokens
    after the first :data:`SINK` positions."""
    out = []
    for text in tqdm(texts, desc="kvzip replay", disable=not progress):
        ids, first, again = replay_sequence(encode, encode(text), prefix)
        out.append(_replay(provider, identity, ids, first, again))
    return out


def _replay(provider: AttentionProvider, identity: ModelIdentity, ids: torch.Tensor, first: slice,
            again: slice) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's (features, log scores) of its first context after the sink positions."""
    keep = slice(max(first.start, SINK), first.stop)
    features: dict[int, torch.Tensor] = {}
    scores: dict[int, torch.Tensor] = {}

    def on_cache(layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        features[layer] = cache_features(keys[:, keep], values[:, keep])

    def on_layer(layer: int, probs: torch.Tensor) -> None:
        scores[layer] = kvzip_scores(probs, identity.num_kv_heads, first, again)[:, keep.start - first.start:]

    provider(ids, on_layer, on_cache)
    layers = range(identity.num_layers)
    return (torch.stack([features[i] for i in layers]),
            torch.stack([scores[i] for i in layers]).clamp(min=1e-30).log())


def fit_ridge(x: torch.Tensor, y: torch.Tensor, ridge: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Weights [..., F] and bias [...] minimising ``|x w + b - y|² + ridge · M · |w_std|²`` over M rows
    (x [..., M, F], y [..., M]; w_std: the weights of standardised features), float64; ``ridge`` > 0."""
    if not ridge > 0:
        raise ValueError(f"ridge must be positive, got {ridge}")
    x, y = x.double(), y.double()
    mean, std = x.mean(dim=-2, keepdim=True), x.std(dim=-2, keepdim=True).clamp(min=1e-12)
    z = (x - mean) / std
    target = y - y.mean(dim=-1, keepdim=True)
    gram = z.transpose(-1, -2) @ z
    eye = torch.eye(gram.shape[-1], dtype=gram.dtype)
    factor = torch.linalg.cholesky(gram + ridge * x.shape[-2] * eye)  # positive definite for ridge > 0
    w_std = torch.cholesky_solve(z.transpose(-1, -2) @ target.unsqueeze(-1), factor)
    weights = w_std.squeeze(-1) / std.squeeze(-2)
    bias = y.mean(dim=-1) - (mean.squeeze(-2) * weights).sum(-1)
    return weights, bias


def r_squared(x: torch.Tensor, y: torch.Tensor, weights: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """[...] 1 - residual / total sum of squares of ``x w + b`` against ``y`` (x [..., M, F], y [..., M])."""
    pred = (x.double() * weights.unsqueeze(-2)).sum(-1) + bias.unsqueeze(-1)
    residual = (y.double() - pred).square().sum(-1)
    total = (y.double() - y.double().mean(dim=-1, keepdim=True)).square().sum(-1).clamp(min=1e-30)
    return 1 - residual / total


def calibrate_kvzap(provider: AttentionProvider, encode: Encode, identity: ModelIdentity, *,
                    samples: int = DEFAULTS["samples"], holdout: int = DEFAULTS["holdout"],
                    words: int = DEFAULTS["words"], needles: int = DEFAULTS["needles"],
                    ridge: float = DEFAULTS["ridge"], seed: int = DEFAULTS["seed"], prefix: Sequence[int] = (),
                    compressed: Sequence[int] | None = None, name: str = "default",
                    progress: bool = True) -> ScorerProfile:
    """Replay ``samples`` texts, fit on all but the last ``holdout``, measure R² on those: its mean
    over the ``compressed`` layers (default: all; Gemma 3: its full-attention layers, the others
    stay vLLM's and see only a sliding window of the replay)."""
    if not 1 <= holdout < samples:
        raise ValueError(f"need 1 <= holdout < samples, got holdout {holdout}, samples {samples}")
    started = time.perf_counter()
    texts = [needle_text(words, needles, seed + i) for i in range(samples)]
    data = teacher_data(provider, encode, identity, texts, prefix, progress)
    train, test = data[:samples - holdout], data[samples - holdout:]
    x = torch.cat([f for f, _ in train], dim=2)  # [L, H_kv, M, F]
    y = torch.cat([s for _, s in train], dim=2)
    weights, bias = fit_ridge(x, y, ridge)
    r2 = r_squared(torch.cat([f for f, _ in test], dim=2), torch.cat([s for _, s in test], dim=2), weights, bias)
    layers = list(range(identity.num_layers)) if compressed is None else sorted(compressed)
    settings = {"samples": samples, "holdout": holdout, "words": words, "needles": needles, "ridge": ridge,
                "seed": seed, "train_tokens": int(y.shape[-1]), "r2": round(float(r2[layers].mean()), 4),
                "r2_over_layers": layers,
                "r2_layers": [round(float(v), 4) for v in r2.mean(dim=1)],
                "seconds": round(time.perf_counter() - started, 1),
                "teacher": "kvzip: max attention over the repeated context and the query group, log",
                "features": "value, key rotary-pair norms (NeoX layout)"}
    return ScorerProfile.from_arrays(identity, weights, bias, settings=settings, name=name)
