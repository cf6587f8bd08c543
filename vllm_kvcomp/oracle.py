"""Reference generation with a compressed KV cache, on HF transformers (the engine's ground truth).

The oracle owns the KV cache: a custom attention function (registered as ``kvcomp_oracle``)
receives each layer's post-RoPE q/k/v for the new tokens and attends, in float32 (float64 for a
float64 model), over a per-(layer, KV head) store of kept tokens; HF's own cache is off. One
request, greedy decoding. The timing, which the vLLM integration must reproduce exactly:

1. **Prefill.** One forward over the whole prompt (positions ``0..P-1``) with full causal
   attention. The last position's logits give generated token 1; its logprob is recorded.
1b. **Chunked prefill** (``prefill_chunk``): the prompt is forwarded in chunks, each attending
   to the cache as it stands. With ``prefill=stream`` or ``block`` the request's ``budget`` is
   set from the whole prompt first (``policy.prefill_budget(P)``), and after every chunk but the
   last, if ``policy.stream_due(state, M)`` (M = max live tokens), step 2 runs at that length.
   Every compression of the prompt (those and the prompt end's) starts with
   ``policy.start_prefill_compression(state)``: with ``block`` the state starts afresh, so each
   decides as at the prompt's end, over the cache as it stands and the last ``w`` queries (the
   chunk's own).
2. **Compression** (only if a policy other than ``full`` is given). Per layer a
   :class:`~vllm_kvcomp.policies.base.LayerKV` is built from the store: ``keys``/``values``
   ``[H_kv, N, D]`` post-RoPE, right-aligned (head h's ``n_h`` live tokens in slots
   ``[N - n_h, N)``, N = max n_h, zeros elsewhere), ``lengths`` ``[H_kv]``, ``positions``
   ``[H_kv, N]`` (logical, -1 where invalid), the last ``w = policy.queries_needed()`` post-RoPE
   queries ``[H_q, w, D]`` (fewer if fewer were processed; None if w = 0) with their
   ``query_positions``, ``layer``, ``num_layers`` and the attention ``scale`` (and, for a policy
   with ``NEEDS_OUT_PROJ``, ``out_proj``: the layer's ``o_proj.weight`` split by query head). Then
   ``policy.decide(layers, state)`` runs once for all layers with the request's single
   :class:`~vllm_kvcomp.policies.base.RequestState` (``prompt_len`` = P; with a ``block_size``,
   ``page_quantum = (block_size, M % block_size)`` for M tokens processed, so every head keeps a
   count on the engine's page grid: the policy's picks rounded up with its next-best tokens,
   exactly as the engine rounds them); afterwards the oracle
   increments ``state.compressions``. Each head keeps exactly the selected slots, in order. A
   returned ``Compensation`` replaces the layer's compensation entries (k̂, v̂, N_d per head);
   ``None`` leaves earlier ones unchanged.
3. **Decode.** Each step forwards the last generated token at its *logical* position (the number
   of tokens processed so far, never the compacted length). Per KV head, attention covers that
   head's kept tokens, every token appended since, and the token itself, plus the compensation
   token weighted by N_d (eq. 5, :func:`~vllm_kvcomp.policies.compensation.compensated_attention`).
   The argmax of the logits is the next token; its log-softmax value is recorded.
   *After* that forward, if ``policy.recompresses`` (``RECOMPRESSES`` and ``scope=all``) and ``policy.due(state, num_tokens=M,
   steps_since=S)`` — M = max live tokens over all layers and heads (kept + appended), S = decode
   forwards since the last compression — step 2 runs again on the current stores.
3b. **Speculative decoding** (``decode_forwards``): an engine forward verifies several tokens and
   confirms ``c`` of them (the last sampled token and the accepted drafts; the rejected drafts'
   keys and queries are dropped). Those ``c`` tokens attend exactly as ``c`` single-token forwards
   over the same cache would (causal), so the oracle forwards them one by one, and the decode
   forward count, ``S`` and the recompression check advance once per engine forward, after its
   ``c`` tokens. Forwards beyond the list confirm one token each.
3c. **Observed attention** (a policy with ``OBSERVES_ATTENTION``: H2O). From each compression on,
   every decode query's softmax weights over its head's kept tokens (the mean over the query
   group) are summed per token, and a decode recompression gets them as ``LayerKV.observed``
   (through the last observed query's position) in place of re-attending those queries, as the
   engine's CPU kernel sums them while it attends. The first forward the engine's kernel could not
   observe (one of several query rows: a prefill chunk, or a speculative forward that verified
   drafts, ``decode_drafts``) stops the sums until the next compression: the window's queries
   after them count instead. A model whose layers cap logits or have sinks observes nothing.
2d. **Off the step** (``lag`` = k > 0, the engine's ``compression_lag``): the prompt-end
   compression and each due recompression are *decided* as in step 2 (the policy state advances
   then), and *applied* k engine forwards later for the prompt end, k - 1 for a recompression
   (the engine packs at its k-th bind after the launch; the prompt end launches at the bind
   before the first decode forward, a recompression after the forward that made it due). In
   between, decode attends the stores as they were, and there is no due check. Applying keeps
   each head's selected slots plus every token appended since the decision; ``state.compressions``
   increments and the observed sums restart then. A decision never applied (the generation
   ended first) is not recorded.

**Context scope** (``scope=context``, C = ``policy.context_end(P)``): ``RequestState.prompt_len``
is C, the query windows hold only queries of positions before C, and step 2 runs once, after the
prefill: the policy decides over the first C tokens of every head (``LayerKV.context``) and every
token after them is kept; there is no decode recompression.

Attention variants are the model's own: soft-capped logits (``softcap``, Gemma 2) and learned
sink logits (``s_aux``, gpt-oss) enter every attention, the compensation token's included.

Hybrid models: a layer HF runs with a ``sliding_window`` attends its last ``sliding_window``
tokens and is never compressed (the engine leaves such layers to vLLM); policies see only the
full-attention layers, by their model layer index.

Compression records ``step`` = decode forwards done so far (0 = right after prefill). Query
windows roll across prefill and decode: always the last w queries processed. Generation stops
after ``max_new_tokens`` tokens or at a token in ``stop_token_ids`` (included in the output).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from vllm_kvcomp.policies.base import (
    Compensation,
    LayerKV,
    Policy,
    RequestState,
    Selection,
    out_proj_heads,
)
from vllm_kvcomp.policies.compensation import attention_with_lse, compensated_attention, with_sinks

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from vllm_kvcomp.calibration.profiles import Profile

ATTN_IMPLEMENTATION = "kvcomp_oracle"
_SESSION_KWARG = "kvcomp_session"


@dataclass
class OracleResult:
    """Greedy tokens, their logprobs, and one record per compression (see the module docstring).

    ``compressions[i]``: ``step`` (decode forwards before it), ``num_tokens`` (logical tokens
    processed), ``kept`` (per layer, per KV head live tokens after it), ``evicted`` (tokens removed,
    summed over layers and heads).
    """

    token_ids: list[int]
    logprobs: list[float]
    compressions: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class _LayerStore:
    """One layer's cache: per KV head a ragged list of kept tokens, plus window queries."""

    keys: list[torch.Tensor]  # H_kv x [n_h, D]
    values: list[torch.Tensor]  # H_kv x [n_h, D]
    positions: list[torch.Tensor]  # H_kv x [n_h] int64
    queries: torch.Tensor  # [H_q, <=w, D] last processed queries
    query_positions: torch.Tensor  # [<=w] int64
    scale: float
    compensation: Compensation | None = None
    observed: list[torch.Tensor] | None = None  # H_kv x [n_h] float32 (step 3c); None: not observed

    def lengths(self) -> list[int]:
        return [len(p) for p in self.positions]

    def as_layer_kv(self, layer: int, num_layers: int, window: int, observed_through: int | None = None) -> LayerKV:
        """Right-aligned padded view (keys/values [H_kv, N, D], positions -1 where invalid); with
        ``observed_through``, the observed attention too (step 3c)."""
        lengths = self.lengths()
        n = max(lengths)
        ref = self.keys[0]
        heads = len(self.keys)
        keys = ref.new_zeros(heads, n, ref.shape[-1])
        values = self.values[0].new_zeros(heads, n, self.values[0].shape[-1])
        positions = torch.full((heads, n), -1, dtype=torch.long)
        for h, length in enumerate(lengths):
            keys[h, n - length:] = self.keys[h]
            values[h, n - length:] = self.values[h]
            positions[h, n - length:] = self.positions[h].cpu()
        seen = None
        if observed_through is not None:
            seen = torch.zeros(heads, n, dtype=torch.float32)
            for h, length in enumerate(lengths):  # tokens appended after the sums stopped: 0
                seen[h, n - length : n - length + len(self.observed[h])] = self.observed[h].cpu()
        return LayerKV(
            keys=keys,
            values=values,
            layer=layer,
            num_layers=num_layers,
            lengths=torch.tensor(lengths, dtype=torch.long),
            positions=positions,
            queries=self.queries if window > 0 else None,
            query_positions=self.query_positions.cpu() if window > 0 else None,
            scale=self.scale,
            observed=seen,
            observed_through=-1 if observed_through is None else observed_through,
        )

    def keep(self, selection: Selection, num_slots: int) -> int:
        """Keep the selected right-aligned slots per head; returns the number of tokens evicted."""
        if len(selection.indices) != len(self.keys):
            raise ValueError(f"selection has {len(selection.indices)} heads, the layer has {len(self.keys)}")
        evicted = 0
        for h, (index, length) in enumerate(zip(selection.indices, self.lengths())):
            start = num_slots - length
            index = torch.as_tensor(index, dtype=torch.long).cpu()
            if index.numel() and (
                int(index[0]) < start or int(index[-1]) >= num_slots or bool((index.diff() <= 0).any())
            ):
                raise ValueError(
                    f"head {h}: selected slots must be sorted, unique and within the live range "
                    f"[{start}, {num_slots}), got {index.tolist()}"
                )
            local = (index - start).to(self.keys[h].device)
            self.keys[h] = self.keys[h][local]
            self.values[h] = self.values[h][local]
            self.positions[h] = self.positions[h][local]
            evicted += length - index.numel()
        if selection.compensation is not None:
            comp = selection.compensation
            device, dtype = self.keys[0].device, self.keys[0].dtype
            self.compensation = Compensation(
                comp.keys.to(device, dtype), comp.values.to(device, dtype), comp.counts.to(device).float()
            )
        return evicted


