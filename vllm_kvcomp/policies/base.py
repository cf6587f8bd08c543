"""The policy interface: policies decide *what each KV head keeps*; they never move memory.

Shapes (one request, one layer):
  keys, values  [H_kv, N, D]  as cached (post-RoPE). Head h holds valid tokens in the suffix
                              ``[N - lengths[h], N)`` (right-aligned, as the engine stores them).
  positions     [H_kv, N]     logical position of each slot (-1 where invalid); None = ``arange(N)``.
  queries       [H_q, w, D]   post-RoPE queries of the last w processed tokens, whose logical
                              positions are ``query_positions`` [w]; None when not captured.

A policy returns one :class:`Selection` per layer: per KV head the sorted, unique slot indices to
keep (counts may differ per head) and optional compensation entries (k̂, v̂, N_dropped).

GQA reduction rule: query-head statistics reduce to their KV head by the **mean over the query
group** (query head q belongs to KV head ``q // (H_q // H_kv)``), see :func:`reduce_gqa`.

Devices: keys, values, queries and the output projection are where the engine's cache is (a GPU
in production: policies score there); lengths, positions and per-request memory are on the host,
where the selection runs from [H_kv, N] scores (each layer's scores sorted once, where they are:
:class:`Ranking`). Masks over [.., w, N] are built where the logits are, from the positions.
``tests/policies/test_device.py`` (GPU) holds every policy to the same decision both ways.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any, ClassVar, NamedTuple, Protocol, TypeVar

import torch

from vllm_kvcomp.params import COMMON_PARAMS, Param, SpecError, kept_count


class Deferred:
    """A tensor of a known ``shape``, read (``read()``) each time it is wanted: what the engine
    gives a policy as a layer's keys and values, so a decision holds one layer's K+V at a time
    (the engine's reader keeps only the last layer it read; a policy that keeps a layer's tensor
    keeps that copy alive, nothing overwrites it)."""

    __slots__ = ("read", "shape")

    def __init__(self, read: Callable[[], torch.Tensor], shape: tuple[int, ...]):
        self.read, self.shape = read, tuple(shape)

    def narrow(self, tokens: int) -> Deferred:
        """Its first ``tokens`` slots (dim 1), still unread."""
        return Deferred(lambda: self.read()[:, :tokens], (self.shape[0], tokens, *self.shape[2:]))


class _Deferrable:
    """A :class:`LayerKV` tensor field that may be set to a :class:`Deferred` (read on access)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.slot = f"_{name}"

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if obj is None:
            return self
        value = obj.__dict__[self.slot]
        return value.read() if isinstance(value, Deferred) else value

    def __set__(self, obj: Any, value: Any) -> None:
        obj.__dict__[self.slot] = value


@dataclass
class LayerKV:
    """What a policy sees of one layer of one request. ``keys`` and ``values`` may be given as
    :class:`Deferred` (the engine does): read when a policy asks for them."""

    keys: torch.Tensor  # [H_kv, N, D]
    values: torch.Tensor | None  # [H_kv, N, D]; the engine gives None to a policy without ``READS_VALUES``
    layer: int = 0
    num_layers: int = 1
    lengths: torch.Tensor | None = None  # [H_kv] int64, valid suffix per head; None = all N
    positions: torch.Tensor | None = None  # [H_kv, N] int64 logical positions; None = arange(N)
    queries: torch.Tensor | None = None  # [H_q, w, D]
    query_positions: torch.Tensor | None = None  # [w] int64; None = the last w of arange(N)
    scale: float | None = None  # softmax scale; None = D ** -0.5
    #: [H_q, D, hidden] the layer's output projection W_o per query head (q's slice
    #: W_o[:, q*D:(q+1)*D] transposed; this rank's heads under tensor parallelism), given only
    #: to a policy with ``NEEDS_OUT_PROJ`` (see :func:`out_proj_heads`)
    out_proj: torch.Tensor | None = None
    #: [H_kv, N] float32, right-aligned like ``keys``: the attention each slot received from every
    #: query after the last compression through position ``observed_through`` (GQA: the mean over
    #: the query group of the sum over queries), as the engine's kernel attended them; given only
    #: to a policy with ``OBSERVES_ATTENTION`` at a decode recompression (the window's queries
    #: after ``observed_through``, if any, are the rest; None: the window's are all there is)
    observed: torch.Tensor | None = None
    observed_through: int = -1

    @property
    def key_shape(self) -> tuple[int, ...]:
        """``keys``' shape [H_kv, N, D], known without reading them."""
        return tuple(self.__dict__["_keys"].shape)

    @property
    def num_kv_heads(self) -> int:
        return self.key_shape[0]

    @property
    def num_slots(self) -> int:
        return self.key_shape[1]

    @property
    def softmax_scale(self) -> float:
        return self.scale if self.scale is not None else self.key_shape[-1] ** -0.5

    def valid_lengths(self) -> torch.Tensor:
        """[H_kv] int64 number of valid (right-aligned) slots per head."""
        if self.lengths is None:
            return torch.full((self.num_kv_heads,), self.num_slots, dtype=torch.long)
        return self.lengths.to(torch.long).cpu()

    def valid_mask(self) -> torch.Tensor:
        """[H_kv, N] bool, True where the slot holds a live token."""
        return live_mask(self.valid_lengths(), self.num_slots)

    def slot_positions(self) -> torch.Tensor:
        """[H_kv, N] int64 logical positions (-1 where invalid)."""
        if self.positions is not None:
            return self.positions.to(torch.long).cpu()
        pos = torch.arange(self.num_slots).expand(self.num_kv_heads, -1).clone()
        return pos.masked_fill(~self.valid_mask(), -1)

    def window_query_positions(self) -> torch.Tensor:
        """[w] int64 logical positions of ``queries``."""
        if self.query_positions is not None:
            return self.query_positions.to(torch.long).cpu()
        w = 0 if self.queries is None else self.queries.shape[1]
        last = int(self.slot_positions().max()) + 1
        return torch.arange(last - w, last)

    def context(self, tokens: int) -> LayerKV:
        """This layer as if the prompt were its first ``tokens`` tokens (``scope=context``): slots
        ``[0, tokens)`` and the window queries before position ``tokens``. Only the natural layout
        (every head holds every token, slot = position: a request's first compression)."""
        positions = self.slot_positions()
        if bool((self.valid_lengths() != self.num_slots).any()) or not torch.equal(
                positions, torch.arange(self.num_slots).expand_as(positions)):
            raise ValueError("scope=context compresses a cache that holds every token in order (its first compression)")
        tokens = min(tokens, self.num_slots)
        queries, query_positions = self.queries, self.query_positions
        if queries is not None:
            before = self.window_query_positions() < tokens
            queries, query_positions = queries[:, before], self.window_query_positions()[before]
        keys, values = self.__dict__["_keys"], self.__dict__["_values"]
        return replace(
            self, keys=_narrow(keys, tokens), values=None if values is None else _narrow(values, tokens),
            lengths=torch.full((self.num_kv_heads,), tokens, dtype=torch.long), positions=positions[:, :tokens],
            queries=queries, query_positions=query_positions,
        )


LayerKV.keys = _Deferrable()  # type: ignore[assignment]  # after @dataclass: its __init__ sets through them
LayerKV.values = _Deferrable()  # type: ignore[assignment]
LayerKV.keys.__set_name__(LayerKV, "keys")
LayerKV.values.__set_name__(LayerKV, "values")


def _narrow(tensor: torch.Tensor | Deferred, tokens: int) -> torch.Tensor | Deferred:
    return tensor.narrow(tokens) if isinstance(tensor, Deferred) else tensor[:, :tokens]


@dataclass
class Compensation:
    """RazorAttention's compensation token per KV head (eq. 4). ``counts[h] == 0`` turns it off."""

    keys: torch.Tensor  # [H_kv, D] mean of dropped keys
    values: torch.Tensor  # [H_kv, D] mean of dropped values
    counts: torch.Tensor  # [H_kv] float, N_dropped


