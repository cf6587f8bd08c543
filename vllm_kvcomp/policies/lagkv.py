"""``lagkv``: LagKV (000_…): attention-free, lag-relative scoring (eq. 5–9), recursive.

Per head: keep the first ``sink`` (S) tokens; cut the rest into partitions of ``lag`` (L)
tokens. Partition p is scored against partition p+1 (its reference): each channel of K (and
separately V) is min-max normalised with the reference's per-channel min/max over the sequence
(eq. 5–7); a token's score is the softmax over the partition of the channel-wise std of its
normalised K plus the same for V (eq. 8–9). Each scored partition keeps its top
``floor(r·L)`` tokens (at least 1; r = ``ratio``, floor as in the authors' code). The last full
partition and the remainder stay uncompressed as the sliding window. So for
``Ls ≥ S + 2L`` tokens the cache holds (eq. 10)

    L_R = S + floor(r·L)·(floor((Ls - S)/L) - 1) + L + (Ls - S) mod L

and ``Ls < S + 2L`` compresses nothing (at ``Ls = S + 2L`` the first partition already has a
complete reference and is compressed, matching eq. 10 and the authors' ``>=``).

Decode: a per-head cursor (logical position where the uncompressed tail starts) lives in the
layer state; a recompression is due as soon as some tail holds two full partitions, and it
compresses every partition whose reference is complete, so the cache length always equals
eq. 10 of the total length.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from vllm_kvcomp.policies.base import LayerKV, Policy, RequestState, Selection

#: Smallest per-channel range of the reference partition (avoids 0/0 on constant channels).
RANGE_EPS = 1e-6


def _normalised_std(part: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Eq. 5–8 for one of K or V: [..., L, D] part, [..., L', D] reference -> softmax(std) [..., L]."""
    low = ref.amin(dim=-2, keepdim=True)
    high = ref.amax(dim=-2, keepdim=True)
    normed = (part - low) / (high - low).clamp_min(RANGE_EPS)
    # the unbiased std over channels, as a norm of the centred rows (4x faster than .std on CPU)
    centred = normed - normed.mean(dim=-1, keepdim=True)
    std = torch.linalg.vector_norm(centred, dim=-1) / math.sqrt(max(normed.shape[-1] - 1, 1))
    return std.softmax(dim=-1)


def lagkv_scores(
    keys_part: torch.Tensor, values_part: torch.Tensor, keys_ref: torch.Tensor, values_ref: torch.Tensor
) -> torch.Tensor:
    """LagKV score (eq. 9) of each token of a partition, computed in float32.

    keys_part/values_part [H, L, D] (any leading dims), keys_ref/values_ref [H, L, D] the next
    partition. Std over channels is the unbiased one (``torch.std``); the reference range is
    clamped to ``RANGE_EPS``. Returns [H, L]; each row of each term sums to 1.
    """
    return _normalised_std(keys_part.float(), keys_ref.float()) + _normalised_std(
        values_part.float(), values_ref.float()
    )


def lag_keep(lag: int, ratio: float) -> int:
    """Tokens a scored partition keeps: ``floor(r·L)``, at least 1.

    The authors' code takes ``int(r·L)``; two deliberate differences (issue #17, pinned in
    ``tests/policies/test_lagkv.py``): the ``1e-9`` lets a decimal ratio mean what it says
    (0.57·100 is 56.99999999999999 in binary, ``int`` gives 56, this gives 57; it changes nothing
    unless r·L is within 1e-9 below an integer), and at least one token survives per partition
    (``int`` gives 0 when r·L < 1, which silently turns LagKV into sink + sliding window).
    """
    return max(1, math.floor(ratio * lag + 1e-9))


def lagkv_retained(n_tokens: int, sink: int, lag: int, ratio: float) -> int:
    """Eq. 10: cache length after LagKV compressed ``n_tokens`` tokens."""
    if n_tokens < sink + 2 * lag:
        return n_tokens
    parts, rest = divmod(n_tokens - sink, lag)
    return sink + lag_keep(lag, ratio) * (parts - 1) + lag + rest


