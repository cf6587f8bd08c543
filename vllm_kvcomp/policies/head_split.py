"""Retrieval heads keep every token, the others their first ``sink`` and most recent tokens: the
shape RazorAttention (``razor``) and DuoAttention (``duoattention``) share; they differ in how
the retrieval heads are found (a calibration profile each) and in their paper's window.

How many (``exact=0``): ``ratio`` is the mean kept fraction over all T (layer, KV head) pairs, as
for every policy. With R retrieval heads keeping the whole prompt of N tokens, every other head
keeps ``ceil((B·T − R·N) / (T − R))`` tokens, sink included, B = ``ceil(ratio·N)`` (or
``budget``), at least ``sink + MIN_RECENT``. When the retrieval heads alone hold more than
``ratio`` (``ratio ≤ R/T``, or a short prompt where the floor rules) the request is infeasible:
the server refuses it when it can tell (HTTP 400, ``vllm_kvcomp.server.protocol.check_fit``,
:meth:`HeadSplit.check_fit`); otherwise the other heads keep their floor, a warning names the
smallest feasible ratio and ``kept_fraction`` reports what is held.

``exact=1``: the paper's window (:meth:`HeadSplit.exact_window`) after the sinks; the retrieval
heads come on top, so the cache holds more than ``ratio``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import ClassVar

import torch

from vllm_kvcomp.params import SpecError
from vllm_kvcomp.policies.base import LayerKV, Policy, RequestState, Selection, ceil_div

#: Fewest recent tokens a non-retrieval head keeps with ``exact=0``: its floor is sink + this.
MIN_RECENT = 1


class HeadSplit(Policy):
    """Base of the retrieval-head policies. Subclasses are dataclasses with the fields ``ratio``,
    ``budget``, ``sink`` and ``exact`` and say which (layer, KV head) pairs of the model are
    retrieval heads (:meth:`retrieval_set`) and what ``exact=1`` keeps (:meth:`exact_window`)."""

    #: what else makes an infeasible ratio feasible (the 400's allowed values end with it)
    FIT_HINT: ClassVar[str] = "or exact=1 for the paper's window"

    def retrieval_set(self) -> frozenset[tuple[int, int]] | None:
        """The model's (layer, KV head) pairs that keep every token; None: no profile bound."""
        raise NotImplementedError

    def exact_window(self, n_tokens: int) -> int:
        """``exact=1``: recent tokens a non-retrieval head keeps of ``n_tokens`` (after the sinks)."""
        raise NotImplementedError

    def check_fit(self, retrieval: int, heads: int) -> None:
        """SpecError (``ratio``) when ``retrieval`` of the ``heads`` (layer, KV head) pairs the engine
        compresses keep everything and already hold ``ratio`` of the cache, whatever the prompt
        (``exact=0``)."""
        share = retrieval / heads if heads else 0.0
        if self.exact or self.ratio is None or self.ratio > share:
            return
        raise SpecError(
            "ratio", f"{self.ratio:g} is infeasible with this server's {self.PROFILE} profile: its {retrieval} "
            f"retrieval heads of the {heads} (layer, KV head) pairs it compresses keep every token, {share:.4f} of "
            "the cache by themselves",
            f"a number in ({share:.4f}, 1] (a little more for short prompts: the other heads keep at least "
            f"sink + {MIN_RECENT} tokens), {self.FIT_HINT}",
        )

    def floor(self, n_tokens: int) -> int:
        """``exact=0``: fewest tokens a non-retrieval head keeps of ``n_tokens``, sink + MIN_RECENT."""
        return min(n_tokens, int(self.sink or 0) + MIN_RECENT)

    def others_keep(self, n_tokens: int, heads: int, retrieval: int) -> int:
        """Tokens (sink included) each non-retrieval head keeps of ``n_tokens`` when ``retrieval`` of
        ``heads`` (layer, KV head) pairs keep everything: the mean is ``kept_for(n)`` (``exact=0``)."""
        if self.exact:
            return min(n_tokens, int(self.sink or 0) + self.exact_window(n_tokens))
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

    def due(self, state: RequestState, num_tokens: int, steps_since: int) -> bool:
        """``decode=recompress``: the retrieval heads hold every token, so the longest head is
        always over the budget; the others grow one token a step and are a page over theirs a
        page of steps after the last compression (and ``interval`` steps, when set)."""
        return steps_since >= max(state.page_size, self.interval or 1)

    def mean_kept_bound(self, prompt_len: int, num_heads: int | None = None) -> int | None:
        """Retrieval heads keep the prompt, the other ``num_heads - R`` :meth:`others_keep` (razor's
        compensation token is not a cell): ``kept_for(N)`` + 1 at most with ``exact=0`` unless
        infeasible; None without a profile and head count."""
        heads = self.retrieval_set()
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
        logger = logging.getLogger(type(self).__module__)
        heads = self.retrieval_set()
        if heads is None:
            logger.warning("%s: no %s profile bound; every head is compressed", self.name, self.PROFILE)
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
                "%s: %s is infeasible for this %d-token prompt: %d retrieval heads of %d (layer, KV head) "
                "pairs keep every token, the others at least sink + %d; the smallest feasible ratio is %.4f "
                "(or exact=1). Served holding %.4f of the cache (kept_fraction says so)", self.name, self._size(),
                n, retrieval, total, MIN_RECENT, smallest, smallest)
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
            keep = keep_sink + self.exact_window(prompt) if self.exact else self.others_keep(prompt, total, retrieval)
            global_head = state.ranks.rank * kv.num_kv_heads + h  # profiles name the model's KV heads
            if (kv.layer, global_head) in heads or keep >= length:
                indices.append(torch.arange(start, n))
            else:
                indices.append(torch.cat([torch.arange(start, start + keep_sink), torch.arange(n - keep + keep_sink, n)]))
        return Selection(indices)