class Ranking:
    """Scores [H, N] (higher = keep) and each row's slots in their order (:func:`ranked_slots`),
    sorted once, on first use: the pick and the page rounding after it read the same order."""

    def __init__(self, scores: torch.Tensor) -> None:
        self.scores = scores
        self._order: torch.Tensor | None = None

    @classmethod
    def of(cls, scores: torch.Tensor | Ranking) -> Ranking:
        return scores if isinstance(scores, Ranking) else cls(scores)

    @property
    def order(self) -> torch.Tensor:
        """[H, N] host int64: each row's slot indices, best first, equal scores the later slot first."""
        if self._order is None:
            self._order = ranked_slots(self.scores)
        return self._order

    @property
    def is_sorted(self) -> bool:
        return self._order is not None

    def take_order(self, order: torch.Tensor) -> None:
        """Use ``order`` [H, N]: these rows sorted elsewhere (as part of a stacked ranking)."""
        self._order = order


def _pads(widths: Sequence[int]) -> list[int]:
    """Left padding that right-aligns rows of these widths to the widest."""
    width = max(widths, default=0)
    return [width - w for w in widths]


def _stack_right(tensors: Sequence[torch.Tensor], pads: Sequence[int] | None, value: float) -> torch.Tensor:
    """[sum H, N] rows of every [H, N_l] tensor right-aligned (left-padded with ``value`` by
    ``pads``, by default to the widest), where the tensors are."""
    pads = _pads([t.shape[1] for t in tensors]) if pads is None else pads
    return torch.cat([torch.nn.functional.pad(t, (pad, 0), value=value) if pad else t for t, pad in zip(tensors, pads)])


class LayerRows:
    """Several layers' [H, N_l] rankings as one [L·H, N] :class:`Ranking` (N = the widest layer;
    each layer's rows right-aligned, -inf on its left padding) with their lengths [L·H]: one
    sort and one pass of masks for every layer instead of one per layer."""

    def __init__(self, rankings: Sequence[Ranking], lengths: Sequence[torch.Tensor],
                 stacked: Ranking | None = None) -> None:
        """``stacked``: the rankings already stacked right-aligned (theirs are views of its rows)."""
        self.rankings = list(rankings)
        self.heads = self.rankings[0].scores.shape[0] if self.rankings else 0
        self.pads = _pads([r.scores.shape[1] for r in self.rankings])
        if len(self.rankings) == 1:
            self.ranking = self.rankings[0]  # one layer: its own ranking, sorted at most once
        elif stacked is not None:
            self.ranking = stacked
        else:
            self.ranking = Ranking(_stack_right([r.scores.float() for r in self.rankings], self.pads, float("-inf")))
        self.lengths = torch.cat([n.to(torch.long).cpu().reshape(-1) for n in lengths])

    def per_row(self, per_layer: Sequence[int] | Sequence[Sequence[int]]) -> torch.Tensor:
        """[L·H] int64 from one value per layer (repeated over its heads) or one per head."""
        rows = [[int(v)] * self.heads if isinstance(v, int) else [int(x) for x in v] for v in per_layer]
        return torch.tensor([x for row in rows for x in row], dtype=torch.long)

    def layer_rows(self, mask: torch.Tensor) -> list[torch.Tensor]:
        """[L·H, N] -> per layer its [H, N_l] part (a view)."""
        h = self.heads
        return [mask[layer * h : (layer + 1) * h, pad:] for layer, pad in enumerate(self.pads)]

    def split(self, mask: torch.Tensor) -> list[list[torch.Tensor]]:
        """[L·H, N] host bool -> per layer, per head the ascending slots (in the layer's own
        slots) where it is True. The layers' rankings take their rows of the stacked order if it
        was sorted (the page rounding reads them next)."""
        if len(self.rankings) > 1 and self.ranking.is_sorted:
            order = self.ranking.order.split(self.heads)  # each layer's rows, in the padded slots
            for ranking, rows, pad in zip(self.rankings, order, self.pads):
                # the padding slots rank after every other one (-inf, and earlier than the layer's
                # own -inf slots): they are each row's last ``pad``, dropping them keeps the order
                ranking.take_order(rows[:, : rows.shape[1] - pad] - pad if pad else rows)
        rows = head_rows(mask, torch.tensor(self.pads, dtype=torch.long).repeat_interleave(self.heads))
        return [rows[layer * self.heads : (layer + 1) * self.heads] for layer in range(len(self.rankings))]


@dataclass
class Selection:
    """Per KV head, the sorted unique slot indices to keep, plus optional compensation.

    What a policy's :meth:`Policy.select` returns is its *pick*; :meth:`Policy.decide` rounds each
    head's count up to the engine's page grid with the head's next slots by ``priority`` and
    returns what is kept. Policies never round themselves.
    """

    indices: list[torch.Tensor]  # H_kv tensors of int64, sorted, unique, in [0, N)
    compensation: Compensation | None = None
    #: scores [H_kv, N] of which unpicked slots fill a head up to the page grid first (higher
    #: first, ties to the later slot; a tensor is taken as its :class:`Ranking`); None: the most
    #: recent first
    priority: Ranking | None = None

    def __post_init__(self) -> None:
        if isinstance(self.priority, torch.Tensor):
            self.priority = Ranking(self.priority)

    def counts(self) -> torch.Tensor:
        return torch.tensor([len(i) for i in self.indices], dtype=torch.long)

    def cpu(self) -> Selection:
        """This selection on the host (the engine plans its moves there): indices and compensation."""
        comp = self.compensation
        if comp is not None:
            comp = Compensation(comp.keys.cpu(), comp.values.cpu(), comp.counts.cpu())
        return Selection([idx.cpu() for idx in self.indices], comp, self.priority)

    @classmethod
    def keep_valid(cls, kv: LayerKV) -> Selection:
        """Keep every live token (the no-op selection)."""
        return cls(head_rows(kv.valid_mask()))


class Ranks:
    """The tensor-parallel ranks a request's KV heads are split over; a policy that ranks or
    averages across heads (adaptive budgets, entropy, a global head index) asks them, so every
    rank decides what one rank holding all heads decides. This base is one rank: identity."""

    size: int = 1
    rank: int = 0

    def gather(self, value: Any) -> list[Any]:
        """Every rank's ``value`` (any picklable object), in rank order."""
        return [value]

    def reduce(self, value: float, op: Callable[[Sequence[float]], float]) -> float:
        """``op`` (sum, max, min) over every rank's ``value``."""
        return op(self.gather(value))

    def sum_tensor(self, value: torch.Tensor) -> torch.Tensor:
        """Every rank's ``value`` (same shape) summed, on ``value``'s device; one rank: ``value``
        itself (no copy, no trip to the host)."""
        if self.size == 1:
            return value
        return sum(self.gather(value.cpu())).to(value.device)

    def cat_heads(self, per_head: torch.Tensor) -> torch.Tensor:
        """Every rank's [H_local, ...] rows concatenated: [H_total, ...] (same trailing shape)."""
        return torch.cat(self.gather(per_head))


ONE_RANK = Ranks()


MemoryT = TypeVar("MemoryT")


@dataclass
class RequestState:
    """Per-request memory a policy carries between compressions (one per request, all layers).

    ``budget`` is the per-head kept count fixed at the first compression; decode-time
    recompression returns to it. ``allotted`` is the most any head was given at the last
    compression (a head of an adaptive allocation may hold several times ``budget``), the mark a
    recompression waits a page past. ``layers[i]`` is the policy's own typed memory of layer i (one
    dataclass per policy, :meth:`layer`: H2O accumulators, LagKV cursors), indexed by the *slots
    kept*: a policy that stores per-slot values gathers them with what :meth:`Policy.decide` kept
    (one that marks a subset, as pins, remembers kept slots only: :func:`kept_pins`).
    """

    prompt_len: int = 0
    budget: int | None = None
    allotted: int | None = None
    compressions: int = 0
    layers: dict[int, Any] = field(default_factory=dict)
    #: per layer, memory of what depends on each token alone, not on any decision (criticalkv's
    #: projected value norms): a :meth:`restart` keeps it (:meth:`token_memory`)
    tokens: dict[int, Any] = field(default_factory=dict)
    #: (block_size, residue) of the engine's pages for the compression in progress, or None (no
    #: grid): :meth:`Policy.decide` rounds every head's kept count to ``≡ residue (mod
    #: block_size)`` (or the whole head)
    page_quantum: tuple[int, int] | None = None
    #: the tensor-parallel ranks the request's heads are split over (set by the engine)
    ranks: Ranks = field(default=ONE_RANK, repr=False)

    def layer(self, index: int, kind: type[MemoryT]) -> MemoryT:
        """Layer ``index``'s memory, a ``kind()`` the first time (one kind per policy)."""
        return _memory(self.layers, index, kind)

    def token_memory(self, index: int, kind: type[MemoryT]) -> MemoryT:
        """Layer ``index``'s memory of per-token values (:attr:`tokens`), as :meth:`layer`."""
        return _memory(self.tokens, index, kind)

    def memories(self, kind: type[MemoryT]) -> list[MemoryT]:
        """Every layer's memory of ``kind`` so far."""
        return [m for m in self.layers.values() if isinstance(m, kind)]

    @property
    def page_size(self) -> int:
        """Tokens per engine page (1 without a page grid): the least a compaction can free."""
        return self.page_quantum[0] if self.page_quantum is not None else 1

    def restart(self) -> None:
        """Forget every compression so far (``prefill=block``: each compression of the prompt
        decides as the prompt-end one does); the prompt length, the ranks and the per-token
        memory (:attr:`tokens`) stay."""
        self.budget = self.allotted = None
        self.compressions = 0
        self.layers.clear()

    def over_budget(self, num_tokens: int) -> bool:
        """Whether cutting the longest head's ``num_tokens`` live tokens back frees something: on
        the engine's page grid (rounded up to it) only once it is a whole page over ``budget``
        and over what it was ``allotted`` (every head grows alike, so before that an adaptive
        allocation would only move slots between heads, freeing less than a page a head)."""
        if self.budget is None:
            return False
        return num_tokens - max(self.budget, self.allotted or 0) >= self.page_size