class _Session:
    """Per-generation KV store, driven by the registered attention function."""

    def __init__(self, num_layers: int, window: int):
        self.num_layers = num_layers
        self.window = window
        self.layers: list[_LayerStore | None] = [None] * num_layers
        self.sliding: dict[int, int] = {}  # layer -> sliding window: attends its window, never compressed
        self.window_limit: int | None = None  # scope=context: queries of positions before it only
        self.new_positions = torch.zeros(0, dtype=torch.long)  # [T] of the running forward
        self.out_proj: dict[int, torch.Tensor] = {}  # layer -> its o_proj weight [hidden, H_q * D]
        self.observes = False  # the policy reads observed attention (step 3c) and every layer is plain
        self.observing = False  # the sums take each query (until one the engine could not observe)
        self.observed_through = -1  # the last query position summed

    def observe_from_now(self, num_tokens: int) -> None:
        """After a compression at ``num_tokens``: every compressed layer's observed sums start at zero."""
        self.observing, self.observed_through = self.observes, num_tokens - 1
        for i in self.compressed_layers() if self.observes else ():
            store = self.store(i)
            store.observed = [torch.zeros(n, dtype=torch.float32) for n in store.lengths()]

    def compressed_layers(self) -> list[int]:
        """The layers a policy compresses: every full-attention layer."""
        return [i for i in range(self.num_layers) if i not in self.sliding]

    def store(self, layer: int) -> _LayerStore:
        store = self.layers[layer]
        if store is None:
            raise RuntimeError(f"layer {layer} has no cache yet")
        return store

    def max_live(self) -> int:
        return max(max(self.store(i).lengths()) for i in self.compressed_layers())

    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, sliding: int | None = None,
        softcap: float = 0.0, sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q [H_q, T, D], k/v [H_kv, T, D] of the new tokens -> attention output [T, H_q, D].

        Appends k/v to each head's store and q to the query window. A ``sliding`` layer attends
        the last ``sliding`` tokens (itself included), as HF and vLLM do; ``softcap`` caps the
        logits (Gemma 2), ``sinks`` [H_q] are learned sink logits (gpt-oss), as the model's own
        attention applies them.
        """
        if sliding:
            self.sliding[layer] = sliding
        heads, group = k.shape[0], q.shape[0] // k.shape[0]
        pos = self.new_positions.to(q.device)
        store = self.layers[layer]
        if store is None:
            empty = k.new_zeros(0, k.shape[-1])
            store = _LayerStore(
                keys=[empty] * heads,
                values=[v.new_zeros(0, v.shape[-1])] * heads,
                positions=[pos.new_zeros(0)] * heads,
                queries=q.new_zeros(q.shape[0], 0, q.shape[-1]),
                query_positions=pos.new_zeros(0),
                scale=scale,
            )
            self.layers[layer] = store
        if softcap or sinks is not None:  # the engine's kernel sums a plain softmax only
            self.observes = self.observing = False
        observe = self.observing and not sliding and store.observed is not None
        if observe and q.shape[1] != 1:  # several query rows: the engine's kernel observes none
            self.observing = observe = False
        if observe:
            self.observed_through = int(pos[-1])
        outs = []
        for h in range(heads):
            store.keys[h] = torch.cat([store.keys[h], k[h]])
            store.values[h] = torch.cat([store.values[h], v[h]])
            store.positions[h] = torch.cat([store.positions[h], pos])
            if observe:  # the decode query's softmax over the head's tokens, its group's mean
                logits = (q[h * group:(h + 1) * group, 0].float() @ store.keys[h].float().T) * scale  # [G, n_h]
                grown = torch.cat([store.observed[h], torch.zeros(k.shape[1])])
                store.observed[h] = grown + torch.softmax(logits, dim=-1).mean(0).cpu()
            qh = q[h * group:(h + 1) * group].transpose(0, 1)  # [T, G, D]
            kh = store.keys[h].unsqueeze(1).expand(-1, group, -1)  # [S, G, D]
            vh = store.values[h].unsqueeze(1).expand(-1, group, -1)
            mask = store.positions[h].unsqueeze(0) <= pos.unsqueeze(1)  # [T, S]
            if sliding:
                mask &= store.positions[h].unsqueeze(0) > pos.unsqueeze(1) - sliding
            comp = store.compensation
            head_sinks = None if sinks is None else sinks[h * group:(h + 1) * group]
            if comp is None:
                out = with_sinks(*attention_with_lse(qh, kh, vh, scale, mask, softcap), head_sinks)[0]
            else:
                out = compensated_attention(
                    qh, kh, vh,
                    comp.keys[h].expand(group, -1), comp.values[h].expand(group, -1),
                    comp.counts[h].expand(group), scale, mask, softcap, head_sinks,
                )
            outs.append(out)
        if self.window:
            before = pos < self.window_limit if self.window_limit is not None else torch.ones_like(pos, dtype=torch.bool)
            store.queries = torch.cat([store.queries, q[:, before]], dim=1)[:, -self.window:]
            store.query_positions = torch.cat([store.query_positions, pos[before]])[-self.window:]
        return torch.cat(outs, dim=1)


def _oracle_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """HF attention-interface function: query [1, H_q, T, D], key/value [1, H_kv, T, D] -> [1, T, H_q, D]."""
    session = kwargs.get(_SESSION_KWARG)
    if session is None:
        raise RuntimeError(f"a model using {ATTN_IMPLEMENTATION!r} attention must be run by oracle.generate")
    if query.shape[0] != 1:
        raise ValueError("the oracle runs one sequence at a time (batch size 1)")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = session.attend(module.layer_idx, query[0], key[0], value[0], scale, kwargs.get("sliding_window"),
                         kwargs.get("softcap") or 0.0, kwargs.get("s_aux"))
    return out.unsqueeze(0), None


def register_attention() -> None:
    """Register ``kvcomp_oracle`` with transformers' attention interface (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, _oracle_attention)


