"""``razor``: RazorAttention (003_…): full cache for retrieval heads, sink + recent + one
compensation token for every other head.

Per non-retrieval KV head (Algorithm 1): keep the first ``sink`` (N0) live tokens and the most
recent ones; the dropped middle becomes one compensation token (eq. 4): the mean of the dropped
keys and values with weight ``N_dropped``, applied in attention by eq. 5 (see
:mod:`vllm_kvcomp.policies.compensation`). Retrieval heads keep everything (compensation count 0).

How many: :mod:`vllm_kvcomp.policies.head_split` (shared with ``duoattention``). ``exact=0`` (the
default): ``ratio`` is the mean kept fraction over all (layer, KV head) pairs, the non-retrieval
heads' window shrinks to make room for the retrieval heads; ``buffer`` is unused.
``exact=1``: the paper's window ``L_h = max(buffer, kept_for(N))``, ``kept_for`` = ``ceil(ratio·N)``
(ratio = 1/C) or ``budget``; the retrieval heads come on top, so the cache holds more than ratio.

The retrieval heads come from a calibration profile (``vllm-kvcomp calibrate --kind razor``);
the spec names it with ``profile`` and the engine binds it with
:func:`vllm_kvcomp.calibration.profiles.bind_profile`.
Compression runs once, after prefill.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from vllm_kvcomp.params import Param, SpecError
from vllm_kvcomp.policies.base import Compensation, LayerKV, RequestState, Selection
from vllm_kvcomp.policies.head_split import HeadSplit

PROFILE_PARAM = Param(
    "profile", str, "default", help="name of the calibration profile in <model>/kvcomp_profiles/"
)
EXACT_PARAM = Param(
    "exact", int, 0, 0, 1,
    help="1: the paper's recent window max(buffer, ratio·N) per non-retrieval head (the retrieval heads "
    "come on top); 0: ratio is the mean kept fraction over all (layer, KV head) pairs",
)


def check_profile_name(name: str) -> None:
    """SpecError unless ``name`` is a valid profile name."""
    from vllm_kvcomp.calibration.profiles import ProfileError, check_name

    try:
        check_name(name)
    except ProfileError:
        raise SpecError(
            "profile", f"invalid profile name {name!r}", "lower-case letters, digits, '-', '_' (at most 64)"
        ) from None


@dataclass
class Razor(HeadSplit):
    """RazorAttention. ``retrieval_heads``: (layer, kv_head) pairs that keep their full cache."""

    name: ClassVar[str] = "razor"
    KEEPS: ClassVar[str] = "retrieval heads: everything; others: sink + recent + 1 compensation token"
    PAPER: ClassVar[str] = "paper 003"
    TEST_PARAMS: ClassVar[Mapping[str, Any]] = {"ratio": 0.5, "sink": 4, "buffer": 32}
    VARIANTS: ClassVar[Mapping[str, Mapping[str, Any]]] = {"exact": {"exact": 1}}
    PROFILE: ClassVar[str | None] = "razor"
    STREAMS: ClassVar[bool] = True
    PARAMS: ClassVar[dict[str, Param]] = {
        "buffer": Param(
            "buffer", int, 512, 0, 1 << 24,
            help="S0 (exact=1): minimum recent tokens kept by non-retrieval heads (paper: 4000 at 32K+)",
        ),
        "profile": PROFILE_PARAM,
        "exact": EXACT_PARAM,
    }

    retrieval_heads: frozenset[tuple[int, int]] | None = None
    ratio: float | None = 0.5
    budget: int | None = None
    sink: int | None = 4
    buffer: int = 512
    profile: str = "default"
    exact: int = 0

    def check(self) -> None:
        check_profile_name(self.profile)

    def retrieval_set(self) -> frozenset[tuple[int, int]] | None:
        return self.retrieval_heads

    def exact_window(self, n_tokens: int) -> int:
        """``exact=1``: L_h = max(S0, N / C), recent tokens a non-retrieval head keeps of ``n_tokens``."""
        return max(int(self.buffer), self.kept_for(n_tokens))

    def commit_kept(self, layers: Sequence[LayerKV], state: RequestState, picks: Sequence[Selection],
                    kept: Sequence[Selection]) -> None:
        """Every kept selection gets its layer's compensation token (eq. 4) over what it drops."""
        for kv, selection in zip(layers, kept):
            selection.compensation = self._compensation(kv, state, selection)

    def _compensation(self, kv: LayerKV, state: RequestState, selection: Selection) -> Compensation:
        """Eq. 4 over every token a head ever dropped: this compression's drops (its live slots
        not kept) folded into the mean of the earlier ones (a prompt compressed chunk by chunk
        drops in several calls)."""
        acc = torch.float64 if kv.keys.dtype == torch.float64 else torch.float32
        memory = state.layer(kv.layer, RazorMemory)
        heads, dim = kv.num_kv_heads, kv.keys.shape[-1]
        device = kv.keys.device  # summed where the keys are (the engine's cache device)
        k_sum = torch.zeros(heads, dim, dtype=acc, device=device)
        v_sum = torch.zeros(heads, kv.values.shape[-1], dtype=acc, device=device)
        counts = torch.zeros(heads, dtype=acc, device=device)
        if memory.compensation is not None:
            old = memory.compensation
            counts += old.counts.to(device, acc)
            k_sum += old.keys.to(device, acc) * counts.unsqueeze(1)
            v_sum += old.values.to(device, acc) * counts.unsqueeze(1)
        live = kv.valid_mask()
        for h, idx in enumerate(selection.indices):
            live[h, idx] = False
            dropped = torch.nonzero(live[h]).flatten().to(device)
            if dropped.numel():
                k_sum[h] += kv.keys[h, dropped].to(acc).sum(0)
                v_sum[h] += kv.values[h, dropped].to(acc).sum(0)
                counts[h] += dropped.numel()
        mean = counts.clamp(min=1).unsqueeze(1)
        comp = Compensation((k_sum / mean).to(kv.keys.dtype), (v_sum / mean).to(kv.values.dtype), counts.float())
        memory.compensation = comp
        return comp


@dataclass
class RazorMemory:
    """One layer's compensation token so far (the mean of every token its heads dropped)."""

    compensation: Compensation | None = None