def _memory(store: dict[int, Any], index: int, kind: type[MemoryT]) -> MemoryT:
    memory = store.setdefault(index, kind())
    if not isinstance(memory, kind):
        raise TypeError(f"layer {index} holds {type(memory).__name__}, not {kind.__name__}")
    return memory


def budget_basis(layers: Sequence[LayerKV], state: RequestState) -> int:
    """Tokens per head a first compression sizes its budgets from: the longest live head, or the
    whole prompt (``state.prompt_len``) when longer (``prefill=block`` compresses each chunk to
    the whole prompt's budget; at the prompt's end the two are equal)."""
    return max([state.prompt_len, *(int(kv.valid_lengths().max()) for kv in layers if kv.num_kv_heads)])


def page_count(kept: int, length: int, quantum: tuple[int, int] | None) -> int:
    """``kept`` rounded up to the page grid ``quantum`` = (block_size, residue), at most ``length``."""
    if quantum is None or kept >= length:
        return min(kept, length)
    block_size, residue = quantum
    return min(length, kept + (residue - kept) % block_size)


def snap_to_pages(budgets: Sequence[int], quantum: tuple[int, int] | None,
                  length: int | Sequence[int]) -> list[int]:
    """Per-layer (or per-head) budgets moved onto the page grid ``quantum`` (block_size, residue), their sum
    kept: each floors to the grid, then the layers with the largest remainders (ties to the lower
    layer) get their page back until the sum reaches the original (it then exceeds it by less than
    one page). Every budget stays within one page of its own; those >= ``length`` (everything
    kept; one length for all or one each) or whose floor would be empty stay as they are.
    Without a grid: unchanged.

    The engine rounds each head's kept count up to the grid anyway (:func:`round_to_pages`), so
    budgets off the grid would hold up to a page more per layer than their mean asks."""
    if quantum is None:
        return [int(b) for b in budgets]
    block_size, residue = quantum
    lengths = [int(length)] * len(budgets) if isinstance(length, int) else [int(n) for n in length]
    out, spare = [], []
    for b, n in zip((int(b) for b in budgets), lengths):
        floor = b - (b - residue) % block_size
        fixed = b >= n or floor < 1
        out.append(b if fixed else floor)
        spare.append(0 if fixed else b - floor)
    missing = sum(int(b) for b in budgets) - sum(out)
    for layer in sorted(range(len(out)), key=lambda i: (-spare[i], i)):
        if missing <= 0 or spare[layer] == 0:
            break
        out[layer] += block_size
        missing -= block_size
    return out


def round_to_pages(pick: Selection, kv: LayerKV, quantum: tuple[int, int] | None) -> Selection:
    """``pick`` of layer ``kv`` with each head's slots rounded up to the page grid ``quantum`` by
    its next-best live slots (``pick.priority``; the most recent where None). Free quality: the
    page is held anyway. The same object when nothing needs adding; a head that needs nothing
    keeps its own tensor."""
    return round_to_pages_layers([pick], [kv], quantum)[0]


def round_to_pages_layers(picks: Sequence[Selection], layers: Sequence[LayerKV],
                          quantum: tuple[int, int] | None) -> list[Selection]:
    """:func:`round_to_pages` of several layers in one pass (the rows of the layers that need
    rounding stacked right-aligned; padding is never free and ranks last)."""
    if quantum is None or not picks:
        return list(picks)  # no grid: every pick is already whole (it holds live slots only)
    counts = [pick.counts() for pick in picks]
    extra = page_counts(torch.cat(counts), torch.cat([kv.valid_lengths() for kv in layers]), quantum) - torch.cat(counts)
    extras = list(extra.split([len(c) for c in counts]))
    rounded = [i for i, e in enumerate(extras) if bool((e > 0).any())]
    if not rounded:
        return list(picks)
    pads = _pads([layers[i].num_slots for i in rounded])
    width = layers[rounded[0]].num_slots + pads[0]
    taken = slot_mask([idx.to(torch.long).cpu() + pad for i, pad in zip(rounded, pads) for idx in picks[i].indices],
                      width)  # [rows, N]
    free = _stack_right([layers[i].valid_mask() for i in rounded], pads, False) & ~taken
    order = torch.cat([_order_right(picks[i], layers[i], pad) for i, pad in zip(rounded, pads)])
    quota = torch.cat([extras[i] for i in rounded]).clamp(min=0)
    mask = taken | first_in_order(order, free, quota)
    row_pad = torch.tensor(pads, dtype=torch.long).repeat_interleave(torch.tensor([len(counts[i]) for i in rounded]))
    rows = iter(head_rows(mask, row_pad))
    out = list(picks)
    for i in rounded:
        heads = [next(rows) for _ in extras[i]]
        out[i] = Selection([heads[h] if extras[i][h] > 0 else idx for h, idx in enumerate(picks[i].indices)],
                           picks[i].compensation, picks[i].priority)
    return out


def page_counts(kept: torch.Tensor, lengths: torch.Tensor, quantum: tuple[int, int]) -> torch.Tensor:
    """:func:`page_count` of every head at once: ``kept`` and ``lengths`` [H] int64."""
    block_size, residue = quantum
    lengths = lengths.to(torch.long)
    rounded = torch.minimum(lengths, kept + torch.remainder(residue - kept, block_size))
    return torch.where(kept >= lengths, torch.minimum(kept, lengths), rounded)


def _order_right(pick: Selection, kv: LayerKV, pad: int) -> torch.Tensor:
    """[H, pad + N] ``pick``'s slot order (its priority's; the most recent first without one)
    shifted right by ``pad`` columns, the padding slots last."""
    n = kv.num_slots
    order = (pick.priority.order if pick.priority is not None
             else torch.arange(n - 1, -1, -1).expand(kv.num_kv_heads, n))
    if not pad:
        return order
    return torch.cat([order + pad, torch.arange(pad).expand(order.shape[0], pad)], dim=1)


def live_mask(lengths: torch.Tensor, num_slots: int) -> torch.Tensor:
    """[H, N] host bool, True on each head's ``lengths[h]`` live (right-aligned) slots."""
    return torch.arange(num_slots).unsqueeze(0) >= (num_slots - lengths.to(torch.long).cpu()).unsqueeze(1)


def slot_mask(indices: Sequence[torch.Tensor], num_slots: int) -> torch.Tensor:
    """[H, N] host bool, True at each head's ``indices`` (H tensors of slots in [0, N))."""
    mask = torch.zeros(len(indices), num_slots, dtype=torch.bool)
    if indices:
        counts = torch.tensor([len(idx) for idx in indices], dtype=torch.long)
        rows = torch.repeat_interleave(torch.arange(len(indices)), counts)
        mask[rows, torch.cat([idx.to(torch.long).cpu() for idx in indices])] = True
    return mask


