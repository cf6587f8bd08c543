"""POD layer groups (004_… §2.1, Algorithm 1): inter-layer attention similarity + greedy grouping.

For each sample, the attention rows of the last ``last`` queries are collected per layer and
query head. The similarity of layers a, b for head h is ``1 - JS(S_a, S_b)`` averaged over rows
and samples, with the Jensen–Shannon divergence in bits (so it lies in [0, 1]). The paper's
extracted text calls the averaged JS itself the similarity yet groups layers when ``sim ≥ δ``;
``1 - JS`` is the reading under which "similar" means "at least δ".

The policy shares one grouping across heads, so the head similarities are averaged into one
[L, L] matrix before the greedy pass (the paper groups per head).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from typing import Any

import torch
from tqdm.auto import tqdm

from vllm_kvcomp.calibration.probe import AttentionProvider
from vllm_kvcomp.calibration.profiles import LayerGroupsProfile, ModelIdentity

DEFAULTS: dict[str, Any] = {"samples": 4, "words": 900, "last": 32, "delta": 0.5, "seed": 0}

_WORDS: dict[str, tuple[str, ...]] = {k: tuple(v.split()) for k, v in {
    "det": "the a this that every each some no one another",
    "adj": (
        "quiet bright heavy small ancient rapid careful hidden simple golden narrow distant green "
        "curious broken gentle modern wooden silent open frozen early late strong tired"
    ),
    "noun": (
        "river teacher window garden engine letter market mountain village student signal bridge "
        "library doctor storm table question answer machine forest kitchen report harbor farmer "
        "painting city number music ladder orchard council camera"
    ),
    "verb": (
        "finds moves builds watches carries opens follows paints writes measures repairs visits "
        "explains remembers crosses collects answers describes lifts guards"
    ),
    "prep": "near under above behind beside across through beyond inside around",
    "adv": "slowly quickly rarely always often gladly calmly never soon carefully",
    "conj": "and but while because although so",
}.items()}
_TEMPLATES = (
    "det adj noun verb det noun prep det adj noun .",
    "det noun adv verb det adj noun .",
    "det adj noun verb det noun , conj det noun verb adv .",
    "prep det noun , det noun verb det adj noun .",
    "det noun verb det noun prep det noun conj det noun adv verb .",
)


def pseudo_text(words: int, seed: int) -> str:
    """Deterministic English-like text of about ``words`` words (no downloads)."""
    rng = random.Random(seed)
    out: list[str] = []
    count = 0
    while count < words:
        sentence = [rng.choice(_WORDS[t]) if t in _WORDS else t for t in rng.choice(_TEMPLATES).split()]
        sentence[0] = sentence[0].capitalize()
        out.extend(sentence)
        count += sum(w not in ".," for w in sentence)
    return " ".join(out).replace(" .", ".").replace(" ,", ",")


def js_divergence(p: torch.Tensor, q: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Jensen–Shannon divergence in bits between probability rows along ``dim``, in [0, 1]."""
    m = 0.5 * (p + q)
    kl_pm = (torch.xlogy(p, p) - torch.xlogy(p, m)).sum(dim)
    kl_qm = (torch.xlogy(q, q) - torch.xlogy(q, m)).sum(dim)
    return (0.5 * (kl_pm + kl_qm) / math.log(2.0)).clamp(0.0, 1.0)


def layer_similarity(
    provider: AttentionProvider,
    sequences: Sequence[torch.Tensor],
    num_layers: int,
    num_heads: int,
    last: int = DEFAULTS["last"],
    progress: bool = True,
) -> torch.Tensor:
    """Eq. 2 as similarity: [H_q, L, L] mean over samples and the last ``last`` rows of 1 - JS."""
    total = torch.zeros(num_heads, num_layers, num_layers, dtype=torch.float64)
    for ids in tqdm(sequences, desc="layer similarity", unit="seq", disable=not progress):
        rows: dict[int, torch.Tensor] = {}

        def on_layer(layer: int, probs: torch.Tensor, rows: dict[int, torch.Tensor] = rows) -> None:
            rows[layer] = probs[:, -last:, :].double()  # [H, q, T]

        provider(ids, on_layer)
        if sorted(rows) != list(range(num_layers)):
            raise RuntimeError(f"the provider reported layers {sorted(rows)}, expected 0..{num_layers - 1}")
        stacked = torch.stack([rows[i] for i in range(num_layers)])  # [L, H, q, T]
        for a in range(num_layers):
            js = js_divergence(stacked[a : a + 1], stacked)  # [L, H, q]
            total[:, a, :] += (1.0 - js).mean(-1).transpose(0, 1)
    return total / len(sequences)


def greedy_groups(similarity: torch.Tensor, delta: float) -> tuple[tuple[int, ...], ...]:
    """Algorithm 1: grow the current block while the next layer is ≥ δ similar to all its layers.

    similarity [L, L]. Returns consecutive blocks covering 0..L-1.
    """
    if not 0.0 <= delta <= 1.0:
        raise ValueError(f"delta must be in [0, 1], got {delta}")
    blocks: list[list[int]] = [[0]]
    for layer in range(1, similarity.shape[0]):
        if all(float(similarity[layer, other]) >= delta for other in blocks[-1]):
            blocks[-1].append(layer)
        else:
            blocks.append([layer])
    return tuple(tuple(b) for b in blocks)


def calibrate_layer_groups(
    provider: AttentionProvider,
    identity: ModelIdentity,
    sequences: Sequence[torch.Tensor],
    *,
    delta: float = DEFAULTS["delta"],
    last: int = DEFAULTS["last"],
    settings: dict[str, Any] | None = None,
    name: str = "default",
    progress: bool = True,
) -> LayerGroupsProfile:
    """Similarity on ``sequences`` (token ids [T] each), averaged over heads, then greedy groups."""
    if not sequences:
        raise ValueError("need at least one sample sequence")
    per_head = layer_similarity(provider, sequences, identity.num_layers, identity.num_heads, last, progress)
    similarity = per_head.mean(0)
    return LayerGroupsProfile(
        model=identity,
        groups=greedy_groups(similarity, delta),
        delta=delta,
        similarity=tuple(tuple(round(float(x), 6) for x in row) for row in similarity),
        settings={"method": "pod-js-greedy", "last": last, "samples": len(sequences), **(settings or {})},
        name=name,
    )
