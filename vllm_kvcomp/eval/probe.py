"""NIAH probe: where the needle's attention is, and which policies keep it (issue #17, item 5).

Runs the HF oracle (:mod:`vllm_kvcomp.oracle`) on ``niah`` samples rendered with the model's
chat template, as the server sends them, with the reply ``The special magic number for <key>
mentioned in the provided text is <value>.`` teacher-forced after the prompt (the bundled
model's own full-cache reply, with the right value). One prefill per sample, nothing generated.
Per sample and per layer:

* ``window``: the decoded observation window (the last ``--window`` prompt tokens);
* ``observe`` / ``observe_key``: per query head, the attention mass the window queries put on the
  needle's value tokens / on the rest of the needle sentence (mean over the window queries), at
  full cache: what SnapKV votes with;
* ``retrieve``: the same for the queries that *produce* the answer's digits: the heads that
  actually retrieve the needle;
* ``kept:<policy>``: per KV head, the fraction of the value tokens the policy keeps when it
  compresses the prompt (on the server's page grid, ``--block-size``).

``python3 -m vllm_kvcomp.eval.probe --samples 10 --out probe.json``; accuracy comes from the
server (``vllm-kvcomp eval --tasks niah``), see docs/results/quality/niah_investigation.md.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch

from vllm_kvcomp.policies.base import LayerKV, Policy, RequestState, Selection, window_attention

#: the reply the bundled model gives under full cache, with the right value teacher-forced
REPLY = "The special magic number for {key} mentioned in the provided text is {value}."


@dataclass
class Rendered:
    """A chat-templated prompt: token ids, the needle value's token indices, the key and value."""

    ids: list[int]
    needle: list[int]
    key: str
    value: str
    text: str


def token_span(offsets: Sequence[tuple[int, int]], start: int, end: int) -> list[int]:
    """Indices of the tokens whose character span overlaps ``[start, end)``."""
    return [i for i, (a, b) in enumerate(offsets) if a < end and b > start and b > a]


def render(tokenizer: Any, user: str, value: str, key: str, reply: str = "") -> Rendered:
    """``user`` through the chat template (generation prompt added), plus ``reply`` if given;
    the needle is the value's first occurrence (each answer occurs once in a prompt)."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": user}], tokenize=False,
                                         add_generation_prompt=True) + reply
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    start = text.index(value)
    return Rendered(list(enc["input_ids"]), token_span(enc["offset_mapping"], start, start + len(value)),
                    key, value, text)


def _view(kv: LayerKV, length: int, positions: torch.Tensor) -> LayerKV:
    """The first ``length`` tokens of an uncompressed ``kv`` with the window queries at
    ``positions`` (empty: none), as a policy compressing a ``length``-token prompt sees them."""
    qpos = kv.window_query_positions()
    pick = torch.isin(qpos, positions)
    queries = kv.queries[:, pick.to(kv.queries.device)] if kv.queries is not None and bool(pick.any()) else None
    return LayerKV(kv.keys[:, :length], kv.values[:, :length], kv.layer, kv.num_layers,
                   torch.full((kv.num_kv_heads,), length), kv.slot_positions()[:, :length],
                   queries, qpos[pick] if queries is not None else None, kv.scale)


def _mass(kv: LayerKV, tokens: Sequence[int]) -> list[float]:
    """[H_q] attention mass of ``kv``'s window queries on ``tokens`` (mean over the queries)."""
    attn = window_attention(kv).float().cpu()  # [H_q, w, N]
    return attn[:, :, list(tokens)].sum(-1).mean(-1).tolist()


@dataclass
class Probe(Policy):
    """One prefill of prompt + teacher-forced reply; at its end, for every layer: the attention
    of the prompt's last ``window`` queries (``observe``) and of the digit-producing queries
    (``retrieve``) on the needle, and which needle tokens each of ``policies`` keeps per KV head
    when compressing the prompt. Keeps everything itself."""

    name: ClassVar[str] = "probe"

    prompt_len: int = 0
    window: int = 32
    digits: tuple[int, ...] = ()  # positions of the queries that produce the answer's digits
    needle: tuple[int, ...] = ()  # value tokens
    key: tuple[int, ...] = ()  # the needle's key tokens (``amber-otter``)
    policies: dict[str, Policy] = field(default_factory=dict)
    block_size: int | None = None
    stats: dict[str, list[list[float]]] = field(default_factory=dict)

    def _observe(self, w: int) -> torch.Tensor:
        return torch.arange(self.prompt_len - w, self.prompt_len)

    def queries_needed(self) -> int:
        widest = max([self.window, *(p.queries_needed() for p in self.policies.values())])
        return max(self.digits, default=self.prompt_len - 1) + 1 - (self.prompt_len - widest)

    def select(self, layers: Sequence[LayerKV], state: RequestState) -> list[Selection]:
        for kv in layers:
            observe = _view(kv, self.prompt_len, self._observe(self.window))
            retrieve = _view(kv, kv.num_slots, torch.tensor(self.digits))
            for name, view, tokens in (("observe", observe, self.needle), ("observe_key", observe, self.key),
                                       ("retrieve", retrieve, self.needle)):
                self.stats.setdefault(name, []).append(_mass(view, tokens))
        for name, policy in self.policies.items():
            own = RequestState(prompt_len=self.prompt_len)
            if self.block_size:
                own.page_quantum = (self.block_size, self.prompt_len % self.block_size)
            views = [_view(kv, self.prompt_len, self._observe(policy.queries_needed())) for kv in layers]
            for view, sel in zip(views, policy.decide(views, own)):
                kept = [float(torch.isin(view.slot_positions()[h, idx], torch.tensor(self.needle)).sum())
                        / len(self.needle) for h, idx in enumerate(sel.indices)]
                self.stats.setdefault(f"kept:{name}", []).append(kept)
        return [Selection.keep_valid(kv) for kv in layers]