def load_model(path: str | Path, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    """A causal LM from a local HF folder, in eval mode, using the oracle's attention."""
    from transformers import AutoModelForCausalLM

    register_attention()
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, attn_implementation=ATTN_IMPLEMENTATION)
    return model.eval()


def _forward(model: PreTrainedModel, session: _Session, ids: Sequence[int], start: int) -> tuple[int, float]:
    """Forward ``ids`` at logical positions ``start..``; greedy next token and its logprob."""
    device = model.device
    positions = torch.arange(start, start + len(ids), dtype=torch.long)
    session.new_positions = positions
    out = model(
        input_ids=torch.tensor([list(ids)], dtype=torch.long, device=device),
        position_ids=positions.unsqueeze(0).to(device),
        use_cache=False,
        logits_to_keep=1,
        **{_SESSION_KWARG: session},
    )
    logits = out.logits[0, -1]
    logprobs = torch.log_softmax(logits.double() if logits.dtype == torch.float64 else logits.float(), dim=-1)
    token = int(torch.argmax(logits))
    return token, float(logprobs[token])


def output_projections(model: PreTrainedModel) -> dict[int, torch.Tensor]:
    """Layer index -> the weight [hidden, H_q·D] of its attention's output projection: the
    ``o_proj`` of every attention module (one with a ``layer_idx``), e.g.
    ``model.model.layers[i].self_attn.o_proj``."""
    return {module.layer_idx: module.o_proj.weight.detach() for module in model.modules()
            if hasattr(module, "layer_idx") and isinstance(getattr(module, "o_proj", None), torch.nn.Linear)}


