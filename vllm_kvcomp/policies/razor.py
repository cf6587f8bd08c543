"""``razor``: RazorAttention (003_…): full cache for retrieval heads, sink + recent + one
compensation token for every other head.

Per non-retrieval KV head (Algorithm 1): keep the first ``sink`` (N0) live tokens and the recent
``L_h = max(buffer, kept_for(N))`` tokens, where ``kept_for`` is ``ceil(ratio * N)`` (ratio =
1/C) or ``budget``; the dropped middle becomes one compensation token (eq. 4): the mean of the
dropped keys and values with weight ``N_dropped``, applied in attention by eq. 5 (see
:mod:`vllm_kvcomp.policies.compensation`). Retrieval heads keep everything (compensation count 0).

The retrieval heads come from a calibration profile (``vllm-kvcomp calibrate --kind razor``);
the spec names it with ``profile`` and the engine binds it with :meth:`Razor.with_profile`.
Compression runs once, after prefill.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, ClassVar

import torch

from vllm_kvcomp.params import Param, SpecError
from vllm_kvcomp.policies.base import Compensation, LayerKV, Policy, RequestState, Selection

if TYPE_CHECKING:
    from vllm_kvcomp.calibration.profiles import RetrievalHeadsProfile

logger = logging.getLogger(__name__)

PROFILE_PARAM = Param(
    "profile", str, "default", help="name of the calibration profile in <model>/kvcomp_profiles/"
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
class Razor(Policy):
    """RazorAttention. ``retrieval_heads``: (layer, kv_head) pairs that keep their full cache."""

    name: ClassVar[str] = "razor"
    PROFILE: ClassVar[str | None] = "razor"
    STREAMS: ClassVar[bool] = True
    PARAMS: ClassVar[dict[str, Param]] = {
        "buffer": Param(
            "buffer", int, 512, 0, 1 << 24,
            help="S0: minimum recent tokens kept by non-retrieval heads (paper: 4000 at 32K+)",
        ),
        "profile": PROFILE_PARAM,
    }

    retrieval_heads: frozenset[tuple[int, int]] | None = None
    ratio: float | None = 0.2
    budget: int | None = None
    sink: int | None = 4
    buffer: int = 512
    profile: str = "default"

    def check(self) -> None:
        check_profile_name(self.profile)

    def with_profile(self, profile: RetrievalHeadsProfile) -> Razor:
        """This policy with ``retrieval_heads`` from a calibration profile."""
        return replace(self, retrieval_heads=frozenset(profile.kv_heads))

    def recent_for(self, n_tokens: int) -> int:
        """L_h = max(S0, N / C): recent tokens a non-retrieval head keeps out of ``n_tokens``."""
        return max(int(self.buffer), self.kept_for(n_tokens))

    def prefill_budget(self, prompt_len: int) -> int:
        return min(prompt_len, int(self.sink or 0) + self.recent_for(prompt_len))

    def streaming_bound(self, prompt_len: int) -> int | None:
        return None  # retrieval heads keep the whole prompt: the bound depends on the profile

    def select_layer(self, kv: LayerKV, state: RequestState) -> Selection:
        heads = self.retrieval_heads
        if heads is None:
            if kv.layer == 0:
                logger.warning("razor: no retrieval-head profile bound; every head is compressed")
            heads = frozenset()
        n = kv.num_slots
        lengths = kv.valid_lengths()
        sink = int(self.sink or 0)
        if state.budget is None:
            state.budget = self.prefill_budget(int(lengths.max()))
        indices, dropped = [], []
        for h in range(kv.num_kv_heads):
            length = int(lengths[h])
            start = n - length
            keep_sink = min(sink, length)
            # L_h of the whole prompt, also when an earlier prefill chunk is compressed (prefill=stream)
            recent = state.page_count(keep_sink + self.recent_for(max(length, state.prompt_len)), length) - keep_sink
            global_head = state.ranks.rank * kv.num_kv_heads + h  # profiles name the model's KV heads
            if (kv.layer, global_head) in heads or keep_sink + recent >= length:
                indices.append(torch.arange(start, n))
                dropped.append(None)
                continue
            indices.append(torch.cat([torch.arange(start, start + keep_sink), torch.arange(n - recent, n)]))
            dropped.append(slice(start + keep_sink, n - recent))
        return Selection(indices, self._compensation(kv, state, dropped))

    def _compensation(self, kv: LayerKV, state: RequestState, dropped: list[slice | None]) -> Compensation:
        """Eq. 4 over every token a head ever dropped: this call's drops folded into the mean of
        the earlier ones (a prompt compressed chunk by chunk drops in several calls)."""
        acc = torch.float64 if kv.keys.dtype == torch.float64 else torch.float32
        memory = state.layer(kv.layer)
        heads, dim = kv.num_kv_heads, kv.keys.shape[-1]
        k_sum = torch.zeros(heads, dim, dtype=acc)
        v_sum = torch.zeros(heads, kv.values.shape[-1], dtype=acc)
        counts = torch.zeros(heads, dtype=acc)
        if "comp" in memory:
            old = memory["comp"]
            counts += old.counts.to(acc)
            k_sum += old.keys.to(acc) * counts.unsqueeze(1)
            v_sum += old.values.to(acc) * counts.unsqueeze(1)
        for h, span in enumerate(dropped):
            if span is not None:
                k_sum[h] += kv.keys[h, span].to(acc).sum(0)
                v_sum[h] += kv.values[h, span].to(acc).sum(0)
                counts[h] += span.stop - span.start
        mean = counts.clamp(min=1).unsqueeze(1)
        comp = Compensation((k_sum / mean).to(kv.keys.dtype), (v_sum / mean).to(kv.values.dtype), counts.float())
        memory["comp"] = comp
        return comp