@dataclass
class LagKV(Policy):
    """Recursive lag-relative compression; ``ratio`` is the fraction r kept per partition."""

    name: ClassVar[str] = "lagkv"
    RECOMPRESSES: ClassVar[bool] = True
    STREAMS: ClassVar[bool] = True

    ratio: float | None = 0.5
    sink: int = 16
    lag: int = 128

    def check(self) -> None:
        """A 1-token partition keeps its one token (``lag_keep`` is at least 1): nothing is ever
        evicted, yet the cache would be rescored every decode step."""
        from vllm_kvcomp.params import COMMON_PARAMS, SpecError

        if self.lag < 2:
            high = int(COMMON_PARAMS["lag"].high or 0)
            raise SpecError("lag", f"lag={self.lag} compresses nothing (each partition keeps at least one token)",
                            f"integer in [2, {high}]")

    def due(self, state: RequestState, num_tokens: int, steps_since: int) -> bool:
        """True once some layer's uncompressed tail holds two full partitions."""
        bases = [m["compressed"] for m in state.layers.values() if "compressed" in m]
        return bool(bases) and num_tokens - min(bases) >= 2 * self.lag

    def stream_due(self, state: RequestState, num_tokens: int) -> bool:
        """After a prefill chunk: as in decode, or (nothing compressed yet) once the first
        partition has its reference."""
        if any("compressed" in m for m in state.layers.values()):
            return self.due(state, num_tokens, 0)
        return num_tokens >= int(self.sink) + 2 * self.lag

    def streaming_bound(self, prompt_len: int) -> int | None:
        return lagkv_retained(prompt_len, int(self.sink), self.lag, self.ratio or 1.0)

    def select_layer(self, kv: LayerKV, state: RequestState) -> Selection:
        memory = state.layer(kv.layer)
        cursors: list[int | None] = memory.get("cursor") or [None] * kv.num_kv_heads
        positions = kv.slot_positions()
        lengths = kv.valid_lengths()
        groups: dict[tuple[int, int], list[int]] = {}  # (first live slot, first tail slot) -> heads
        for h in range(kv.num_kv_heads):
            start, first, cursors[h] = self._bounds(kv.num_slots, int(lengths[h]), positions[h], cursors[h])
            groups.setdefault((start, first), []).append(h)
        indices: list[torch.Tensor] = [torch.empty(0, dtype=torch.long)] * kv.num_kv_heads
        priority = torch.zeros(kv.num_kv_heads, kv.num_slots)  # scored partitions' tokens, for page rounding
        for (start, first), heads in groups.items():
            for h, idx, cursor, scores in self._heads(kv, heads, start, first, positions):
                indices[h] = idx
                cursors[h] = cursor if cursor is not None else cursors[h]
                priority[h, first : first + scores.numel()] = scores
        indices = state.pad(indices, priority, lengths)
        compressed = [len(idx) - int((positions[h, idx] >= (cursors[h] or 0)).sum()) for h, idx in enumerate(indices)]
        memory["cursor"] = cursors
        memory["compressed"] = state.ranks.reduce(min(compressed, default=0), min)  # every rank's heads
        if state.budget is None:
            state.budget = max((len(i) for i in indices), default=0)
        return Selection(indices)

    def _bounds(
        self, n: int, length: int, positions: torch.Tensor, cursor: int | None
    ) -> tuple[int, int, int | None]:
        """(first live slot, first slot of the uncompressed tail, cursor) of one head [S] positions."""
        start = n - length
        if length == 0:
            return n, n, cursor
        if cursor is None:  # first compression: the first `sink` live tokens (future ones if short)
            first = start + min(self.sink, length)
            cursor = int(positions[first]) if first < n else int(positions[-1]) + 1 + self.sink - length
        return start, start + int((positions[start:] < cursor).sum()), cursor

    def _heads(
        self, kv: LayerKV, heads: list[int], start: int, first: int, positions: torch.Tensor
    ) -> list[tuple[int, torch.Tensor, int | None, torch.Tensor]]:
        """(head, kept slots, new cursor or None = unchanged, scores of the slots from ``first``
        on) for heads sharing ``start``/``first``, scored together: keys/values [G, parts, L, D]."""
        n = kv.num_slots
        parts = (n - first) // self.lag
        if parts < 2:
            return [(h, torch.arange(start, n), None, torch.empty(0)) for h in heads]
        tail = first + (parts - 1) * self.lag
        keys = kv.keys[heads, first : first + parts * self.lag].unflatten(1, (parts, self.lag))
        values = kv.values[heads, first : first + parts * self.lag].unflatten(1, (parts, self.lag))
        scores = lagkv_scores(keys[:, :-1], values[:, :-1], keys[:, 1:], values[:, 1:]).cpu()  # [G, parts-1, L]
        top = scores.topk(lag_keep(self.lag, self.ratio or 1.0), dim=-1).indices
        offsets = first + self.lag * torch.arange(parts - 1).unsqueeze(1)
        chosen = torch.sort((top + offsets).flatten(1), dim=-1).values  # [G, kept]
        head_slots, tail_slots = torch.arange(start, first), torch.arange(tail, n)
        return [
            (h, torch.cat([head_slots, chosen[g], tail_slots]), int(positions[h, tail]), scores[g].flatten())
            for g, h in enumerate(heads)
        ]
