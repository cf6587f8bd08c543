"""DuoAttention head gates (Xiao et al. 2024, §3.2; the authors' ``duo_attn/train.py``): which KV
heads need the whole cache (retrieval heads) and which live with sinks and recent tokens
(streaming heads), found by optimisation.

Every (layer, KV head) gets a gate α ∈ [0, 1] that mixes, for each of its query heads,

    attn = α · full_attn + (1 − α) · streaming_attn      (streaming: the first ``sink`` and the last
                                                          ``recent`` keys of each query, causal)

The model stays frozen; only the L·H_kv gates are trained, from α = 1 (the gated model is then
the model), with AdamW on synthetic multi-passkey retrieval samples to minimise

    loss = mean over answer tokens of mean_d (h_full − h_gated)²  +  reg · mean |α|

h being the last hidden states (after the final norm) and the answer tokens the question-and-
passkey part at the end of the sample (the authors' ``labels != -100``). As in the authors' code,
``full_attn`` of the gated pass is the full model's attention output at that layer (recorded in
a no-grad pass of the unmodified model), the gates are clamped to [0, 1] before every step, and
the learning rate warms up over the first fifth of the steps and decays over the last fifth.

Samples follow the authors' ``MultiplePasskeyRetrievalDataset``: a fixed haystack (here the
seeded pseudo-text of :func:`layer_groups.pseudo_text`, no downloads) cut to a context length
from an even grid, ``passkeys`` needles "Remember this sequence of words, it's the <n>th passkey
to the vault: <words>" at sorted random depths, then every question followed by its passkey.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from vllm_kvcomp.calibration.layer_groups import pseudo_text
from vllm_kvcomp.calibration.profiles import HeadGatesProfile, ModelIdentity

#: reduced settings for a 2-core CPU (the authors': 2000 steps at lr 0.02, haystacks of 1000–32000
#: tokens, sink 128 + recent 256, 10 passkeys of 32 words); reg and the threshold are theirs. With
#: 30x fewer steps the learning rate is 2.5x theirs, so a gate can still cross [0, 1] (AdamW moves
#: it by at most lr per step): Σ lr over the schedule is 2.7 here, 32 in theirs.
DEFAULTS: dict[str, Any] = {
    "steps": 64,
    "lr": 0.05,
    "reg": 0.05,
    "min_length": 256,
    "max_length": 768,
    "intervals": 20,
    "sink": 16,
    "recent": 64,
    "passkeys": 4,
    "passkey_words": 8,
    "threshold": 0.5,
    "seed": 0,
}
PASSKEY_ALPHABET = (
    "alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliett", "kilo", "lima",
    "mike", "november", "oscar", "papa", "quebec", "romeo", "sierra", "tango", "uniform", "victor", "whiskey",
    "xray", "yankee", "zulu",
)
ORDINALS = ("first", "second", "third", "fourth", "fifth", "sixth", "seventh", "eighth", "ninth", "tenth")
NEEDLE = "Remember this sequence of words, it's the {ordinal} passkey to the vault: "
QUESTION = "Based on the content of the book, what is the {ordinal} passkey to the vault?\nPasskey: "
OPEN, CLOSE, SEPARATOR = "This is a very long story book: <book> ", " </book>.\n\n", "\n\n"
#: the authors' depth range and grid (``min/max_needle_depth_ratio``, ``depth_ratio_num_intervals``)
DEPTHS = (0.05, 0.95, 1000)

Encode = Callable[[str], list[int]]


@dataclass(frozen=True)
class PasskeySample:
    """One training sample: ``input_ids`` [T] int64, ``answer`` [T] bool (the tokens the loss reads)."""

    input_ids: torch.Tensor
    answer: torch.Tensor


def passkey_sample(encode: Encode, haystack: Sequence[int], depths: Sequence[float],
                   passkeys: Sequence[str], prefix: Sequence[int] = ()) -> PasskeySample:
    """``prefix + OPEN + haystack with the needles at depths + CLOSE + (question, passkey)*``.

    ``depths`` ascending in [0, 1], one per passkey; the i-th needle and question name the i-th
    ordinal. The answer mask covers every question and passkey after CLOSE (the authors' labels).
    """
    sep = encode(SEPARATOR)
    context, last = [], 0
    for i, (depth, key) in enumerate(zip(depths, passkeys)):
        cut = int(len(haystack) * depth)
        context += [*haystack[last:cut], *sep, *encode(NEEDLE.format(ordinal=ORDINALS[i])), *encode(key), *sep]
        last = cut
    head = [*prefix, *encode(OPEN), *context, *haystack[last:], *encode(CLOSE)]
    qa = [t for i, key in enumerate(passkeys) for t in (*encode(QUESTION.format(ordinal=ORDINALS[i])), *encode(key), *sep)]
    answer = torch.zeros(len(head) + len(qa), dtype=torch.bool)
    answer[len(head):] = True
    return PasskeySample(torch.tensor(head + qa, dtype=torch.long), answer)


def passkey_samples(encode: Encode, steps: int, *, min_length: int, max_length: int, intervals: int, passkeys: int,
                    passkey_words: int, seed: int, prefix: Sequence[int] = ()) -> Iterator[PasskeySample]:
    """``steps`` samples, deterministic in ``seed``: each pass over the ``intervals`` context lengths
    (``linspace(min_length, max_length)`` haystack tokens) visits them in a fresh random order; each
    sample draws its depths from the authors' grid and its passkeys (``passkey_words`` random
    NATO-alphabet words each)."""
    if not 1 <= passkeys <= len(ORDINALS):
        raise ValueError(f"passkeys must be in [1, {len(ORDINALS)}], got {passkeys}")
    if not 1 <= min_length <= max_length:
        raise ValueError(f"need 1 <= min_length <= max_length, got {min_length}, {max_length}")
    generator = torch.Generator().manual_seed(seed)
    haystack = encode(pseudo_text(max_length, seed))[:max_length]
    lengths = torch.linspace(min_length, max_length, intervals).long().tolist()
    grid = torch.linspace(*DEPTHS[:2], DEPTHS[2])
    order: list[int] = []
    for _ in range(steps):
        if not order:
            order = torch.randperm(len(lengths), generator=generator).tolist()
        length = lengths[order.pop(0)]
        depths = grid[torch.randperm(len(grid), generator=generator)[:passkeys]].sort().values.tolist()
        words = torch.randint(len(PASSKEY_ALPHABET), (passkeys, passkey_words), generator=generator).tolist()
        keys = [" ".join(PASSKEY_ALPHABET[w] for w in row) for row in words]
        yield passkey_sample(encode, haystack[:length], depths, keys, prefix)


def streaming_mask(num_tokens: int, sink: int, recent: int) -> torch.Tensor:
    """[T, T] bool: query i sees key j when ``j < sink`` or ``i - recent < j``, and ``j <= i``."""
    i = torch.arange(num_tokens).view(-1, 1)
    j = torch.arange(num_tokens).view(1, -1)
    return (j <= i) & ((j < sink) | (j > i - recent))


def streaming_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, sink: int, recent: int,
                        scale: float) -> torch.Tensor:
    """Attention under :func:`streaming_mask` in O(T · (sink + 2·recent)): query [H_q, T, D], key and
    value [H_kv, T, D] (GQA: query head q reads KV head ``q // (H_q / H_kv)``) -> [H_q, T, D].

    Queries go in blocks of ``recent``; block b sees the keys of blocks b − 1 and b (its window)
    plus the sink keys that fell out of the window, so no [T, T] tensor is ever built.
    """
    hk, t, d = key.shape
    group, r = query.shape[0] // hk, max(1, min(recent, t))  # recent ≥ T: one block, the whole prefix
    blocks = -(-t // r)
    pad = blocks * r - t
    q = F.pad(query, (0, 0, 0, pad)).view(hk, group, blocks, r, d)
    windows = [F.pad(x, (0, 0, r, pad)).unfold(1, 2 * r, r).transpose(2, 3) for x in (key, value)]  # [H_kv, nb, 2r, D]
    qpos = torch.arange(blocks * r).view(blocks, r, 1)
    kpos = qpos.view(blocks, r)[:, :1].unsqueeze(-1) - r + torch.arange(2 * r).view(1, 1, -1)  # [nb, 1, 2r]
    in_window = (kpos >= 0) & (kpos <= qpos) & (kpos > qpos - recent)  # [nb, r, 2r]
    s = min(sink, t)
    in_sink = torch.arange(s).view(1, 1, -1) <= qpos - recent  # [nb, r, s]: sink keys out of the window
    logits = torch.cat([
        torch.einsum("hgbrd,hsd->hgbrs", q, key[:, :s]).masked_fill(~in_sink, float("-inf")),
        torch.einsum("hgbrd,hbkd->hgbrk", q, windows[0]).masked_fill(~in_window, float("-inf")),
    ], -1) * scale
    probs = torch.softmax(logits, -1)
    out = torch.einsum("hgbrs,hsd->hgbrd", probs[..., :s], value[:, :s])
    out = out + torch.einsum("hgbrk,hbkd->hgbrd", probs[..., s:], windows[1])
    return out.reshape(hk * group, blocks * r, d)[:, :t]


# ---------------------------------------------------------------------------- the gated model

#: a runner: (input_ids [T], gates [L, H_kv] or None for the full model) -> last hidden states [T, d]
Runner = Callable[[torch.Tensor, "torch.Tensor | None"], torch.Tensor]

DUO_NAME = "kvcomp_duo"


@dataclass
class _Pass:
    """What one forward pass does: record full attention (``gates`` None) or mix it with streaming."""

    gates: torch.Tensor | None
    full: dict[int, torch.Tensor]  # layer -> [1, T, H_q, D] full attention output of the last full pass
    sink: int = 0
    recent: int = 0


_PASS: ContextVar[_Pass | None] = ContextVar("kvcomp_duo_pass", default=None)


def _duo_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   attention_mask: torch.Tensor | None, scaling: float, dropout: float = 0.0,
                   **kwargs: Any) -> tuple[torch.Tensor, None]:
    """query [1, H_q, T, D], key/value [1, H_kv, T, D] -> [1, T, H_q, D]: causal full attention
    (recorded), or ``α · recorded full + (1 − α) · streaming`` per query head (α of its KV head)."""
    active = _PASS.get()
    if active is None:
        raise RuntimeError("the DuoAttention gated attention runs only inside hf_gated_runner")
    layer = int(module.layer_idx)
    if active.gates is None:
        out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling, enable_gqa=True)
        active.full[layer] = out.transpose(1, 2).detach()
        return active.full[layer], None
    stream = streaming_attention(query[0], key[0], value[0], active.sink, active.recent, scaling)
    group = query.shape[1] // key.shape[1]
    alpha = active.gates[layer].clamp(0, 1).repeat_interleave(group).view(1, 1, -1, 1)
    return alpha * active.full[layer] + (1 - alpha) * stream.transpose(0, 1).unsqueeze(0), None


@contextmanager
def hf_gated_runner(model: Any, sink: int, recent: int) -> Iterator[Runner]:
    """Context in which ``model`` (an HF causal LM, batch 1) runs as the gated model: the runner's
    full pass (gates None, no grad) records every layer's attention output, a gated pass (gates
    [L, H_kv], with grad) mixes it with streaming attention (``sink`` + ``recent``)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    AttentionInterface.register(DUO_NAME, _duo_attention)
    AttentionMaskInterface.register(DUO_NAME, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    previous = model.config._attn_implementation
    model.set_attn_implementation(DUO_NAME)
    full: dict[int, torch.Tensor] = {}

    def run(input_ids: torch.Tensor, gates: torch.Tensor | None) -> torch.Tensor:
        if gates is not None and not full:
            raise RuntimeError("run the full pass (gates None) on the sample first")
        token = _PASS.set(_Pass(gates, full, sink, recent))
        try:
            with torch.set_grad_enabled(gates is not None):
                out = model.base_model(input_ids=input_ids.view(1, -1), use_cache=False)
        finally:
            _PASS.reset(token)
        return out.last_hidden_state[0]

    try:
        yield run
    finally:
        model.set_attn_implementation(previous)


# ---------------------------------------------------------------------------- training


def lr_factor(step: int, steps: int) -> float:
    """The authors' schedule: linear warm-up over the first fifth, decay over the last, floor 0.1."""
    fifth = max(1, steps // 5)
    return min(1.0, max((step + 1) / fifth, 0.1), max((steps - step) / fifth, 0.1))


def gate_loss(target: torch.Tensor, hidden: torch.Tensor, answer: torch.Tensor, gates: torch.Tensor,
              reg: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, distillation, L1) for last hidden states [T, d] of the full and gated model,
    the answer mask [T] and the gates [L, H_kv]."""
    distill = (target[answer] - hidden[answer]).pow(2).mean(-1).mean()
    l1 = gates.abs().mean()
    return distill + reg * l1, distill, l1


def train_gates(run: Runner, samples: Iterator[PasskeySample], num_layers: int, num_kv_heads: int, *,
                steps: int, lr: float, reg: float, progress: bool = True) -> tuple[torch.Tensor, list[float]]:
    """Optimise the gates on ``steps`` samples; returns (gates [L, H_kv] clamped to [0, 1], the
    distillation loss of every step)."""
    if steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps}")
    gates = torch.nn.Parameter(torch.ones(num_layers, num_kv_heads))
    optimizer = torch.optim.AdamW([gates], lr=lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, steps))
    history: list[float] = []
    bar = tqdm(range(steps), desc="duoattention gates", unit="step", disable=not progress)
    for _, sample in zip(bar, samples):
        with torch.no_grad():
            gates.clamp_(0, 1)
            target = run(sample.input_ids, None)
        loss, distill, l1 = gate_loss(target, run(sample.input_ids, gates), sample.answer, gates, reg)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
        history.append(float(distill.detach()))
        bar.set_postfix(T=len(sample.input_ids), distill=f"{history[-1]:.4f}", l1=f"{float(l1.detach()):.3f}")
    if len(history) < steps:
        raise RuntimeError(f"only {len(history)} samples for {steps} steps")
    return gates.detach().clamp(0, 1), history


def calibrate_duo_attention(model: Any, encode: Encode, identity: ModelIdentity, *, prefix: Sequence[int] = (),
                            name: str = "default", progress: bool = True, **overrides: Any) -> HeadGatesProfile:
    """Train the gates of ``model`` (an HF causal LM, frozen) with :data:`DEFAULTS` updated by
    ``overrides``; ``encode`` tokenizes text without special tokens, ``prefix`` (e.g. BOS) opens
    every sample."""
    unknown = set(overrides) - set(DEFAULTS)
    if unknown:
        raise ValueError(f"unknown settings {sorted(unknown)} (allowed: {', '.join(DEFAULTS)})")
    s = {**DEFAULTS, **overrides}
    samples = passkey_samples(encode, s["steps"], min_length=s["min_length"], max_length=s["max_length"],
                              intervals=s["intervals"], passkeys=s["passkeys"], passkey_words=s["passkey_words"],
                              seed=s["seed"], prefix=prefix)
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    start = time.perf_counter()
    with hf_gated_runner(model, s["sink"], s["recent"]) as run:
        gates, history = train_gates(run, samples, identity.num_layers, identity.num_kv_heads,
                                     steps=s["steps"], lr=s["lr"], reg=s["reg"], progress=progress)
    tail = history[-max(1, len(history) // 10):]
    return HeadGatesProfile(
        model=identity,
        gates=tuple(tuple(round(float(g), 6) for g in row) for row in gates),
        threshold=s["threshold"],
        settings={"method": "duoattention-gates", **s, "prefix": list(prefix),
                  "final_distill": round(sum(tail) / len(tail), 6),
                  "seconds": round(time.perf_counter() - start, 1)},
        name=name,
    )