def chunk_ends(prompt_len: int, chunks: int | Sequence[int] | None) -> list[int]:
    """Where the prefill chunks end: every ``chunks`` tokens, or the given ends, then the prompt's."""
    if chunks is None:
        ends: list[int] = []
    elif isinstance(chunks, int):
        ends = list(range(chunks, prompt_len, chunks))
    else:
        ends = [int(e) for e in chunks if 0 < int(e) < prompt_len]
    return [*sorted(set(ends)), prompt_len]


def _prefill(model: PreTrainedModel, session: _Session, prompt: Sequence[int], policy: Policy | None,
             state: RequestState, chunks: int | Sequence[int] | None, block_size: int | None,
             result: OracleResult) -> tuple[int, float]:
    """Step 1 (and 1b): forward the prompt whole or chunk by chunk, compressing between chunks
    when the policy streams; the last chunk's greedy token and logprob."""
    streams = policy is not None and policy.compresses_in_prefill
    if streams:
        state.budget = policy.prefill_budget(len(prompt))
    start = 0
    for end in chunk_ends(len(prompt), chunks):
        token, logprob = _forward(model, session, prompt[start:end], start)
        if streams and end < len(prompt) and policy.stream_due(state, session.max_live()):
            policy.start_prefill_compression(state)
            result.compressions.append(_compress(session, policy, state, 0, end, block_size))
        start = end
    return token, logprob


