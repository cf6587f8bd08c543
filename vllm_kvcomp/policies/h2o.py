"""``h2o``: Heavy-Hitter Oracle (Zhang et al., 2023): accumulated attention + recent window.

Each KV head carries an accumulator of the attention its slots received (GQA: mean over the
query group), stored per layer in the request state and keyed by logical position, so it follows
the kept slots through every compaction; new slots start at 0. Each compression adds the
attention of the window queries not yet counted (``query_positions`` above the last counted
one), then keeps the ``window`` most recent tokens plus the heaviest hitters. Recompresses
during decode every ``interval`` steps.

Every decode query counts: at a decode recompression the engine's decode kernel (the CPU C
kernel, the Triton kernel on a GPU) hands over the attention each slot received from every
decode query since the last compression (``LayerKV.observed``, summed as it attended them,
:class:`~vllm_kvcomp.engine.state.ObservedAttention`), and nothing is read back or attended
again. Where it cannot (soft-capped or sink layers, a step with several query rows: drafts, a
chunk attended next to it) the engine gives the last ``max(window, interval)``
queries, the fresh ones of which count: decode queries older than those are then missed.

Deviation: the paper accumulates over *every* query; prefill contributes only its last ``window``
queries.

Deliberate choices (issue #17, pinned in ``tests/policies/test_h2o.py``):

* **Summed, not averaged.** The accumulator is the *sum* of the attention each token received,
  as in the H2O authors' code (``attn_weights.sum(0).sum(1)``, added up step by step). kvpress's
  ``ObservedAttentionPress`` divides by the number of queries that could see the token; at a
  one-shot prefill that only rescales the tokens before the window (all seen by every window
  query) and the window is kept anyway, so the two rank the same there. They differ in decode,
  where the sum favours old tokens (H2O's heavy hitters) and the mean newer ones.
* **Budget rounds up.** Kept per head = ``ceil(ratio · N)`` (every policy, ``params.kept_count``),
  where the references truncate (``int(heavy_ratio · N) + int(recent_ratio · N)`` in H2O,
  ``int(N · (1 - compression_ratio))`` in kvpress): the requested ratio is a floor on what is
  kept, never rounded away (and the engine's page grid rounds up again).
* The recent part is the fixed ``window`` (default 32) and heavy hitters take the rest; the
  authors split the budget into heavy and recent halves.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

import torch

from vllm_kvcomp.params import Param
from vllm_kvcomp.policies.base import (
    LayerKV,
    RequestState,
    ScorePolicy,
    Selection,
    SlotMemory,
    reduce_gqa,
    window_attention_mass,
)
from vllm_kvcomp.policies.wrappers import HEADS_PARAMS, HeadsChoice


@dataclass
class H2O(HeadsChoice, ScorePolicy):
    """Heavy hitters (accumulated attention) + recent window, recompressed during decode."""

    name: ClassVar[str] = "h2o"
    READS_VALUES: ClassVar[bool] = False
    KEEPS: ClassVar[str] = "heaviest accumulated attention + recent `window` (recompresses)"
    PAPER: ClassVar[str] = "Zhang et al. 2023"
    TEST_PARAMS: ClassVar[Mapping[str, Any]] = {"ratio": 0.5, "window": 8, "interval": 4}
    VARIANTS: ClassVar[Mapping[str, Mapping[str, Any]]] = {"adaptive": {"heads": "adaptive"}}
    PARAMS: ClassVar[dict[str, Param]] = {**HEADS_PARAMS}
    RECOMPRESSES: ClassVar[bool] = True
    OBSERVES_ATTENTION: ClassVar[bool] = True

    ratio: float | None = 0.5
    budget: int | None = None
    sink: int = 0
    window: int = 32
    interval: int = field(default=16, kw_only=True)
    heads: str = "uniform"

    def queries_needed(self) -> int:
        return max(self.window, self.interval)

    def score(self, kv: LayerKV, state: RequestState) -> torch.Tensor:
        """[H_kv, N] accumulator after adding the not-yet-counted window queries.

        Does not commit: repeated calls before :meth:`commit_kept` give the same result.
        """
        return self.score_layers([kv], state)[0]

    def score_layers(self, layers: Sequence[LayerKV], state: RequestState) -> list[torch.Tensor]:
        """:meth:`score` of every layer, their memories looked up in one search."""
        memories = [state.layer(kv.layer, H2OMemory) for kv in layers]
        positions = [kv.slot_positions() for kv in layers]
        remembered = [m.acc for m in memories]
        if all(acc is not None for acc in remembered):
            carried = SlotMemory.lookup_layers(remembered, positions)
        else:  # a first compression remembers nothing
            carried = [torch.zeros(p.shape) if acc is None else acc.lookup(p) for acc, p in zip(remembered, positions)]
        return [self._add_window(kv, memory, acc) for kv, memory, acc in zip(layers, memories, carried)]

    @staticmethod
    def _add_window(kv: LayerKV, memory: H2OMemory, acc: torch.Tensor) -> torch.Tensor:
        """[H_kv, N] the carried accumulator ``acc`` plus the window queries not yet counted,
        pending in ``memory`` until the commit."""
        acc = acc.to(kv.keys.device)  # the accumulators are ranked where the cache is; they are kept on the host
        counted = memory.counted
        if kv.observed is not None:  # the decode queries' attention, summed by the engine's kernel as it attended
            acc = acc + kv.observed.to(acc.device)
            counted = max(counted, kv.observed_through)
        query_pos = kv.window_query_positions()
        fresh = query_pos > counted
        if bool(fresh.any()):
            # only the fresh queries attend (a decode recompression counts `interval` of the window)
            fresh_kv = replace(kv, queries=kv.queries[:, fresh.to(kv.queries.device)], query_positions=query_pos[fresh])
            probs = window_attention_mass(fresh_kv)  # [H_q, N]
            acc = acc + reduce_gqa(probs, kv.num_kv_heads).float()
            counted = int(query_pos.max())
        memory.pending = (acc, counted)
        return acc

    def commit_kept(self, layers: Sequence[LayerKV], state: RequestState, picks: Sequence[Selection],
                    kept: Sequence[Selection]) -> None:
        """Every layer's pending accumulators, remembered at its kept slots (one gather for all)."""
        memories = [state.layer(kv.layer, H2OMemory) for kv in layers]
        pending = [m.pending for m in memories]
        accs = SlotMemory.kept_layers([acc for acc, _ in pending], [kv.slot_positions() for kv in layers],
                                      [selection.indices for selection in kept])
        for memory, (_, counted), acc in zip(memories, pending, accs):
            memory.acc, memory.counted, memory.pending = acc, counted, None


@dataclass
class H2OMemory:
    """One layer's accumulators, by logical position, and the last query position counted."""

    acc: SlotMemory | None = None
    counted: int = -1
    pending: tuple[torch.Tensor, int] | None = None  # scored, not yet committed: ([H_kv, N], counted)