def policies(ratio: float) -> dict[str, Policy]:
    """The policies whose kept needle tokens the probe reports."""
    from vllm_kvcomp.policies.h2o import H2O
    from vllm_kvcomp.policies.knorm import KNorm
    from vllm_kvcomp.policies.lagkv import LagKV
    from vllm_kvcomp.policies.snapkv import SnapKV
    from vllm_kvcomp.policies.streamingllm import StreamingLLM

    return {
        "snapkv": SnapKV(ratio=ratio),
        "snapkv_kvpress": SnapKV(ratio=ratio, window=64, kernel=5),  # kvpress SnapKVPress defaults
        "snapkv_k31": SnapKV(ratio=ratio, kernel=31),
        "h2o": H2O(ratio=ratio),
        "streamingllm": StreamingLLM(ratio=ratio),
        "knorm": KNorm(ratio=ratio),
        "lagkv": LagKV(ratio=ratio),
    }


def probe_sample(model: Any, tokenizer: Any, sample: Any, ratio: float, window: int,
                 block_size: int | None) -> dict[str, Any]:
    """Every measurement of the module docstring for one ``niah`` sample (one prefill)."""
    from vllm_kvcomp.eval.tasks.niah import NEEDLE, QUESTION
    from vllm_kvcomp.oracle import generate

    turn = sample.turns[0]
    value = turn.answers[0]
    key = next(k for k in _keys(turn.user) if QUESTION.format(key=k) in turn.user)
    prompt = render(tokenizer, turn.user, value, key)
    forced = render(tokenizer, turn.user, value, key, REPLY.format(key=key, value=value))
    if forced.ids[: len(prompt.ids)] != prompt.ids:
        raise ValueError("the teacher-forced reply changed the prompt's tokenization")
    offsets = _offsets(tokenizer, forced.text)
    digits = token_span(offsets, *_last_span(forced.text, value))
    sentence = forced.text.index(NEEDLE.format(key=key, value=value))
    key_tokens = token_span(offsets, sentence, forced.text.index(value))  # "One of ... amber-otter is: "
    probe = Probe(prompt_len=len(prompt.ids), window=window, digits=tuple(i - 1 for i in digits),
                  needle=tuple(prompt.needle), key=tuple(key_tokens), policies=policies(ratio),
                  block_size=block_size)
    generate(model, forced.ids[: digits[-1]], probe, 1)
    return {"index": sample.index, "depth": sample.depth, "tokens": len(prompt.ids),
            "needle_tokens": prompt.needle, "key_tokens": key_tokens,
            "window": tokenizer.decode(prompt.ids[-window:]), **probe.stats}


def _keys(text: str) -> list[str]:
    import re

    return re.findall(r"[a-z]+-[a-z]+", text)


def _offsets(tokenizer: Any, text: str) -> list[tuple[int, int]]:
    return tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]


def _last_span(text: str, value: str) -> tuple[int, int]:
    start = text.rindex(value)
    return start, start + len(value)


def main(argv: Sequence[str] | None = None) -> int:
    from transformers import AutoTokenizer

    from vllm_kvcomp.eval.haystack import essay_sentences
    from vllm_kvcomp.eval.tasks import TaskContext, generate
    from vllm_kvcomp.eval.tasks.sizing import load_counter
    from vllm_kvcomp.models import default_model_dir
    from vllm_kvcomp.oracle import load_model

    parser = argparse.ArgumentParser(prog="python3 -m vllm_kvcomp.eval.probe", description=__doc__)
    parser.add_argument("--samples", type=int, default=10)
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--ratio", type=float, default=0.25)
    parser.add_argument("--window", type=int, default=32, help="observation window to report")
    parser.add_argument("--block-size", type=int, default=128, help="the server's page size")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default=None, help="HF model folder (default: bundled)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    folder = Path(args.model) if args.model else default_model_dir()
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    model = load_model(folder)
    ctx = TaskContext(args.seed, load_counter(folder), essay_source=essay_sentences)
    out = []
    for i in range(args.samples):
        sample = generate(ctx, "niah", args.length, i)
        out.append(probe_sample(model, tokenizer, sample, args.ratio, args.window, args.block_size))
        Path(args.out).write_text(json.dumps(out), encoding="utf-8")
        print(f"sample {i} depth {sample.depth}: done", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
