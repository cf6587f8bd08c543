"""``pod``: POD (004_…) — proximal tokens over distant tokens, distant scores shared in layer groups.

The paper post-trains a model whose layers in a calibrated group (§2.1) attend to *distant*
tokens with the scores of the group's lowest layer (eq. 3), merge proximal and distant parts with
the gate g of eq. 4, and skip the distant part when g ≥ τ (§2.3). This module gives

* the exact split attention of Appendix A.1 as reference functions (:func:`proximal_masks`,
  :func:`pod_gate`, :func:`split_attention`): with a layer's own distant scores it equals full
  attention;
* a training-free *token-selection* policy :class:`POD`, mapped as follows, per KV head:

  - proximal tokens = the first ``sink`` (n_s) and the last ``window`` (n_r) live tokens: always kept;
  - distant tokens = the rest. The group's lowest layer ℓa scores them by its distant attention
    (softmax over distant keys only, eq. 3, of the last ``observe`` prompt queries, averaged over
    queries and over the KV head's query group); every layer of the group keeps the distant tokens
    ℓa ranks highest, up to the per-head budget (``ratio`` / ``budget``) — the shared-score
    variant, without training;
  - the gate g (eq. 4: layer ℓ's own proximal mass against ℓa's distant mass) is averaged over the
    observed queries; a KV head drops *all* its distant tokens at layer ℓ when g ≥ ``tau`` for
    every query head of its group (the paper skips the distant computation per decoding step;
    here the decision is taken once, after prefill, so ``tau`` defaults higher than its 0.7).

``ratio`` is the mean kept fraction over every (layer, KV head): what the heads that skip do not
use of the per-head budget B goes to the others, in equal shares moved onto the engine's page grid
with their sum kept (:func:`share_budget`), so the request holds B per head on average, within one
page in all (issue #28; every rank of a tensor-parallel engine sees every head's gate). Without a
profile (``groups is None``) every layer is its own group (own scores). With ``decode=recompress``
each decode recompression decides afresh from the newest queries, to the same mean (the policy
carries no memory between compressions: ``budget`` stays the mean).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from vllm_kvcomp.params import Param, SpecError
from vllm_kvcomp.policies.base import (
    LayerKV,
    Policy,
    Ranking,
    RequestState,
    Selection,
    budget_basis,
    page_count,
    protected_topk,
    reduce_gqa,
    snap_to_pages,
    window_chunks,
    window_logits,
)
from vllm_kvcomp.policies.compensation import attention_with_lse
from vllm_kvcomp.policies.razor import PROFILE_PARAM, check_profile_name

# ---------------------------------------------------------------------------- Appendix A.1 reference


def proximal_masks(
    query_positions: torch.Tensor, key_positions: torch.Tensor, start: int, recent: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal proximal / distant split of eq. 3 for each query.

    query_positions [T], key_positions [S] (-1 = invalid). Key j is proximal for query i if
    ``j < start`` (n_s initial tokens) or ``i - recent < j <= i`` (n_r neighbours incl. itself);
    distant if visible and not proximal. Returns (proximal [T, S], distant [T, S]) bool.
    """
    q = query_positions.view(-1, 1)
    k = key_positions.view(1, -1)
    visible = (k >= 0) & (k <= q)
    proximal = visible & ((k < start) | (k > q - recent))
    return proximal, visible & ~proximal


def pod_gate(lse_proximal: torch.Tensor, lse_distant: torch.Tensor) -> torch.Tensor:
    """Eq. 4/6: g = Σexp a^P / (Σexp a^P + Σexp a^D) from log-sum-exps; 1 where both are empty."""
    return torch.sigmoid(lse_proximal - lse_distant).nan_to_num(1.0)


def split_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    proximal: torch.Tensor,
    distant: torch.Tensor,
    shared_q: torch.Tensor | None = None,
    shared_k: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """POD attention (eq. 3–4): o = g·o^P + (1 − g)·o^D.

    q [T, H, D], k/v [S, H, D] (heads already expanded), proximal/distant [T, S] bool. The distant
    logits use ``shared_q`` [T, H, D] / ``shared_k`` [S, H, D] (the group's lowest layer) when
    given, else the layer's own q/k — then the result equals full attention over
    ``proximal | distant`` (Appendix A.1). Returns (out [T, H, D], gate [T, H]).
    """
    out_p, lse_p = attention_with_lse(q, k, v, scale, proximal)
    dq = q if shared_q is None else shared_q
    dk = k if shared_k is None else shared_k
    out_d, lse_d = attention_with_lse(dq, dk, v, scale, distant)
    gate = pod_gate(lse_p, lse_d)
    g = gate.unsqueeze(-1)
    out = g * out_p.to(gate.dtype) + (1.0 - g) * out_d.to(gate.dtype)
    return out.to(q.dtype), gate


# ---------------------------------------------------------------------------- the policy


