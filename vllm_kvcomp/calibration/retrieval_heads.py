"""RazorAttention retrieval heads (003_… §3.3): echo and induction heads on repeated random tokens.

Input: K random tokens (distinct within the block) repeated ``repeats`` times, optionally after a
prefix such as BOS. For a query at repeat r ≥ 1, offset i (token t_i):

* echo score      = attention to the earlier copies of t_i          (positions r'K + i,     r' < r)
* induction score = attention to the tokens that followed them      (positions r'K + i + 1, r' < r)

Scores are averaged over queries and sequences per (layer, query head). The top
``induction_fraction`` (14%) heads by induction plus the top ``echo_fraction`` (1%) by echo are
retrieval heads; a KV head is a retrieval head if any of its query heads is (GQA rule, §4.1).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from tqdm.auto import tqdm

from vllm_kvcomp.calibration.probe import AttentionProvider
from vllm_kvcomp.calibration.profiles import ModelIdentity, RetrievalHeadsProfile

DEFAULTS: dict[str, Any] = {
    "length": 512,
    "repeats": 4,
    "samples": 4,
    "induction_fraction": 0.14,
    "echo_fraction": 0.01,
    "seed": 0,
}


def repeated_random_tokens(
    vocab_size: int,
    length: int,
    repeats: int,
    generator: torch.Generator,
    exclude: Iterable[int] = (),
    prefix: Sequence[int] = (),
) -> torch.Tensor:
    """``prefix + block * repeats`` with ``block`` = ``length`` distinct random token ids.

    Ids in ``exclude`` (special tokens) are never drawn. Returns [len(prefix) + length * repeats].
    """
    if length < 2:
        raise ValueError(f"length must be at least 2, got {length}")
    if repeats < 2:
        raise ValueError(f"repeats must be at least 2, got {repeats}")
    allowed = torch.ones(vocab_size, dtype=torch.bool)
    allowed[[i for i in exclude if 0 <= i < vocab_size]] = False
    pool = torch.nonzero(allowed).flatten()
    if len(pool) < length:
        raise ValueError(f"length {length} exceeds the {len(pool)} drawable token ids")
    block = pool[torch.randperm(len(pool), generator=generator)[:length]]
    return torch.cat([torch.tensor(list(prefix), dtype=torch.long), block.repeat(repeats)])


def echo_induction_scores(
    probs: torch.Tensor, length: int, repeats: int, offset: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean echo and induction attention per head.

    probs [H, T, T] for a sequence of ``offset`` prefix tokens then ``repeats`` copies of a
    ``length``-token block. Returns (echo [H], induction [H]).
    """
    query, echo_key, induction_key = _targets(length, repeats, offset)
    num_queries = length * (repeats - 1)
    echo = probs[:, query, echo_key].sum(1) / num_queries
    induction = probs[:, query, induction_key].sum(1) / num_queries
    return echo, induction


def _targets(length: int, repeats: int, offset: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(query, echo key, induction key) positions, one triple per (query, earlier repeat)."""
    query = torch.arange(offset + length, offset + length * repeats)
    repeat, i = (query - offset).div(length, rounding_mode="floor"), (query - offset) % length
    prev = torch.arange(repeats - 1)
    valid = prev.view(1, -1) < repeat.view(-1, 1)  # [Q, repeats-1]
    q = query.view(-1, 1).expand_as(valid)[valid]
    echo_key = (offset + prev.view(1, -1) * length + i.view(-1, 1))[valid]
    return q, echo_key, echo_key + 1


def measure_scores(
    provider: AttentionProvider,
    sequences: Sequence[torch.Tensor],
    num_layers: int,
    num_heads: int,
    length: int,
    repeats: int,
    offset: int = 0,
    progress: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run every sequence and average the scores: returns (induction [L, H_q], echo [L, H_q])."""
    induction = torch.zeros(num_layers, num_heads, dtype=torch.float64)
    echo = torch.zeros_like(induction)
    seen = torch.zeros(num_layers, dtype=torch.long)

    def on_layer(layer: int, probs: torch.Tensor) -> None:
        e, ind = echo_induction_scores(probs, length, repeats, offset)
        echo[layer] += e.double()
        induction[layer] += ind.double()
        seen[layer] += 1

    for ids in tqdm(sequences, desc="retrieval heads", unit="seq", disable=not progress):
        provider(ids, on_layer)
    if not bool((seen == len(sequences)).all()):
        raise RuntimeError(f"the provider reported layers {seen.tolist()} times, expected {len(sequences)} each")
    return induction / len(sequences), echo / len(sequences)


def top_heads(scores: torch.Tensor, fraction: float) -> frozenset[tuple[int, int]]:
    """The ``ceil(fraction * L * H)`` (layer, head) pairs with the highest scores [L, H]."""
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"fraction must be in [0, 1], got {fraction}")
    count = math.ceil(fraction * scores.numel() - 1e-9)
    order = torch.sort(scores.flatten(), descending=True, stable=True).indices[:count]
    heads = scores.shape[1]
    return frozenset((int(i) // heads, int(i) % heads) for i in order)


def kv_heads_of(query_heads: Iterable[tuple[int, int]], group_size: int) -> frozenset[tuple[int, int]]:
    """GQA rule: (layer, q) -> (layer, q // group_size)."""
    return frozenset((layer, q // group_size) for layer, q in query_heads)


def calibrate_retrieval_heads(
    provider: AttentionProvider,
    identity: ModelIdentity,
    vocab_size: int,
    *,
    length: int = DEFAULTS["length"],
    repeats: int = DEFAULTS["repeats"],
    samples: int = DEFAULTS["samples"],
    induction_fraction: float = DEFAULTS["induction_fraction"],
    echo_fraction: float = DEFAULTS["echo_fraction"],
    seed: int = DEFAULTS["seed"],
    exclude: Iterable[int] = (),
    prefix: Sequence[int] = (),
    name: str = "default",
    progress: bool = True,
) -> RetrievalHeadsProfile:
    """Measure echo/induction scores on ``samples`` random repeated sequences and pick the heads."""
    if samples < 1:
        raise ValueError(f"samples must be at least 1, got {samples}")
    generator = torch.Generator().manual_seed(seed)
    exclude = list(exclude)
    sequences = [
        repeated_random_tokens(vocab_size, length, repeats, generator, exclude, prefix) for _ in range(samples)
    ]
    induction, echo = measure_scores(
        provider, sequences, identity.num_layers, identity.num_heads, length, repeats, len(prefix), progress
    )
    ind_heads = top_heads(induction, induction_fraction)
    echo_heads = top_heads(echo, echo_fraction)
    return RetrievalHeadsProfile(
        model=identity,
        kv_heads=kv_heads_of(ind_heads | echo_heads, identity.group_size),
        induction_heads=ind_heads,
        echo_heads=echo_heads,
        induction_scores=tuple(tuple(round(float(x), 6) for x in row) for row in induction),
        echo_scores=tuple(tuple(round(float(x), 6) for x in row) for row in echo),
        settings={
            "method": "razorattention-echo-induction",
            "length": length,
            "repeats": repeats,
            "samples": samples,
            "induction_fraction": induction_fraction,
            "echo_fraction": echo_fraction,
            "seed": seed,
            "prefix": list(prefix),
        },
        name=name,
    )