@dataclass
class _Decision:
    """A compression decided at ``num_tokens`` and not applied yet (``lag``: step 2d)."""

    step: int
    num_tokens: int
    selections: list[Selection]
    num_slots: list[int]
    remaining: int  # engine forwards still to run before it is applied


def _decide(session: _Session, policy: Policy, state: RequestState, step: int, num_tokens: int,
            block_size: int | None, remaining: int = 0) -> _Decision:
    """Step 2's decision on every layer (nothing kept or evicted yet)."""
    state.page_quantum = None if block_size is None else (block_size, num_tokens % block_size)
    layers = session.compressed_layers()
    through = session.observed_through if step > 0 and session.observes else None  # a decode recompression
    views = [session.store(i).as_layer_kv(i, session.num_layers, session.window, through) for i in layers]
    for view in views if policy.NEEDS_OUT_PROJ else ():
        if view.layer not in session.out_proj:
            raise ValueError(f"layer {view.layer} has no output projection (o_proj), which {policy.name!r} reads")
        view.out_proj = out_proj_heads(session.out_proj[view.layer], view.keys.shape[-1])
    selections = policy.decide(views, state)
    if len(selections) != len(layers):
        raise ValueError(f"policy {policy.name!r} returned {len(selections)} selections for {len(layers)} layers")
    return _Decision(step, num_tokens, selections, [view.num_slots for view in views], remaining)


def _apply(session: _Session, state: RequestState, decision: _Decision, num_tokens: int) -> dict[str, Any]:
    """Step 2's eviction of ``decision`` at ``num_tokens`` (every token since it kept); the record."""
    state.compressions += 1
    layers, extra = session.compressed_layers(), num_tokens - decision.num_tokens
    evicted = 0
    for i, sel, slots in zip(layers, decision.selections, decision.num_slots):
        if extra:
            sel = dataclasses.replace(sel, indices=[torch.cat([torch.as_tensor(idx, dtype=torch.long).cpu(),
                                                               torch.arange(slots, slots + extra)])
                                                    for idx in sel.indices])
        evicted += session.store(i).keep(sel, slots + extra)
    session.observe_from_now(num_tokens)
    kept = [session.store(i).lengths() for i in layers]
    return {"step": decision.step, "num_tokens": decision.num_tokens, "switched": num_tokens, "kept": kept,
            "evicted": evicted}


def _compress(
    session: _Session, policy: Policy, state: RequestState, step: int, num_tokens: int, block_size: int | None
) -> dict[str, Any]:
    """Step 2 of the module docstring on every layer; returns the compression record."""
    return _apply(session, state, _decide(session, policy, state, step, num_tokens, block_size), num_tokens)


