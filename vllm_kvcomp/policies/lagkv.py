"""``lagkv``: LagKV (000_…): attention-free, lag-relative scoring (eq. 5–9), recursive.

Per head: the first ``sink`` (S) tokens, then partitions of ``lag`` (L) tokens. Partition p is
scored against partition p+1 (its reference): each channel of K (and separately V) is min-max
normalised with the reference's per-channel min/max over the sequence (eq. 5–7); a token's score
is the softmax over the partition of the channel-wise std of its normalised K plus the same for
V (eq. 8–9). The last full partition and the remainder (the *tail*) have no reference yet and are
not scored. A scored partition keeps its best-scored tokens.

How many (``exact=0``, the default): ``ratio`` is the fraction of the tokens a head has seen that
it keeps, ``B(n) = ceil(ratio·n)``, as for every policy. The sink and the tail stay whole while
they fit in B; the scored partitions share the rest, ``B − S − tail``, split evenly by partition
index (partition p of a prompt of N tokens keeps ``⌊(p+1)·X/M⌋ − ⌊p·X/M⌋`` of
``X = B(N) − S − tail``, M scored partitions); if sink and tail alone exceed B, the tail keeps
its newest tokens and the sink its first B. So a head holds exactly B(n) after every
compression (before page rounding), also for a prompt shorter than ``S + 2L`` (nothing is scored:
sink + newest tokens).

``exact=1``: the paper's rule. ``ratio`` is r, the fraction kept *per scored partition*: each keeps
its top ``floor(r·L)`` tokens (at least 1; floor as in the authors' code), sink and tail stay
whole, so for ``Ls ≥ S + 2L`` tokens the cache holds (eq. 10)

    L_R = S + floor(r·L)·(floor((Ls - S)/L) - 1) + L + (Ls - S) mod L

and ``Ls < S + 2L`` compresses nothing (at ``Ls = S + 2L`` the first partition already has a
complete reference and is compressed, matching eq. 10 and the authors' ``>=``).

Decode: a per-head cursor (logical position where the tail starts) lives in the layer state; a
recompression is due as soon as some tail holds two full partitions, and it compresses every
partition whose reference is complete. ``exact=0`` chases B(n) of the tokens seen (held tokens
count what they are, page rounding included, so the error never accumulates); ``exact=1`` keeps
eq. 10 of the total length. With ``prefill=stream`` the partitions of the prompt keep the whole
prompt's schedule above, so streaming keeps what compressing the prompt at its end keeps.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from vllm_kvcomp.params import Param
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
    """Tokens a scored partition keeps with ``exact=1``: ``floor(r·L)``, at least 1.

    The authors' code takes ``int(r·L)``; two deliberate differences (issue #17, pinned in
    ``tests/policies/test_lagkv.py``): the ``1e-9`` lets a decimal ratio mean what it says
    (0.57·100 is 56.99999999999999 in binary, ``int`` gives 56, this gives 57; it changes nothing
    unless r·L is within 1e-9 below an integer), and at least one token survives per partition
    (``int`` gives 0 when r·L < 1, which silently turns LagKV into sink + sliding window).
    """
    return max(1, math.floor(ratio * lag + 1e-9))


def lagkv_retained(n_tokens: int, sink: int, lag: int, ratio: float) -> int:
    """Eq. 10: cache length after LagKV (``exact=1``) compressed ``n_tokens`` tokens."""
    if n_tokens < sink + 2 * lag:
        return n_tokens
    parts, rest = divmod(n_tokens - sink, lag)
    return sink + lag_keep(lag, ratio) * (parts - 1) + lag + rest


EXACT_PARAM = Param(
    "exact", int, 0, 0, 1,
    help="1: the paper's eq. 10–11 (ratio = r, the fraction kept per scored partition; sink and tail "
    "whole, so a head holds more than ratio); 0: ratio is the fraction of the tokens seen a head keeps",
)


def _clamp(value: int, low: int, high: int) -> int:
    return max(low, min(value, high))


@dataclass
class _Track:
    """What ``exact=0`` remembers of one head between compressions."""

    prompt: int  # tokens of the prompt the head sees: its partitions' schedule (:meth:`LagKV._schedule`)
    sink: int  # its sink: at most S, at most B(prompt)
    seen: int  # tokens it has seen, evicted ones included
    held: int  # tokens it held after the last compression
    parts: int = 0  # partitions compressed so far


@dataclass
class LagKVMemory:
    """One layer's LagKV state: per head the cursor (where its uncompressed tail starts) and its
    ``exact=0`` track; the shortest compressed prefix over heads (ranks included)."""

    cursor: list[int | None] | None = None
    track: list[_Track | None] | None = None
    compressed: int | None = None
    pending: tuple[list[_Plan], list[int | None], list[_Track | None]] | None = None  # picked, not committed


@dataclass
class _Plan:
    """One head's compression: keep ``[start, first)``, the top ``keeps[j]`` of scored partition j
    (slots ``first + j·L`` on) and the newest ``tail`` live slots."""

    start: int
    first: int
    keeps: list[int]
    tail: int
    cursor: int | None  # logical position where the uncompressed tail starts afterwards


@dataclass
class LagKV(Policy):
    """Recursive lag-relative compression; ``ratio`` is the fraction of the tokens seen a head keeps
    (``exact=1``: the fraction r kept per partition, eq. 10)."""

    name: ClassVar[str] = "lagkv"
    KEEPS: ClassVar[str] = (
        "per `lag` partition, the top tokens by lag-relative K/V spread; sink + last partition while they fit")
    PAPER: ClassVar[str] = "paper 000 (2025)"
    TEST_PARAMS: ClassVar[Mapping[str, Any]] = {"ratio": 0.5, "sink": 4, "lag": 16}
    VARIANTS: ClassVar[Mapping[str, Mapping[str, Any]]] = {"exact": {"exact": 1}}
    RECOMPRESSES: ClassVar[bool] = True
    PACED_BY_INTERVAL: ClassVar[bool] = False  # every `lag` decode steps
    STREAMS: ClassVar[bool] = True
    PARAMS: ClassVar[dict[str, Param]] = {"exact": EXACT_PARAM}

    ratio: float | None = 0.5
    sink: int = 16
    lag: int = 128
    exact: int = 0

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
        bases = [m.compressed for m in state.memories(LagKVMemory) if m.compressed is not None]
        return bool(bases) and num_tokens - min(bases) >= 2 * self.lag

    def stream_due(self, state: RequestState, num_tokens: int) -> bool:
        """After a prefill chunk: as in decode, or (nothing compressed yet) once the first
        partition has its reference."""
        if any(m.compressed is not None for m in state.memories(LagKVMemory)):
            return self.due(state, num_tokens, 0)
        return num_tokens >= int(self.sink) + 2 * self.lag

    def streaming_bound(self, prompt_len: int) -> int | None:
        """Most a head holds after any chunk's compression: mid-prompt (``exact=0``) its tail, up
        to 2L − 1 tokens, stays whole even where the prompt's end cuts it."""
        if self.exact:
            return self.mean_kept_bound(prompt_len)
        sink = min(int(self.sink), self.kept_for(prompt_len))
        middle = self._prompt_share(prompt_len, sink)[1]
        return max(self.kept_for(prompt_len), min(prompt_len, sink + middle + 2 * self.lag - 1))

    def mean_kept_bound(self, prompt_len: int, num_heads: int | None = None) -> int | None:
        """Every head keeps the same count of a ``prompt_len`` prompt: B(N) (eq. 10 with ``exact=1``)."""
        if self.exact:
            return lagkv_retained(prompt_len, int(self.sink), self.lag, self.ratio or 1.0)
        return self.kept_for(prompt_len)

    def select_layer(self, kv: LayerKV, state: RequestState) -> Selection:
        memory = state.layer(kv.layer, LagKVMemory)
        heads, n = kv.num_kv_heads, kv.num_slots
        cursors = memory.cursor or [None] * heads
        tracks = memory.track or [None] * heads
        positions = kv.slot_positions()
        lengths = kv.valid_lengths()
        plans = [self._plan(n, int(lengths[h]), positions[h], cursors[h], tracks, h, state.prompt_len)
                 for h in range(heads)]
        groups: dict[tuple[int, int], list[int]] = {}  # (first scored slot, scored partitions) -> heads
        for h, plan in enumerate(plans):
            groups.setdefault((plan.first, len(plan.keeps)), []).append(h)
        chosen: list[torch.Tensor] = [torch.empty(0, dtype=torch.long)] * heads
        priority = torch.zeros(heads, n)  # scored partitions' tokens, for page rounding
        for (first, scored), members in groups.items():
            if scored:
                scores = self._scores(kv, members, first, scored)  # [G, scored, L]
                for g, h in enumerate(members):
                    chosen[h] = _top(scores[g], plans[h].keeps, first)
                    priority[h, first : first + scores[g].numel()] = scores[g].flatten()
        memory.pending = (plans, cursors, tracks)
        return Selection([torch.cat([torch.arange(p.start, p.first), chosen[h], torch.arange(n - p.tail, n)])
                          for h, p in enumerate(plans)], priority=priority)

    def commit_kept(self, layers: Sequence[LayerKV], state: RequestState, picks: Sequence[Selection],
                    kept: Sequence[Selection]) -> None:
        """Cursors, held counts and the compressed prefix follow what is kept (page rounding
        included); the first compression fixes ``state.budget`` at the most any head keeps."""
        for kv, selection in zip(layers, kept):
            memory = state.layer(kv.layer, LagKVMemory)
            (plans, cursors, tracks), memory.pending = memory.pending, None
            positions = kv.slot_positions()
            for h, (plan, idx) in enumerate(zip(plans, selection.indices)):
                cursors[h] = plan.cursor
                track = tracks[h]
                if track is not None:
                    track.held, track.parts = len(idx), track.parts + len(plan.keeps)
            compressed = [len(idx) - int((positions[h, idx] >= (cursors[h] or 0)).sum())
                          for h, idx in enumerate(selection.indices)]
            memory.cursor = cursors
            if not self.exact:
                memory.track = tracks
            memory.compressed = state.ranks.reduce(min(compressed, default=0), min)  # every rank's heads
        if state.budget is None:
            state.budget = max((len(idx) for sel in kept for idx in sel.indices), default=0)

    def _plan(self, n: int, length: int, positions: torch.Tensor, cursor: int | None,
              tracks: list[_Track | None], h: int, prompt_len: int) -> _Plan:
        """What head ``h`` (positions [N], ``length`` live slots) keeps; creates or updates its
        ``tracks[h]`` (``exact=0``)."""
        start = n - length
        if length == 0:
            return _Plan(n, n, [], 0, cursor)
        track = tracks[h]
        if cursor is None:  # first compression: the sink, then (if short) future tokens fill it
            prompt = length + max(0, prompt_len - int(positions[-1]) - 1)  # prefill=stream: the whole prompt
            sink = int(self.sink) if self.exact else min(int(self.sink), self.kept_for(prompt))
            first = start + min(sink, length)
            cursor = int(positions[first]) if first < n else int(positions[-1]) + 1 + sink - length
            track = tracks[h] = None if self.exact else _Track(prompt, sink, seen=length, held=length)
        else:
            first = start + int((positions[start:] < cursor).sum())
            if track is not None:
                track.seen += length - track.held
        scored = max((n - first) // self.lag - 1, 0)
        tail = n - first - scored * self.lag
        if track is None:
            keeps, keep_tail = [lag_keep(self.lag, self.ratio or 1.0)] * scored, tail
        else:
            keeps, keep_tail = self._shares(track, first - start, scored, tail)
        if scored or keep_tail < tail:  # the tail starts anew
            cursor = int(positions[n - keep_tail]) if keep_tail else int(positions[-1]) + 1
        return _Plan(start, first, keeps, keep_tail, cursor)

    def _shares(self, track: _Track, head: int, scored: int, tail: int) -> tuple[list[int], int]:
        """``exact=0``: (kept tokens of each newly scored partition, kept tail tokens) of a head
        holding ``head`` tokens before them (sink and compressed partitions) and ``tail`` after."""
        done = max(head - track.sink, 0)  # held of the partitions compressed before
        if track.seen < track.prompt:  # within the prompt (prefill=stream): its schedule, tail whole
            total, keep_tail = _clamp(self._schedule(track, track.parts + scored) - done, 0, scored * self.lag), tail
        else:
            budget = self.kept_for(track.seen)
            total = _clamp(budget - head - tail, 0, scored * self.lag)
            keep_tail = _clamp(budget - head - total, 0, tail)
        if not scored:
            return [], keep_tail
        cuts = [0, *(_clamp(self._schedule(track, track.parts + j) - done, 0, total) for j in range(1, scored)), total]
        return [b - a for a, b in itertools.pairwise(cuts)], keep_tail

    def _schedule(self, track: _Track, parts: int) -> int:
        """Tokens the first ``parts`` scored partitions of the head keep between them: the prompt's
        share split evenly over its scored partitions, then L per partition beyond (an upper
        bound: in decode the target B(n) rules)."""
        prompt_parts, share = self._prompt_share(track.prompt, track.sink)
        if not prompt_parts:
            return parts * self.lag
        return min(parts, prompt_parts) * share // prompt_parts + max(parts - prompt_parts, 0) * self.lag

    def _prompt_share(self, prompt: int, sink: int) -> tuple[int, int]:
        """(M, X): the scored partitions of a ``prompt``-token prompt after ``sink`` tokens and what
        they keep between them, ``X = B(N) − sink − tail`` (at least 0)."""
        rest = prompt - sink
        parts = max(rest // self.lag - 1, 0)
        return parts, _clamp(self.kept_for(prompt) - sink - (rest - parts * self.lag), 0, parts * self.lag)

    def _scores(self, kv: LayerKV, heads: list[int], first: int, scored: int) -> torch.Tensor:
        """[G, scored, L] scores of ``scored`` partitions from slot ``first`` of ``heads``, each
        against the next partition."""
        end = first + (scored + 1) * self.lag
        keys = kv.keys[heads, first:end].unflatten(1, (scored + 1, self.lag))
        values = kv.values[heads, first:end].unflatten(1, (scored + 1, self.lag))
        return lagkv_scores(keys[:, :-1], values[:, :-1], keys[:, 1:], values[:, 1:]).cpu()


def _top(scores: torch.Tensor, keeps: list[int], first: int) -> torch.Tensor:
    """Sorted slots of the top ``keeps[j]`` tokens of each scored partition j (scores [P, L]),
    the partitions starting at slot ``first``."""
    most = max(keeps)
    if not most:
        return torch.empty(0, dtype=torch.long)
    lag = scores.shape[1]
    top = scores.topk(most, dim=-1).indices + first + lag * torch.arange(len(keeps)).unsqueeze(1)
    wanted = torch.arange(most) < torch.tensor(keeps).unsqueeze(1)
    return torch.sort(top[wanted]).values