@dataclass
class POD(Policy):
    """Training-free POD token selection. ``groups``: consecutive layer blocks sharing scores."""

    name: ClassVar[str] = "pod"
    KEEPS: ClassVar[str] = (
        "per layer group, proximal (sink + recent) + distant tokens ranked by the group's lowest layer; "
        "gated heads keep their proximal tokens, their unused budget goes to the other heads")
    PAPER: ClassVar[str] = "paper 004"
    TEST_PARAMS: ClassVar[Mapping[str, Any]] = {"ratio": 0.5, "sink": 4, "window": 8, "observe": 8}
    PROFILE: ClassVar[str | None] = "pod"
    READS_VALUES: ClassVar[bool] = False
    PARAMS: ClassVar[dict[str, Param]] = {
        "tau": Param("tau", float, 0.9, 0.0, 1.0, help="gate threshold: drop distant tokens when g >= tau"),
        "observe": Param("observe", int, 16, 1, 4096, help="trailing prompt queries that score and gate"),
        "profile": PROFILE_PARAM,
    }

    groups: tuple[tuple[int, ...], ...] | None = None
    ratio: float | None = 0.5
    budget: int | None = None
    sink: int | None = 16
    window: int | None = 128
    tau: float = 0.9
    observe: int = 16
    profile: str = "default"

    def check(self) -> None:
        check_profile_name(self.profile)
        proximal = int(self.sink or 0) + int(self.window or 0)
        if self.budget is not None and self.budget < proximal:
            raise SpecError(
                "budget", f"{self.budget} is below sink + window = {proximal} (proximal tokens are always kept)",
                f"integer >= {proximal}, or a smaller sink/window",
            )

    def queries_needed(self) -> int:
        return int(self.observe)

    def budgets_on_pages(self) -> bool:
        return True  # the shares are snapped (share_budget)

    def mean_kept_bound(self, prompt_len: int, num_heads: int | None = None) -> int | None:
        """The heads keep the budget on average (gated heads' unused budget goes to the others)."""
        return min(prompt_len, self.kept_for(prompt_len))

    def layer_groups(self, num_layers: int) -> tuple[tuple[int, ...], ...]:
        """The groups to use for a model of ``num_layers`` (singletons without a profile)."""
        if self.groups is None:
            return tuple((i,) for i in range(num_layers))
        from vllm_kvcomp.calibration.profiles import check_groups

        return check_groups(self.groups, num_layers)

    def select(self, layers: Sequence[LayerKV], state: RequestState) -> list[Selection]:
        if not layers:
            return []
        by_layer = {kv.layer: kv for kv in layers}
        if state.budget is None:
            state.budget = self.kept_for(budget_basis(layers, state))
        scored: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # layer -> (skip [H_kv], scores [H_kv, N])
        for group in self.layer_groups(layers[0].num_layers):
            present = [by_layer[i] for i in group if i in by_layer]
            if not present:
                continue
            # the lowest layer of the group that this call sees (all of it, unless layers are sharded)
            anchor = present[0]
            lse_distant, mean = self._distant(anchor)
            by_position = _scores_by_position(anchor, reduce_gqa(mean, anchor.num_kv_heads))
            for kv in present:
                scored[kv.layer] = self._score_layer(kv, lse_distant, by_position)
        keeps = self._keeps(layers, [scored[kv.layer][0] for kv in layers], state)
        sink, window = int(self.sink or 0), int(self.window or 0)
        rankings = [Ranking(scored[kv.layer][1]) for kv in layers]
        return [Selection(protected_topk(ranking, keep, kv.valid_lengths(), sink, window), priority=ranking)
                for kv, keep, ranking in zip(layers, keeps, rankings)]

    def _keeps(self, layers: Sequence[LayerKV], skips: list[torch.Tensor], state: RequestState) -> list[list[int]]:
        """Per layer, each local KV head's kept count: a head that skips keeps its proximal tokens,
        the budget it leaves goes to the heads that do not (over every rank's heads). The request's
        ``budget`` stays the mean: a decode recompression shares it out afresh from the newest
        gates (``allotted``, the largest count, is what the next one waits a page past)."""
        proximal = min(state.budget, int(self.sink or 0) + int(self.window or 0))
        local = torch.stack(skips)  # [L, H_local]
        gathered = state.ranks.gather(local)
        offset = sum(g.shape[1] for g in gathered[: state.ranks.rank])
        every = torch.cat(gathered, dim=1)  # [L, H_total]
        lengths = torch.stack([kv.valid_lengths() for kv in layers])
        shares = share_budget(every.flatten().tolist(), state.budget, proximal, state.page_quantum,
                              int(lengths.max()))
        shares = torch.tensor(shares).view(every.shape)
        return torch.minimum(shares[:, offset : offset + local.shape[1]], lengths).tolist()

    def _distant(self, anchor: LayerKV) -> tuple[torch.Tensor, torch.Tensor]:
        """The group anchor's distant attention (eq. 3): its log-sum-exp [H_q, w] and the softmax
        over the distant tokens averaged over the window queries [H_q, N], the window attended
        ``WINDOW_ROWS`` queries at a time (one layer's ``[H_q, rows, N]`` held, whatever the window)."""
        _, distant = self._split(anchor)
        hidden = ~distant.repeat_interleave(_group_size(anchor), 0).unsqueeze(1).to(anchor.queries.device)
        parts, lses, mass = window_chunks(anchor), [], None
        for part in parts:
            d_logits = window_logits(part).masked_fill_(hidden, float("-inf"))
            lses.append(d_logits.logsumexp(-1))  # [H_q, rows]
            probs = torch.softmax(d_logits, -1).nan_to_num(0.0)  # eq. 3 distant softmax
            if len(parts) == 1:
                return lses[0], probs.mean(1)
            mass = probs.sum(1) if mass is None else mass.add_(probs.sum(1))
        return torch.cat(lses, dim=1), mass / anchor.queries.shape[1]

    def _score_layer(self, kv: LayerKV, lse_distant: torch.Tensor,
                     by_position: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(skip [H_kv]: the head drops its distant tokens, scores [H_kv, N] by the group's anchor)."""
        proximal, _ = self._split(kv)
        group = _group_size(kv)
        hidden = ~proximal.repeat_interleave(group, 0).unsqueeze(1).to(kv.queries.device)
        lse_proximal = torch.cat([window_logits(part).masked_fill_(hidden, float("-inf")).logsumexp(-1)
                                  for part in window_chunks(kv)], dim=1)  # [H_q, w]
        gate = pod_gate(lse_proximal, lse_distant).mean(1)  # [H_q]
        skip = (gate >= self.tau).view(kv.num_kv_heads, group).all(1).cpu()  # [H_kv]
        positions = kv.slot_positions()
        scores = torch.full(positions.shape, float("-inf"), dtype=by_position.dtype)
        valid = (positions >= 0) & (positions < by_position.shape[1])
        rows = torch.arange(kv.num_kv_heads).unsqueeze(1).expand_as(positions)
        scores[valid] = by_position[rows[valid], positions[valid]]
        return skip, scores

    def select_layer(self, kv: LayerKV, state: RequestState) -> Selection:
        return self.select([kv], state)[0]

    def _split(self, kv: LayerKV) -> tuple[torch.Tensor, torch.Tensor]:
        """Per KV head (proximal [H_kv, N], distant [H_kv, N]) slot masks of the live tokens."""
        n = kv.num_slots
        lengths = kv.valid_lengths()
        slots = torch.arange(n).unsqueeze(0)
        start = (n - lengths).unsqueeze(1)
        sink = torch.clamp(lengths, max=int(self.sink or 0)).unsqueeze(1)
        recent = torch.minimum(lengths.unsqueeze(1) - sink, torch.full_like(sink, int(self.window or 0)))
        live = slots >= start
        proximal = live & ((slots < start + sink) | (slots >= n - recent))
        return proximal, live & ~proximal


def share_budget(skips: Sequence[bool], budget: int, proximal: int,
                 quantum: tuple[int, int] | None = None, length: int = 0) -> list[int]:
    """Kept count per head (flattened (layer, head) order) so that the mean is ``budget``: a
    skipping head keeps ``proximal`` (rounded up to the page grid ``quantum`` of a ``length``-token
    prompt, what it holds there); the others share the rest equally, the first ones in order one
    more where it does not divide, then move onto the grid with their sum kept
    (:func:`snap_to_pages`). All skip: every head keeps ``proximal``.

    The engine rounds every head up to the grid, so equal shares off it held up to a page more per
    head than the mean asks (issue #28: 54 requests admitted where page-exact policies admit 57)."""
    held = proximal if quantum is None else page_count(proximal, length, quantum)
    kept = len(skips) - sum(map(bool, skips))
    if not kept:
        return [proximal] * len(skips)
    each, rest = divmod(budget * len(skips) - held * (len(skips) - kept), kept)
    shares = iter(snap_to_pages([each + (1 if i < rest else 0) for i in range(kept)], quantum, length))
    return [held if skip else next(shares) for skip in skips]


def _group_size(kv: LayerKV) -> int:
    if kv.queries is None or kv.queries.shape[1] == 0:
        raise ValueError("pod needs observation-window queries, none were captured")
    return kv.queries.shape[0] // kv.num_kv_heads


def _scores_by_position(kv: LayerKV, scores: torch.Tensor) -> torch.Tensor:
    """Re-index [H_kv, N] slot scores by logical position: [H_kv, max_pos + 1], -inf elsewhere
    (on the host, where the selection runs)."""
    positions, scores = kv.slot_positions(), scores.cpu()
    out = torch.full((kv.num_kv_heads, int(positions.max()) + 1), float("-inf"), dtype=scores.dtype)
    valid = positions >= 0
    rows = torch.arange(kv.num_kv_heads).unsqueeze(1).expand_as(positions)
    out[rows[valid], positions[valid]] = scores[valid]
    return out
