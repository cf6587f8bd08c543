"""``duoattention``: DuoAttention (Xiao et al. 2024, *DuoAttention: Efficient Long-Context LLM
Inference with Retrieval and Streaming Heads*): retrieval heads keep the whole cache, streaming
heads their attention sinks and most recent tokens.

Which KV heads are retrieval heads comes from a ``duoattention`` calibration profile (``vllm-kvcomp
calibrate --kind duoattention``): per (layer, KV head) a gate α ∈ [0, 1] trained to mix full and
streaming attention (:mod:`vllm_kvcomp.calibration.duo_attention`). A head is a retrieval head
when its gate is at least the profile's ``threshold`` (the authors' 0.5), or, with ``sparsity``
given, unless it is among the ``round(sparsity · T)`` lowest gates of the model's T pairs (the
authors' ``--sparsity``, kvpress's ``head_compression_ratio``).

How many a streaming head keeps: :mod:`vllm_kvcomp.policies.head_split` (shared with ``razor``).
``exact=0`` (default): ``ratio`` is the mean kept fraction over all (layer, KV head) pairs, the
streaming heads keep ``sink`` + the most recent tokens that leave room for the retrieval heads;
``recent`` is unused. ``exact=1``: the paper's fixed ``sink`` + ``recent`` per streaming head,
the retrieval heads on top; ``ratio`` / ``budget`` are unused. Compression runs once, after
prefill (as kvpress); the paper's streaming heads keep sliding their window during decode.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from vllm_kvcomp.params import Param
from vllm_kvcomp.policies.head_split import HeadSplit
from vllm_kvcomp.policies.razor import PROFILE_PARAM, check_profile_name


def retrieval_heads(gates: Sequence[Sequence[float]], sparsity: float | None = None,
                    threshold: float = 0.5) -> frozenset[tuple[int, int]]:
    """(layer, KV head) pairs of gates [L][H_kv] that keep everything: gate ≥ ``threshold``, or with
    ``sparsity`` all but the ``round(sparsity · L · H_kv)`` lowest gates (ties: the lower pair)."""
    flat = torch.tensor([list(row) for row in gates], dtype=torch.float64).flatten()
    heads = len(gates[0]) if len(gates) else 1
    if sparsity is None:
        chosen = torch.nonzero(flat >= threshold).flatten()
    else:
        chosen = torch.sort(flat, stable=True).indices[round(flat.numel() * sparsity):]
    return frozenset((int(i) // heads, int(i) % heads) for i in chosen)


@dataclass
class DuoAttention(HeadSplit):
    """DuoAttention. ``gates`` [L][H_kv] and ``threshold`` come from the bound profile."""

    name: ClassVar[str] = "duoattention"
    KEEPS: ClassVar[str] = "retrieval heads (trained gates): everything; streaming heads: sink + recent"
    PAPER: ClassVar[str] = "Xiao et al. 2024"
    TEST_PARAMS: ClassVar[Mapping[str, Any]] = {"ratio": 0.5, "sink": 4, "recent": 16}
    VARIANTS: ClassVar[Mapping[str, Mapping[str, Any]]] = {"exact": {"exact": 1}}
    IMPLICIT_DEFAULTS: ClassVar[Mapping[str, str]] = {**HeadSplit.IMPLICIT_DEFAULTS, "sparsity": "gate ≥ profile threshold"}
    PROFILE: ClassVar[str | None] = "duoattention"
    STREAMS: ClassVar[bool] = True
    READS_VALUES: ClassVar[bool] = False
    FIT_HINT: ClassVar[str] = "a larger sparsity (fewer retrieval heads), or exact=1 for the paper's sink + recent"
    PARAMS: ClassVar[dict[str, Param]] = {
        "recent": Param(
            "recent", int, 256, 1, 1 << 24,
            help="exact=1: recent tokens a streaming head keeps after its sinks (the authors' deployment: 256)",
        ),
        "sparsity": Param(
            "sparsity", float, None, 0.0, 1.0,
            help="fraction of the model's (layer, KV head) pairs made streaming heads, lowest gates first "
            "(the authors' --sparsity, kvpress's head_compression_ratio); default: gate < the profile's threshold",
        ),
        "profile": PROFILE_PARAM,
        "exact": Param(
            "exact", int, 0, 0, 1,
            help="1: the paper's sink + recent per streaming head (the retrieval heads come on top); "
            "0: ratio is the mean kept fraction over all (layer, KV head) pairs",
        ),
    }

    gates: tuple[tuple[float, ...], ...] | None = None
    threshold: float = 0.5
    ratio: float | None = 0.5
    budget: int | None = None
    sink: int = 64
    recent: int = 256
    sparsity: float | None = None
    profile: str = "default"
    exact: int = 0

    def check(self) -> None:
        check_profile_name(self.profile)

    def retrieval_set(self) -> frozenset[tuple[int, int]] | None:
        return None if self.gates is None else retrieval_heads(self.gates, self.sparsity, self.threshold)

    def exact_window(self, n_tokens: int) -> int:
        return int(self.recent)