def head_rows(mask: torch.Tensor, row_pad: torch.Tensor | None = None) -> list[torch.Tensor]:
    """[H, N] bool -> H ascending int64 tensors of each row's True slots (one ``nonzero`` for all);
    ``row_pad`` [H]: each row's left padding (stacked layers), taken off its slots."""
    hit = torch.nonzero(mask)
    slots = hit[:, 1] if row_pad is None else hit[:, 1] - row_pad[hit[:, 0]]
    return list(torch.split(slots.contiguous(), mask.sum(dim=1).tolist()))


def first_in_order(order: torch.Tensor, allowed: torch.Tensor, quota: torch.Tensor) -> torch.Tensor:
    """[H, N] bool: per row h, the first ``quota[h]`` slots of ``order[h]`` (slot indices, best
    first) where ``allowed`` [H, N] is True (fewer where fewer are allowed)."""
    candidate = allowed.gather(1, order)
    take = candidate & (candidate.cumsum(dim=1, dtype=torch.int32) <= quota.to(torch.int32).unsqueeze(1))
    return torch.zeros_like(allowed).scatter_(1, order, take)


# ---------------------------------------------------------------------------- shared helpers


def reduce_gqa(per_query_head: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """[H_q, ...] -> [H_kv, ...] by the mean over each KV head's query group."""
    hq = per_query_head.shape[0]
    if hq % num_kv_heads:
        raise ValueError(f"{hq} query heads do not divide into {num_kv_heads} KV heads")
    return per_query_head.reshape(num_kv_heads, hq // num_kv_heads, *per_query_head.shape[1:]).mean(1)


def window_logits(kv: LayerKV) -> torch.Tensor:
    """[H_q, w, N] scaled logits of the window queries; -inf on invalid or future (causal) slots.

    Computed in float32 (float64 for float64 inputs).
    """
    if kv.queries is None:
        raise ValueError("this policy needs observation-window queries, none were captured")
    hq, w, d = kv.queries.shape
    hk = kv.num_kv_heads
    acc = torch.float64 if kv.keys.dtype == torch.float64 else torch.float32
    # query head i reads KV head i // group; scaled before the product (w·D values, not w·N)
    queries = (kv.queries.to(acc) * kv.softmax_scale).reshape(hk, hq // hk * w, d)
    logits = torch.matmul(queries, kv.keys.to(acc).transpose(1, 2)).view(hk, hq // hk, w, -1)  # [H_kv, G, w, N]
    # only the columns some query does not see are masked (the padding and the newest slots: a
    # few of N); they are found on the host, where the positions are, and only they travel
    key_pos, q_pos = kv.slot_positions(), kv.window_query_positions()  # [H_kv, N], [w]
    columns = torch.nonzero(((key_pos < 0) | (key_pos > q_pos.min())).any(0)).squeeze(1)  # [c]
    if columns.numel():
        key_pos = key_pos[:, columns].to(logits.device).view(hk, 1, 1, -1)  # [H_kv, 1, 1, c]
        q_pos = q_pos.to(logits.device).view(1, 1, -1, 1)  # [1, 1, w, 1]
        at = columns.to(logits.device)
        hidden = logits.index_select(3, at).masked_fill_((key_pos < 0) | (key_pos > q_pos), float("-inf"))
        logits.index_copy_(3, at, hidden)
    return logits.view(hq, w, -1)


def window_attention(kv: LayerKV) -> torch.Tensor:
    """Softmax attention of the window queries over each head's live keys.

    Returns [H_q, w, N] probabilities, zero on invalid or future (causal) slots.
    """
    return visible_softmax(window_logits(kv))


#: window queries attended at once where a policy wants only sums over them: one layer's
#: attention then takes ``H_q × WINDOW_ROWS × N`` float32 whatever the window (``engine/memory.py``)
WINDOW_ROWS = 32  # the policies' default windows (32) stay one run


def window_chunks(kv: LayerKV) -> list[LayerKV]:
    """``kv`` with its window queries cut into runs of at most :data:`WINDOW_ROWS` (itself when
    they fit one)."""
    if kv.queries is None or kv.queries.shape[1] <= WINDOW_ROWS:
        return [kv]
    positions = kv.window_query_positions()
    return [replace(kv, queries=kv.queries[:, i : i + WINDOW_ROWS], query_positions=positions[i : i + WINDOW_ROWS])
            for i in range(0, kv.queries.shape[1], WINDOW_ROWS)]


def window_attention_mass(kv: LayerKV) -> torch.Tensor:
    """[H_q, N] :func:`window_attention` summed over the window queries, :data:`WINDOW_ROWS` of
    them at a time."""
    total = None
    for part in window_chunks(kv):
        mass = window_attention(part).sum(dim=1)
        total = mass if total is None else total.add_(mass)
    return total


def visible_softmax(logits: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim of logits with -inf on hidden slots; a row with no visible
    slot is all zeros (not NaN)."""
    return torch.softmax(logits, dim=-1).nan_to_num_(0.0)


def ranked_slots(scores: torch.Tensor) -> torch.Tensor:
    """[H, N] each row's slot indices by descending score, equal scores the later slot first: one
    stable sort of every row where the scores are, the order brought to the host (a subset of a
    row keeps this order, so a head's candidates are its row filtered). Scores that are one row
    expanded over the heads (a layer-shared ranking) are sorted once."""
    n = scores.shape[-1]
    if scores.shape[0] > 1 and scores.stride(0) == 0:
        return ranked_slots(scores[:1]).expand(scores.shape[0], n)
    return n - 1 - torch.sort(scores.float().flip(-1), dim=-1, descending=True, stable=True).indices.cpu()


def protected_topk(
    scores: torch.Tensor | Ranking,
    keep: int | Sequence[int],
    lengths: torch.Tensor,
    sink: int = 0,
    window: int = 0,
) -> list[torch.Tensor]:
    """Per head: first ``sink`` and last ``window`` live slots, plus the best-scored rest.

    scores [H, N] (higher = keep), lengths [H] live right-aligned slots, keep per head (int or
    list). Ties break towards the *later* slot. Returns H sorted index tensors of size
    ``min(keep, length)``.
    """
    return head_rows(protected_mask(scores, keep, lengths, sink, window))


def protected_topk_layers(
    rankings: Sequence[Ranking], budgets: Sequence[int] | Sequence[Sequence[int]], lengths: Sequence[torch.Tensor],
    protected: Sequence[tuple[int, int]], *, quantum: tuple[int, int] | None = None,
) -> list[list[torch.Tensor]]:
    """:func:`protected_topk` of several layers in one pass (an :class:`Allocator`; ``quantum``
    unused: the page rounding comes after)."""
    if not rankings:
        return []
    rows = LayerRows(rankings, lengths)
    sinks, windows = rows.per_row([s for s, _ in protected]), rows.per_row([w for _, w in protected])
    return rows.split(protected_mask(rows.ranking, rows.per_row(budgets), rows.lengths, sinks, windows))


def protected_mask(
    scores: torch.Tensor | Ranking,
    keep: int | Sequence[int] | torch.Tensor,
    lengths: torch.Tensor,
    sink: int | torch.Tensor = 0,
    window: int | torch.Tensor = 0,
) -> torch.Tensor:
    """:func:`protected_topk` as a [H, N] host bool mask, every head at once (the scores are
    ranked only when some head picks beyond its sink and window); ``keep``, ``sink`` and
    ``window`` one for every head or one per head."""
    ranking = Ranking.of(scores)
    num_heads, n = ranking.scores.shape
    lengths = lengths.to(torch.long).cpu()
    if isinstance(keep, int):
        keeps = torch.full((num_heads,), keep, dtype=torch.long)
    else:
        keeps = keep.to(torch.long).cpu() if isinstance(keep, torch.Tensor) else torch.tensor([int(k) for k in keep])
    k = torch.minimum(keeps.clamp(min=0), lengths)
    start = n - lengths
    s = torch.minimum(k, torch.as_tensor(sink))
    w = torch.minimum(k - s, torch.as_tensor(window))
    whole = k >= lengths
    rest = torch.where(whole, 0, k - s - w)
    slots = torch.arange(n).unsqueeze(0)
    live = live_mask(lengths, n)
    protected = (slots < (start + s).unsqueeze(1)) | (slots >= (n - w).unsqueeze(1)) | whole.unsqueeze(1)
    mask = live & protected
    if bool((rest > 0).any()):
        mask |= first_in_order(ranking.order, live & ~protected, rest)
    return mask


# ---------------------------------------------------------------------------- policy base

PREFILL_PARAM = Param(
    "prefill", str, "end", choices=("end", "stream", "block"),
    help="end: compress the prompt once, at its end; stream: after every prefill chunk, keeping what compressing "
    "at the end keeps (the policies that can: docs/policies.md); block: after every prefill chunk, the cache as "
    "it stands as if the prompt ended there, scored with the chunk's own last queries, to the whole prompt's "
    "budget (kvpress BlockPress; KeyDiff's block-wise prefill). stream and block hold the budget plus one chunk",
)
SCOPE_PARAM = Param(
    "scope", str, "all", choices=("all", "context"),
    help="all: the whole prompt is compressed (and, for policies that recompress, the generated tokens); "
    "context: only the prompt's context (its first context_tokens tokens), once at the prompt's end and scored "
    "with the context's own queries; the question after it and the generated tokens are kept",
)
CONTEXT_PARAM = Param(
    "context_tokens", int, None, 1, 1 << 24,
    help="scope=context: how many leading prompt tokens are the context (chat routes: the server counts "
    "everything before the last user message; default: the whole prompt)",
)
DECODE_PARAM = Param(
    "decode", str, None, choices=("keep", "recompress"),
    help="the generated tokens: keep them all, or recompress back to the prompt's budget whenever a page is over it "
    "(bounded memory for long outputs); default: the method's own (recompress where it says so)",
)
#: spec settings every policy accepts, besides its own
BASE_PARAMS: dict[str, Param] = {p.name: p for p in (PREFILL_PARAM, SCOPE_PARAM, CONTEXT_PARAM, DECODE_PARAM)}


@dataclass
class Policy:
    """Base of every method. Subclasses are dataclasses whose fields are their tunables.

    Field names that match :data:`COMMON_PARAMS` (ratio, budget, sink, window, lag, interval)
    take their type and range from there; other fields must be declared in ``PARAMS``.
    """

    name: ClassVar[str] = ""
    #: What each KV head keeps, in a few words (the overview table of docs/policies.md).
    KEEPS: ClassVar[str] = ""
    #: The method's paper, short (``–`` for none; the same table).
    PAPER: ClassVar[str] = "–"
    PARAMS: ClassVar[dict[str, Param]] = {}
    #: Defaults that ``None`` stands for, in words (the same table), e.g. ``{"sink": "B/4"}``;
    #: a subclass adds its own to these. No ``interval``: recompress whenever a page is over the
    #: budget (the server fills its ``bounds.min_interval``).
    IMPLICIT_DEFAULTS: ClassVar[Mapping[str, str]] = {"interval": "a page"}
    #: Spec settings small enough that a prompt of tens of tokens and a few decode steps reach
    #: every code path (compression, recompression); the shared tests run the policy with them
    #: (tests/policies/test_matrix.py, the engine's oracle equality).
    TEST_PARAMS: ClassVar[Mapping[str, Any]] = {}
    #: Named non-default settings that benchmarks and the shared tests run next to the defaults
    #: (label suffix -> spec settings), e.g. ``{"adaptive": {"heads": "adaptive"}}``.
    VARIANTS: ClassVar[Mapping[str, Mapping[str, Any]]] = {}
    #: True if the method recompresses during decode at ``interval`` (``decode`` unset).
    RECOMPRESSES: ClassVar[bool] = False
    #: False if a second compression of the same request would not keep what the method keeps
    #: (``decode=recompress`` is then refused).
    CAN_RECOMPRESS: ClassVar[bool] = True
    #: False if the policy's decode recompressions are paced by a setting of its own, not
    #: ``interval`` (lagkv: every ``lag`` steps); a policy that cannot recompress has no ``interval``.
    PACED_BY_INTERVAL: ClassVar[bool] = True
    #: Name of a calibration profile kind the policy needs ("razor", "pod") or None.
    PROFILE: ClassVar[str | None] = None
    #: True if compressing after every prefill chunk keeps what compressing the whole prompt at
    #: its end keeps, from the cache it is given (``prefill=stream`` is then allowed): the policy
    #: needs no queries of the final prompt and its budget depends on the prompt length only.
    STREAMS: ClassVar[bool] = False
    #: True if the policy reads each layer's output projection (``LayerKV.out_proj``); the engine
    #: and the oracle fill it only then, and serve the policy uncompressed on a model without one.
    NEEDS_OUT_PROJ: ClassVar[bool] = False
    #: False if the policy never reads ``LayerKV.values``: the engine then reads no values back
    #: for its compressions (``values`` None; a decode recompression reads half the bytes).
    READS_VALUES: ClassVar[bool] = True
    #: True if a decode recompression given ``LayerKV.observed`` (the attention the decode queries
    #: paid each slot, summed by the engine's kernel as it attended them) reads neither keys nor
    #: window queries: the engine then reads nothing back for it (H2O).
    OBSERVES_ATTENTION: ClassVar[bool] = False

    prefill: str = field(default="end", kw_only=True)
    scope: str = field(default="all", kw_only=True)
    context_tokens: int | None = field(default=None, kw_only=True)
    decode: str | None = field(default=None, kw_only=True)
    #: fewest decode steps between two recompressions; None (the default of a method that does not
    #: recompress by itself): whenever a page is over the budget (``decode=recompress``)
    interval: int | None = field(default=None, kw_only=True)

    @classmethod
    def accepted_params(cls) -> dict[str, Param]:
        """Keys a spec may set for this policy, with their validators."""
        out: dict[str, Param] = {}
        paced = cls.CAN_RECOMPRESS and cls.PACED_BY_INTERVAL
        for f in sorted(fields(cls), key=lambda f: f.name == "interval"):  # after the method's own keys
            if f.name == "interval" and not paced:
                continue
            if f.name in COMMON_PARAMS:
                out[f.name] = COMMON_PARAMS[f.name]
            elif f.name in BASE_PARAMS:
                out[f.name] = BASE_PARAMS[f.name]
            elif f.name in cls.PARAMS:
                out[f.name] = cls.PARAMS[f.name]
        return out

    @classmethod
    def from_settings(cls, settings: Mapping[str, Any]) -> Policy:
        """Instantiate with validated settings (a spec's :meth:`~CompressionSpec.settings`)
        over the defaults; raises SpecError on bad combinations."""
        kwargs = dict(settings)
        if "budget" in kwargs and "ratio" in {f.name for f in fields(cls)}:
            kwargs["ratio"] = None
        unknown = set(kwargs) - set(cls.accepted_params())
        if unknown:
            key = sorted(unknown)[0]
            raise SpecError(key, f"unknown key for policy {cls.name!r}", ", ".join(cls.accepted_params()))
        policy = cls(**kwargs)
        policy.check()
        if cls.name == "full" and policy.compresses_in_prefill:
            raise SpecError("prefill", "policy 'full' keeps every token", "end")
        if policy.prefill == "stream" and not cls.STREAMS:
            from vllm_kvcomp.policies.registry import streaming_policy_names

            raise SpecError(
                "prefill", f"policy {cls.name!r} cannot compress during prefill keeping what it keeps at the "
                "prompt's end: it scores tokens with the final prompt's queries, which an earlier chunk does not "
                f"have (stream is for {', '.join(streaming_policy_names())}); block compresses every chunk scored "
                "with its own queries, in the same memory", "end, block",
            )
        if policy.prefill == "block" and cls.STREAMS:
            raise SpecError("prefill", f"policy {cls.name!r} compresses during prefill keeping what it keeps at the "
                            "prompt's end: use stream (the same memory)", "end, stream")
        if policy.scope == "context" and policy.compresses_in_prefill:
            raise SpecError("prefill", "scope=context compresses the context once, at the prompt's end", "end")
        if policy.context_tokens is not None and policy.scope != "context":
            raise SpecError("context_tokens", "says where the context ends, which only scope=context reads",
                            "scope=context with context_tokens, or neither")
        if policy.decode == "recompress":
            if policy.scope == "context":
                raise SpecError("decode", "scope=context keeps every token after the context", "keep")
            if not cls.CAN_RECOMPRESS:
                from vllm_kvcomp.policies.registry import recompressing_policy_names

                raise SpecError("decode", f"policy {cls.name!r} cannot recompress during decode",
                                "keep; or recompress with " + ", ".join(recompressing_policy_names()))
        return policy

    def check(self) -> None:
        """Cross-field validation; raise SpecError naming the field."""

    # -- what the engine asks
    @property
    def compresses_in_prefill(self) -> bool:
        """Whether the prompt is compressed after its prefill chunks too (``prefill=stream`` or
        ``block``), not only at its end: the request then holds its budget plus one chunk."""
        return self.prefill != "end"

    def start_prefill_compression(self, state: RequestState) -> None:
        """Called before every compression of the prompt (after a chunk, and at its end): with
        ``prefill=block`` the state starts afresh, so that each decides as the prompt-end
        compression does over the cache as it stands (budgets sized from the whole prompt,
        :func:`budget_basis`)."""
        if self.prefill == "block":
            state.restart()

    def context_end(self, prompt_len: int) -> int:
        """Leading tokens of a ``prompt_len`` prompt that are compressed: all of them, or with
        ``scope=context`` the first ``context_tokens`` (the whole prompt when not given)."""
        if self.scope != "context" or self.context_tokens is None:
            return prompt_len
        return min(prompt_len, int(self.context_tokens))

    @property
    def recompresses(self) -> bool:
        """Whether the engine asks :meth:`due` during decode: ``decode=recompress`` (unset: the
        method's ``RECOMPRESSES``) and ``scope=all`` (``scope=context`` compresses the context
        once and keeps every token after it)."""
        wanted = self.RECOMPRESSES if self.decode is None else self.decode == "recompress"
        return wanted and self.scope == "all"

    def queries_needed(self) -> int:
        """How many trailing queries per layer the policy reads (0 = attention-free)."""
        return 0

    def reads_cache(self, state: RequestState) -> bool:
        """Whether the next :meth:`decide` with ``state`` reads the cache's keys (and values, with
        ``READS_VALUES``). False when it needs only lengths and positions (a window sliding past
        pinned tokens): the engine then reads nothing back and its ``LayerKV.keys`` are NaN."""
        return True

    def budgets_on_pages(self) -> bool:
        """Whether the policy gives layers or heads budgets of their own and moves those onto the
        engine's page grid with their sum kept (:func:`snap_to_pages`): one may then keep fewer
        slots than without the grid, all together less than one page more per group (layer,
        head or request) instead of up to a page more per head and layer."""
        return False

    def mean_kept_bound(self, prompt_len: int, num_heads: int | None = None) -> int | None:
        """Most tokens per (layer, head), on average over them, the prompt-end compression keeps
        before page rounding, for ``num_heads`` (layer, KV head) pairs on one rank (None: not
        known, e.g. under tensor parallelism). The engine reserves that many pages for the
        compaction up front, so every compressing policy gives one; None (the engine then plans
        for the whole prompt) only where it truly cannot be told."""
        return None

    def held_bound(self, prompt_len: int, num_heads: int | None = None) -> int | None:
        """:meth:`mean_kept_bound` of the compressed part of the prompt plus the tokens after it
        (``scope=context``: the question is kept), what the prompt-end compaction holds."""
        context = self.context_end(prompt_len)
        bound = self.mean_kept_bound(context, num_heads)
        return None if bound is None else bound + prompt_len - context

    def kept_for(self, n_tokens: int) -> int:
        """Per-head kept count for ``n_tokens`` live tokens (ratio or budget of this policy)."""
        return kept_count(n_tokens, getattr(self, "ratio", None), getattr(self, "budget", None))

    def target_budget(self, n_tokens: int) -> int:
        """Per-head count fixed at the first compression (``RequestState.budget``).

        ``budget`` when given, even above ``n_tokens`` (a short prompt must not shrink the decode
        cache below the requested size); otherwise :meth:`kept_for` of the prompt.
        """
        budget = getattr(self, "budget", None)
        return int(budget) if budget is not None else self.kept_for(n_tokens)

    def prefill_budget(self, prompt_len: int) -> int:
        """``RequestState.budget`` of a request that compresses during prefill (set before the
        first chunk's compression, from the whole prompt's length)."""
        return self.target_budget(prompt_len)

    def stream_due(self, state: RequestState, num_tokens: int) -> bool:
        """Whether to compress after a prefill chunk, ``num_tokens`` live tokens in the largest head."""
        return state.over_budget(num_tokens)

    def streaming_bound(self, prompt_len: int) -> int | None:
        """Most tokens a head holds after compressing a ``prompt_len`` prompt chunk by chunk (the
        scheduler admits by it), or None when it cannot be told from the spec alone; with
        ``prefill=block`` on average over the heads (the pages are shared), as at the prompt's end."""
        if self.prefill == "block":
            return self.mean_kept_bound(prompt_len)
        return self.prefill_budget(prompt_len)

    def due(self, state: RequestState, num_tokens: int, steps_since: int) -> bool:
        """Whether to recompress now, during decode (only asked if :attr:`recompresses`): every
        ``interval`` steps (a policy without one: every step) once the longest head is a page
        over the budget and over its allotment (:meth:`RequestState.over_budget`)."""
        return steps_since >= (self.interval or 1) and state.over_budget(num_tokens)

    def decide(self, layers: Sequence[LayerKV], state: RequestState) -> list[Selection]:
        """What every layer keeps: :meth:`select`'s picks rounded up to the engine's page grid
        (``state.page_quantum``, :func:`round_to_pages`), then :meth:`commit_kept`. What the
        engine and the oracle call; policies implement :meth:`select` and never round."""
        if self.scope == "context":
            return self._decide_context(layers, state)
        return self._decide_all(layers, state)

    def _decide_all(self, layers: Sequence[LayerKV], state: RequestState) -> list[Selection]:
        picks = self.select(layers, state)
        most = max((len(idx) for pick in picks for idx in pick.indices), default=0)
        state.allotted = int(state.ranks.reduce(most, max))  # over every rank's heads
        kept = round_to_pages_layers(picks, layers, state.page_quantum)
        self.commit_kept(layers, state, picks, kept)
        return kept

    def _decide_context(self, layers: Sequence[LayerKV], state: RequestState) -> list[Selection]:
        """``scope=context``: decide over each layer's first C = ``state.prompt_len`` slots (the
        context, seen with its own queries only: :meth:`LayerKV.context`) and keep every slot
        after them; the page grid applies to the whole head, the tail included."""
        views = [kv.context(state.prompt_len) for kv in layers]
        quantum = state.page_quantum
        if quantum is not None and layers:
            tail = layers[0].num_slots - views[0].num_slots
            state.page_quantum = (quantum[0], (quantum[1] - tail) % quantum[0])
        try:
            kept = self._decide_all(views, state)
        finally:
            state.page_quantum = quantum
        return [Selection([torch.cat([idx.to(torch.long), torch.arange(view.num_slots, kv.num_slots)])
                           for idx in sel.indices], sel.compensation)
                for sel, view, kv in zip(kept, views, layers)]

    def select(self, layers: Sequence[LayerKV], state: RequestState) -> list[Selection]:
        """One pick per layer (not rounded to pages). Default: :meth:`select_layer` on each layer."""
        return [self.select_layer(kv, state) for kv in layers]

    def select_layer(self, kv: LayerKV, state: RequestState) -> Selection:
        raise NotImplementedError

    def commit_kept(self, layers: Sequence[LayerKV], state: RequestState, picks: Sequence[Selection],
                    kept: Sequence[Selection]) -> None:
        """Carry per-slot memory over to what is kept (``kept``: the ``picks`` rounded to pages; a
        policy may still set a kept selection's ``compensation``). Default: nothing to carry."""


class Allocator(Protocol):
    """Kept slots of several layers at once: per layer its [H, N_l] ranking, budget, lengths [H]
    and (sink, window), and the engine's page grid ``quantum`` (or None). Returns per layer H
    sorted index tensors (:func:`protected_topk_layers`, ``wrappers.adaptive_topk_layers``)."""

    def __call__(self, rankings: Sequence[Ranking], budgets: Sequence[int], lengths: Sequence[torch.Tensor],
                 protected: Sequence[tuple[int, int]], *,
                 quantum: tuple[int, int] | None = None) -> list[list[torch.Tensor]]: ...


@dataclass
class ScorePolicy(Policy):
    """A policy defined by a per-token score: keep sink + window + top scores, same count per head.

    ``select`` = per layer :meth:`protected_for` and :meth:`score`, then one :meth:`allocate`
    for every layer; after the page rounding :meth:`commit` (per layer) carries memory over;
    wrappers (``policies.wrappers``) reuse the same hooks with another allocation.
    """

    def score(self, kv: LayerKV, state: RequestState) -> torch.Tensor:
        """[H_kv, N] float, higher = more important; invalid slots are ignored. On the device of
        ``kv.keys`` or on the host."""
        raise NotImplementedError

    def score_layers(self, layers: Sequence[LayerKV], state: RequestState) -> list[torch.Tensor]:
        """:meth:`score` of every layer (a policy may do what its layers share once)."""
        return [self.score(kv, state) for kv in layers]

    def protected(self) -> tuple[int, int]:
        """(sink, window) always kept."""
        return int(getattr(self, "sink", 0) or 0), int(getattr(self, "window", 0) or 0)

    def protected_for(self, kv: LayerKV, state: RequestState) -> tuple[int, int]:
        """(sink, window) for this layer once ``state.budget`` is set; default :meth:`protected`."""
        return self.protected()

    def allocate(
        self, rankings: Sequence[Ranking], budgets: Sequence[int], lengths: Sequence[torch.Tensor],
        protected: Sequence[tuple[int, int]], *, quantum: tuple[int, int] | None = None,
    ) -> list[list[torch.Tensor]]:
        """Kept slots per layer and head (an :class:`Allocator`); default: the same budget for
        every head of a layer (the engine's page grid then rounds each up)."""
        return protected_topk_layers(rankings, budgets, lengths, protected)

    def commit(self, kv: LayerKV, state: RequestState, selection: Selection, chosen: list[torch.Tensor]) -> None:
        """Update one layer's per-slot policy state to the kept slots (default: nothing to carry).

        ``selection`` is what is kept (page-rounded); ``chosen`` the slots the allocation picked.
        """

    def commit_kept(self, layers: Sequence[LayerKV], state: RequestState, picks: Sequence[Selection],
                    kept: Sequence[Selection]) -> None:
        for kv, pick, selection in zip(layers, picks, kept):
            self.commit(kv, state, selection, pick.indices)

    def mean_kept_bound(self, prompt_len: int, num_heads: int | None = None) -> int | None:
        """Every allocation keeps ``target_budget`` tokens per head on average (adaptive heads
        move budget between heads, never add to it)."""
        return self.target_budget(prompt_len)

    def allocates_across_heads(self) -> bool:
        """Whether :meth:`allocate` ranks the heads of a layer against each other."""
        return False

    def budgets_on_pages(self) -> bool:
        return self.allocates_across_heads()  # an allocation across heads snaps their counts

    def select_scored(self, layers: Sequence[LayerKV], state: RequestState, budgets: Sequence[int],
                      allocate: Allocator, across_heads: bool = False) -> list[Selection]:
        """Per layer (``budgets[i]`` for ``layers[i]``): protected region and scores of this
        policy, then ``allocate``'s picks for every layer in one call (rounded up to the page grid
        by score, then committed, by :meth:`decide`). An allocation ``across_heads`` sees every
        tensor-parallel rank's heads (then one layer at a time)."""
        if not layers:
            return []
        lengths = [kv.valid_lengths() for kv in layers]
        protected = [self.protected_for(kv, state) for kv in layers]
        scores = [s.float() for s in self.score_layers(layers, state)]  # allocations rank where the policy scored
        over_ranks = across_heads and state.ranks.size > 1
        rankings = [Ranking(s.cpu() if over_ranks else s) for s in scores]  # gathered over the ranks on the host
        if over_ranks:
            chosen = [_allocate_over_ranks(state.ranks, allocate, *args, state.page_quantum)
                      for args in zip(rankings, budgets, lengths, protected)]
        else:
            chosen = allocate(rankings, budgets, lengths, protected, quantum=state.page_quantum)
        return [Selection(picked, priority=ranking) for picked, ranking in zip(chosen, rankings)]

    def select(self, layers: Sequence[LayerKV], state: RequestState) -> list[Selection]:
        if layers and state.budget is None:
            state.budget = self.target_budget(budget_basis(layers, state))
        return self.select_scored(layers, state, [state.budget] * len(layers), self.allocate,
                                  self.allocates_across_heads())


def _allocate_over_ranks(ranks: Ranks, allocate: Allocator, ranking: Ranking, budget: int, lengths: torch.Tensor,
                         protected: tuple[int, int], quantum: tuple[int, int] | None) -> list[torch.Tensor]:
    """``allocate`` of one layer over every rank's heads (scores right-aligned to a common
    width), then this rank's part, back in its own slots."""
    scores = ranking.scores
    width = int(ranks.reduce(scores.shape[1], max))
    pad = width - scores.shape[1]
    padded = torch.nn.functional.pad(scores, (pad, 0), value=float("-inf"))
    everyone = ranks.cat_heads(padded)
    all_lengths = ranks.cat_heads(lengths.to(torch.long))
    chosen = allocate([Ranking(everyone)], [budget], [all_lengths], [protected], quantum=quantum)[0]
    mine = chosen[ranks.rank * scores.shape[0] : (ranks.rank + 1) * scores.shape[0]]
    return [idx - pad for idx in mine]


#: most cells [H, max position] of the table a :meth:`SlotMemory.lookup` builds (16 Mi: 64 MiB
#: of float32, a 1M-token context at 16 heads); a larger lookup searches instead
DENSE_LOOKUP = 1 << 24


@dataclass
class SlotMemory:
    """Per-slot policy memory that survives the engine's compaction, keyed by logical position.

    positions [H_kv, M] int64, ascending per head, -1 padding on the left; values [H_kv, M].
    Build it with :meth:`kept` (gathers with the returned indices), read it with :meth:`lookup`.
    """

    positions: torch.Tensor
    values: torch.Tensor

    @classmethod
    def kept(
        cls, values: torch.Tensor, positions: torch.Tensor, indices: Sequence[torch.Tensor]
    ) -> SlotMemory:
        """Remember ``values`` [H, N] at the kept slots; ``positions`` [H, N] of the same layer."""
        counts = torch.tensor([len(i) for i in indices], dtype=torch.long)
        slots = torch.cat([i.to(torch.long).cpu() for i in indices]) if indices else torch.zeros(0, dtype=torch.long)
        return cls._kept_rows(values.cpu(), positions.to(torch.long).cpu(), slots, counts)

    @classmethod
    def kept_layers(cls, values: Sequence[torch.Tensor], positions: Sequence[torch.Tensor],
                    indices: Sequence[Sequence[torch.Tensor]]) -> list[SlotMemory]:
        """:meth:`kept` of several layers (per layer values and positions [H, N_l], H index
        tensors) at once: their rows stacked right-aligned, one gather and one sort for all."""
        if not values:
            return []
        heads = [len(layer) for layer in indices]
        pads = _pads([v.shape[1] for v in values])
        counts = torch.tensor([len(idx) for layer in indices for idx in layer], dtype=torch.long)
        row_pad = torch.tensor(pads, dtype=torch.long).repeat_interleave(torch.tensor(heads))
        slots = torch.cat([idx.to(torch.long).cpu() for layer in indices for idx in layer]) + row_pad.repeat_interleave(counts)
        stacked = cls._kept_rows(_stack_right([v.cpu() for v in values], pads, 0),
                                 _stack_right([p.to(torch.long).cpu() for p in positions], pads, -1),
                                  slots, counts)
        widths = [int(c.max()) if len(c) else 0 for c in counts.split(heads)]
        width = stacked.positions.shape[1]
        return [cls(pos[:, width - w:].contiguous(), val[:, width - w:].contiguous()) for pos, val, w in
                zip(stacked.positions.split(heads), stacked.values.split(heads), widths)]

    @classmethod
    def _kept_rows(cls, values: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                   counts: torch.Tensor) -> SlotMemory:
        """values, positions [R, N] host; row r keeps the next ``counts[r]`` of ``slots`` (every
        row's kept slots, row after row). One gather and, unless the gathered rows already
        ascend (sorted slots of ascending positions, as the engine's are), one row-wise sort:
        each row's kept positions ascending, right-aligned, the -1 padding (value 0) to its left."""
        width = int(counts.max()) if len(counts) else 0
        if not width:
            return cls(torch.full((len(counts), 0), -1, dtype=torch.long), torch.zeros((len(counts), 0), dtype=values.dtype))
        kept = torch.arange(width).unsqueeze(0) >= (width - counts).unsqueeze(1)  # [R, K], right-aligned
        if bool(kept.all()):
            table = slots.view(len(counts), width)
        else:
            table = torch.zeros(kept.shape, dtype=torch.long)
            table[kept] = slots  # row-major: each row's slots in its right-aligned columns
        kept_pos = positions.gather(1, table).masked_fill_(~kept, -1)
        kept_values = values.gather(1, table).masked_fill_(~kept, 0)
        if bool((kept_pos[:, 1:] >= kept_pos[:, :-1]).all()):
            return cls(kept_pos, kept_values)
        kept_pos, order = kept_pos.sort(dim=1)
        return cls(kept_pos, kept_values.gather(1, order))

    def lookup(self, positions: torch.Tensor, fill: float = 0) -> torch.Tensor:
        """[H, N] remembered values at ``positions`` [H, N] (-1 = invalid); ``fill`` elsewhere.

        A table per head over every position up to the largest (a scatter and a gather) while it
        has at most :data:`DENSE_LOOKUP` cells, else a binary search of the ascending rows."""
        positions = positions.to(torch.long).cpu().contiguous()
        if self.positions.shape[1] == 0:
            return torch.full(positions.shape, fill, dtype=self.values.dtype)
        end = max(int(self.positions.max()), int(positions.max())) + 1  # column ``end``: every -1
        if positions.shape[0] * (end + 1) <= DENSE_LOOKUP:
            table = torch.full((positions.shape[0], end + 1), fill, dtype=self.values.dtype)
            table.scatter_(1, self.positions.masked_fill(self.positions < 0, end), self.values)
            table[:, end] = fill
            return table.gather(1, positions.masked_fill(positions < 0, end))
        out = torch.full(positions.shape, fill, dtype=self.values.dtype)
        idx = torch.searchsorted(self.positions, positions).clamp_max(self.positions.shape[1] - 1)
        hit = (self.positions.gather(1, idx) == positions) & (positions >= 0)
        return torch.where(hit, self.values.gather(1, idx), out)

    @staticmethod
    def lookup_layers(memories: Sequence[SlotMemory], positions: Sequence[torch.Tensor],
                      fill: float = 0) -> list[torch.Tensor]:
        """:meth:`lookup` of several layers (per layer its memory and positions [H, N_l]) in one
        search: the memories' rows stacked right-aligned (-1 padding keeps them ascending)."""
        if not memories:
            return []
        widths = [p.shape[1] for p in positions]
        memory = SlotMemory(_stack_right([m.positions for m in memories], None, -1),
                            _stack_right([m.values for m in memories], None, 0))
        found = memory.lookup(_stack_right([p.to(torch.long).cpu() for p in positions], None, -1), fill)
        width = found.shape[1]
        return [rows[:, width - w:] for rows, w in zip(found.split([p.shape[0] for p in positions]), widths)]


class PinnedPick(NamedTuple):
    """One layer's pick of :func:`keep_pinned_layers`."""

    chosen: list[torch.Tensor]  # H_kv sorted slot indices
    priority: Ranking  # [H_kv, N] recency + 2·pinned
    holds_pins: bool  # every pinned slot is chosen (a pin memory keyed by position stays true as it is)


def _latest(mask: torch.Tensor, quota: torch.Tensor) -> torch.Tensor:
    """[R, N] bool: each row's last ``quota[r]`` True slots of ``mask``."""
    flags = mask.to(torch.int32)
    from_end = flags.sum(1, keepdim=True) - flags.cumsum(1, dtype=torch.int32) + flags  # True slots at or after
    return mask & (from_end <= quota.to(torch.int32).unsqueeze(1))


def keep_pinned_layers(layers: Sequence[LayerKV], pinned: Sequence[torch.Tensor], sinks: Sequence[int],
                       keeps: Sequence[int]) -> list[PinnedPick]:
    """Per layer and head: the first ``sink`` live slots, the pinned slots, then the most recent,
    up to ``keep`` (per layer pinned [H_kv, N_l] bool, sink and keep).

    For policies whose selected set stays while the recent window slides (SAGE-KV,
    entropy-guided budgets). Returns per layer H_kv sorted index tensors of ``min(keep, length)``,
    the priority [H_kv, N_l] they were ranked by (recency + 2·pinned: pinned first, then the
    most recent; sorted only if the page rounding asks), and whether every pinned slot was chosen.
    The pick is :func:`protected_mask`'s under that priority, counted instead of ranked: the sink,
    then the most recent pinned slots, then the most recent others. Every layer in one pass:
    their rows stacked right-aligned (padding is never pinned, never live, and ranks last)."""
    if not layers:
        return []
    heads, widths = layers[0].num_kv_heads, [kv.num_slots for kv in layers]
    pads = _pads(widths)
    row_pad = torch.tensor(pads, dtype=torch.long).repeat_interleave(heads).unsqueeze(1)  # [L·H, 1]
    row_width = torch.tensor([max(n, 1) for n in widths], dtype=torch.long).repeat_interleave(heads).unsqueeze(1)
    flags = _stack_right([p.to(torch.bool).cpu() for p in pinned], pads, False)  # [L·H, N]
    n = flags.shape[1]
    recency = (torch.arange(n) - row_pad).to(torch.float32) / row_width  # each layer's own slots
    scores = recency + 2.0 * flags.float()
    rankings = [Ranking(scores[i * heads : (i + 1) * heads, pad:]) for i, pad in enumerate(pads)]
    rows = LayerRows(rankings, [kv.valid_lengths() for kv in layers], Ranking(scores))
    keep = torch.minimum(rows.per_row(list(keeps)).clamp(min=0), rows.lengths)
    sink = torch.minimum(keep, rows.per_row(list(sinks)))
    start = (n - rows.lengths).unsqueeze(1)
    slots = torch.arange(n).unsqueeze(0)
    live = slots >= start
    whole = (keep >= rows.lengths).unsqueeze(1)
    protected = live & (whole | (slots < start + sink.unsqueeze(1)))
    candidates = live & ~protected
    pins, others = candidates & flags, candidates & ~flags
    rest = keep - sink  # a whole head has no candidates: what it is given here takes nothing
    spare = (rest - pins.sum(1)).clamp(min=0)
    mask = protected | _latest(pins, rest) | _latest(others, spare)
    dropped = (flags & ~mask).view(len(layers), -1).any(dim=1).tolist()  # a pinned slot left out, per layer
    return [PinnedPick(chosen, ranking, not lost) for chosen, ranking, lost in zip(rows.split(mask), rankings, dropped)]


def kept_pins(pinned: torch.Tensor, kept: Selection) -> list[torch.Tensor]:
    """Per head the slots of ``kept`` that ``pinned`` [H_kv, N] bool marks: what a pin memory
    (:class:`SlotMemory` of ones, looked up with fill 0) remembers, so that a later pick that
    keeps every pin leaves it as it is (:class:`PinnedPick`)."""
    return head_rows(pinned & slot_mask(kept.indices, pinned.shape[1]))


def out_proj_heads(weight: torch.Tensor, head_dim: int) -> torch.Tensor:
    """An output projection's weight [hidden, H_q·D] (``o_proj.weight``: input features grouped by
    query head) as the [H_q, D, hidden] view :attr:`LayerKV.out_proj` holds (no copy)."""
    hidden, features = weight.shape
    if features % head_dim:
        raise ValueError(f"an output projection with {features} input features is not split into heads of {head_dim}")
    return weight.t().reshape(features // head_dim, head_dim, hidden)


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


__all__ = [
    "Compensation",
    "LayerKV",
    "PinnedPick",
    "Policy",
    "Ranking",
    "Ranks",
    "RequestState",
    "ScorePolicy",
    "Selection",
    "SlotMemory",
    "budget_basis",
    "ceil_div",
    "keep_pinned_layers",
    "kept_pins",
    "out_proj_heads",
    "page_count",
    "page_counts",
    "protected_topk",
    "protected_topk_layers",
    "reduce_gqa",
    "round_to_pages",
    "round_to_pages_layers",
    "visible_softmax",
    "window_attention",
    "window_attention_mass",
    "window_chunks",
]