def _compression_due(session: _Session, policy: Policy, state: RequestState, step: int, num_tokens: int,
                     block_size: int | None, lag: int, result: OracleResult) -> _Decision | None:
    """Step 2 at ``num_tokens`` (``step`` decode forwards in), recorded in ``result``; with
    ``lag`` (step 2d) decided only, returned to be applied later."""
    if not lag:
        result.compressions.append(_compress(session, policy, state, step, num_tokens, block_size))
        return None
    return _decide(session, policy, state, step, num_tokens, block_size, remaining=lag if step == 0 else lag - 1)


@torch.inference_mode()
def generate(
    model: PreTrainedModel,
    prompt_token_ids: Sequence[int],
    policy: Policy | None,
    max_new_tokens: int,
    *,
    profile: Profile | None = None,
    stop_token_ids: Collection[int] = (),
    block_size: int | None = None,
    prefill_chunk: int | Sequence[int] | None = None,
    decode_forwards: Sequence[int] | None = None,
    decode_drafts: Sequence[int] | None = None,
    lag: int = 0,
) -> OracleResult:
    """Greedy generation with ``policy`` applied to the cache exactly as the module docstring says.

    ``model`` must come from :func:`load_model` (oracle attention). ``policy`` None or ``full``
    means no compression. ``profile`` (a calibration profile) is bound to the policy first.
    ``block_size`` rounds every head's kept count up to the engine's page grid (see step 2).
    ``prefill_chunk`` forwards the prompt in chunks of that many tokens, or ending at the given
    positions (the engine's chunk boundaries), see step 1b. ``decode_forwards`` gives how many
    tokens each decode forward of the engine confirmed (speculative decoding), see step 3b;
    ``decode_drafts`` how many draft tokens each verified (a forward with drafts is not observed,
    step 3c; default none). ``lag`` > 0: step 2d (the engine's ``compression_lag``).
    """
    if getattr(model.config, "_attn_implementation", None) != ATTN_IMPLEMENTATION:
        raise ValueError(f"load the model with oracle.load_model (attn_implementation={ATTN_IMPLEMENTATION!r})")
    if not prompt_token_ids:
        raise ValueError("prompt_token_ids is empty")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    if policy is not None and profile is not None:
        from vllm_kvcomp.calibration.profiles import bind_profile

        policy = bind_profile(policy, profile)
    compresses = policy is not None and policy.name != "full"
    session = _Session(model.config.num_hidden_layers, policy.queries_needed() if compresses else 0)
    session.out_proj = output_projections(model)
    session.observes = compresses and policy.OBSERVES_ATTENTION
    state = RequestState(prompt_len=policy.context_end(len(prompt_token_ids)) if compresses else len(prompt_token_ids))
    if compresses and policy.scope == "context":
        session.window_limit = state.prompt_len
    result = OracleResult([], [])

    token, logprob = _prefill(model, session, prompt_token_ids, policy if compresses else None, state,
                              prefill_chunk, block_size, result)
    processed = len(prompt_token_ids)
    result.token_ids.append(token)
    result.logprobs.append(logprob)
    pending: _Decision | None = None
    if compresses:
        policy.start_prefill_compression(state)
        pending = _compression_due(session, policy, state, 0, processed, block_size, lag, result)
    forwards, drafts = iter(decode_forwards or ()), iter(decode_drafts or ())
    decode_steps = steps_since = 0
    left = next(forwards, 1)  # tokens still to come in this engine forward
    if next(drafts, 0):
        session.observing = False
    while len(result.token_ids) < max_new_tokens and token not in stop_token_ids:
        if pending is not None and pending.remaining == 0:  # step 2d: applied before this forward
            result.compressions.append(_apply(session, state, pending, processed))
            pending, steps_since = None, 0
        token, logprob = _forward(model, session, [token], processed)
        processed += 1
        result.token_ids.append(token)
        result.logprobs.append(logprob)
        left -= 1
        if left > 0:  # the same engine forward verifies the next token too: no check in between
            continue
        left = next(forwards, 1)
        decode_steps += 1
        steps_since += 1
        if pending is not None:  # no due check while a decision waits (step 2d)
            pending.remaining -= 1
        elif compresses and policy.recompresses and policy.due(state, session.max_live(), steps_since):
            pending = _compression_due(session, policy, state, decode_steps, processed, block_size, lag, result)
            steps_since = 0
        if next(drafts, 0):  # the next engine forward verifies drafts: its queries are not observed
            session.observing = False
    return result


__all__ = ["ATTN_IMPLEMENTATION", "OracleResult", "generate", "load_model", "register_attention"]
