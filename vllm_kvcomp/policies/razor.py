"""``razor``: RazorAttention (003_…): full cache for retrieval heads, sink + recent + one
compensation token for every other head.

Per non-retrieval KV head (Algorithm 1): keep the first ``sink`` (N0) live tokens and the most
recent ones; the dropped middle becomes one compensation token (eq. 4): the mean of the dropped
keys and values with weight ``N_dropped``, applied in attention by eq. 5 (see
:mod:`vllm_kvcomp.policies.compensation`). Retrieval heads keep everything (compensation count 0).

How many (``exact=0``, the default): ``ratio`` is the mean kept fraction over all T (layer, KV
head) pairs, as for every policy. With R retrieval heads keeping the whole prompt of N tokens, a
non-retrieval head keeps ``ceil((B·T − R·N) / (T − R))`` tokens, sink included, B = ``ceil(ratio·N)``
(or ``budget``), at least ``sink + MIN_RECENT``. When the retrieval heads alone hold more than
``ratio`` (``ratio ≤ R/T``, or a short prompt where the floor rules) the request is infeasible:
the server refuses it when it can tell (HTTP 400, ``vllm_kvcomp.server.protocol.check_fit``,
:meth:`Razor.check_fit`); otherwise the other heads keep their floor, a warning names the
smallest feasible ratio and ``kept_fraction`` reports what is held. ``buffer`` is unused.

``exact=1``: the paper's window ``L_h = max(buffer, kept_for(N))``, ``kept_for`` = ``ceil(ratio·N)``
(ratio = 1/C) or ``budget``; the retrieval heads come on top, so the cache holds more than ratio.

The retrieval heads come from a calibration profile (``vllm-kvcomp calibrate --kind razor``);
the spec names it with ``profile`` and the engine binds it with
:func:`vllm_kvcomp.calibration.profiles.bind_profile`.
Compression runs once, after prefill.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from vllm_kvcomp.params import Param, SpecError
from vllm_kvcomp.policies.base import (
    Compensation,
    LayerKV,
    Policy,
    RequestState,
    Selection,
    ceil_div,
)

logger = logging.getLogger(__name__)

#: Fewest recent tokens a non-retrieval head keeps with ``exact=0``: its floor is sink + this.
MIN_RECENT = 1

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
class Razor(Policy):
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

    def check_fit(self, retrieval: int, heads: int) -> None:
        """SpecError (``ratio``) when ``retrieval`` of the model's ``heads`` (layer, KV head) pairs
        keeping everything already hold ``ratio`` of the cache, whatever the prompt (``exact=0``)."""
        share = retrieval / heads if heads else 0.0
        if self.exact or self.ratio is None or self.ratio > share:
            return
        raise SpecError(
            "ratio", f"{self.ratio:g} is infeasible with this server's razor profile: its {retrieval} retrieval "
            f"heads of the model's {heads} (layer, KV head) pairs keep every token, {share:.4f} of the cache "
            "by themselves",
            f"a number in ({share:.4f}, 1] (a little more for short prompts: the other heads keep at least "
            f"sink + {MIN_RECENT} tokens), or exact=1 for the paper's window",
        )

    def recent_for(self, n_tokens: int) -> int:
        """``exact=1``: L_h = max(S0, N / C), recent tokens a non-retrieval head keeps of ``n_tokens``."""
        return max(int(self.buffer), self.kept_for(n_tokens))

    def floor(self, n_tokens: int) -> int:
        """``exact=0``: fewest tokens a non-retrieval head keeps of ``n_tokens``, sink + MIN_RECENT."""
        return min(n_tokens, int(self.sink or 0) + MIN_RECENT)

    def others_keep(self, n_tokens: int, heads: int, retrieval: int) -> int:
        """Tokens (sink included) each non-retrieval head keeps of ``n_tokens`` when ``retrieval`` of
        ``heads`` (layer, KV head) pairs keep everything: the mean is ``kept_for(n)`` (``exact=0``)."""
        if self.exact:
            return min(n_tokens, int(self.sink or 0) + self.recent_for(n_tokens))
        if retrieval >= heads:
            return n_tokens
        share = ceil_div(self.kept_for(n_tokens) * heads - retrieval * n_tokens, heads - retrieval)
        return min(n_tokens, max(share, self.floor(n_tokens)))

    def min_ratio(self, n_tokens: int, heads: int, retrieval: int) -> float:
        """``exact=0``: the smallest ratio a ``n_tokens`` prompt can be held at."""
        return (retrieval * n_tokens + (heads - retrieval) * self.floor(n_tokens)) / (heads * n_tokens)

    def prefill_budget(self, prompt_len: int) -> int:
        return self.others_keep(prompt_len, 1, 0)

    def streaming_bound(self, prompt_len: int) -> int | None:
        return None  # retrieval heads keep the whole prompt: the bound depends on the profile

    def mean_kept_bound(self, prompt_len: int, num_heads: int | None = None) -> int | None:
        """Retrieval heads keep the prompt, the other ``num_heads - R`` :meth:`others_keep` (the
        compensation token is not a cell): ``kept_for(N)`` + 1 at most with ``exact=0`` unless
        infeasible; None without a profile and head count."""
        heads = self.retrieval_heads
        if heads is None:
            return self.prefill_budget(prompt_len)  # no profile: every head is compressed
        if not num_heads:
            return None
        retrieval = min(len(heads), num_heads)
        total = retrieval * prompt_len + (num_heads - retrieval) * self.others_keep(prompt_len, num_heads, retrieval)
        if not self.exact:  # fewer retrieval heads (a hybrid model's are partly in uncompressed layers): ≤ B + 1
            total = max(total, min(self.kept_for(prompt_len) + 1, prompt_len) * num_heads)
        return ceil_div(total, num_heads)

    def select(self, layers: Sequence[LayerKV], state: RequestState) -> list[Selection]:
        """Every layer, the mean over all of them (every rank's heads) on ``kept_for(N)``."""
        heads = self.retrieval_heads
        if heads is None:
            logger.warning("razor: no retrieval-head profile bound; every head is compressed")
            heads = frozenset()
        width = max((kv.num_kv_heads for kv in layers), default=0) * state.ranks.size  # KV heads per layer
        total = sum(kv.num_kv_heads for kv in layers) * state.ranks.size
        indices = {kv.layer for kv in layers}
        retrieval = sum(1 for layer, head in heads if layer in indices and head < width)
        n = max([state.prompt_len, *(int(kv.valid_lengths().max()) for kv in layers if kv.num_kv_heads)])
        if state.budget is None:
            state.budget = self.prefill_budget(n)
        least = retrieval * n + (total - retrieval) * self.floor(n)  # cells the floor holds
        if not self.exact and state.compressions == 0 and self.kept_for(n) * total < least:
            smallest = self.min_ratio(n, total, retrieval)
            logger.warning(
                "razor: %s is infeasible for this %d-token prompt: %d retrieval heads of %d (layer, KV head) "
                "pairs keep every token, the others at least sink + %d; the smallest feasible ratio is %.4f "
                "(or exact=1). Served holding %.4f of the cache (kept_fraction says so)", self._size(), n,
                retrieval, total, MIN_RECENT, smallest, smallest)
        return [self._select_layer(kv, state, heads, total, retrieval) for kv in layers]

    def _size(self) -> str:
        return f"budget={self.budget}" if self.budget is not None else f"ratio={self.ratio:g}"

    def select_layer(self, kv: LayerKV, state: RequestState) -> Selection:
        """One layer as a whole request (its heads are all the heads)."""
        return self.select([kv], state)[0]

    def _select_layer(self, kv: LayerKV, state: RequestState, heads: frozenset[tuple[int, int]], total: int,
                      retrieval: int) -> Selection:
        """Retrieval heads keep every live slot; the others their sink and most recent tokens (the
        page rounding adds the next most recent ones: ``priority`` None)."""
        n = kv.num_slots
        lengths = kv.valid_lengths()
        sink = int(self.sink or 0)
        indices = []
        for h in range(kv.num_kv_heads):
            length = int(lengths[h])
            start = n - length
            keep_sink = min(sink, length)
            # the whole prompt's count, also when an earlier prefill chunk is compressed (prefill=stream)
            prompt = max(length, state.prompt_len)
            keep = keep_sink + self.recent_for(prompt) if self.exact else self.others_keep(prompt, total, retrieval)
            global_head = state.ranks.rank * kv.num_kv_heads + h  # profiles name the model's KV heads
            if (kv.layer, global_head) in heads or keep >= length:
                indices.append(torch.arange(start, n))
            else:
                indices.append(torch.cat([torch.arange(start, start + keep_sink), torch.arange(n - keep + keep_sink, n)]))
        return Selection(indices)

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
        k_sum = torch.zeros(heads, dim, dtype=acc)
        v_sum = torch.zeros(heads, kv.values.shape[-1], dtype=acc)
        counts = torch.zeros(heads, dtype=acc)
        if memory.compensation is not None:
            old = memory.compensation
            counts += old.counts.to(acc)
            k_sum += old.keys.to(acc) * counts.unsqueeze(1)
            v_sum += old.values.to(acc) * counts.unsqueeze(1)
        live = kv.valid_mask()
        for h, idx in enumerate(selection.indices):
            live[h, idx] = False
            dropped = torch.nonzero(live[h]).flatten()
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
