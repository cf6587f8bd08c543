"""Multi-turn conversations with prefix caching: cache hits, TTFT and KV held per turn.

A conversation is a ``--doc-len``-token document, then ``--turns`` turns; each turn sends the
whole history (document, earlier questions and answers) plus a ``--question-len``-token
question and generates ``--answer-len`` tokens. Full cache and each compressed config run
``--conversations`` conversations each (their own documents), one request at a time, against
one ``vllm-kvcomp serve`` with prefix caching on. Per turn: prefix-cache hits over prompt
tokens (``vllm:prefix_cache_hits`` / ``vllm:prefix_cache_queries`` deltas), time to first token,
the gap to the second token (a compressed request's prompt-end compression runs before it), and the tokens kept per (layer, KV head) (usage ``kv_compression.tokens_kept``; full: the prompt).

::

    vllm-kvcomp bench multiturn                      # full, snapkv 0.25, lagkv 0.25 (~10 min)
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
from dataclasses import dataclass
from pathlib import Path

from vllm_kvcomp.bench.common import model_line, module_main, write_report
from vllm_kvcomp.bench.serving import gauges, header_for, kv_cache_groups, served, stream_completion

HITS, QUERIES = "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"


@dataclass
class Turn:
    prompt_tokens: int
    hit_tokens: float
    ttft_s: float
    second_s: float  # gap between the first and second token (the prompt-end compression runs there)
    kv_tokens: float  # usage tokens_kept: mean per (layer, KV head) after the last compression


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="model folder or fetchable name, e.g. gemma-3-270m (default: the bundled SmolLM2)")
    parser.add_argument("--served-name", default=None,
                        help="the name the server answers to (default: what `vllm-kvcomp serve MODEL` names it)")
    parser.add_argument("--configs", default="full,snapkv:0.25,lagkv:0.25", help="comma list of policy[:ratio]")
    parser.add_argument("--doc-len", type=int, default=2048)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--question-len", type=int, default=32)
    parser.add_argument("--answer-len", type=int, default=32)
    parser.add_argument("--conversations", type=int, default=3, help="per config; the table shows medians")
    parser.add_argument("--logs", type=Path, default=Path("bench-logs"), help="server logs folder")


async def _counters(client, url: str) -> dict[str, float]:
    return gauges((await client.get(f"{url}/metrics")).text, (HITS, QUERIES))


async def _conversation(url: str, args, header: str | None, seed: int) -> list[Turn]:
    import httpx

    rng = random.Random(seed)
    words = lambda n: [rng.randrange(10, 48000) for _ in range(n)]  # noqa: E731
    history = words(args.doc_len)
    turns = []
    async with httpx.AsyncClient(timeout=None) as client:
        for _ in range(args.turns):
            prompt = history + words(args.question_len)
            before = await _counters(client, url)
            stream = await stream_completion(client, url, args.served_name, prompt, args.answer_len, header,
                                             return_token_ids=True)
            after = await _counters(client, url)
            kv = (stream.usage or {}).get("kv_compression")
            held = len(prompt) + args.answer_len if kv is None else kv["tokens_kept"]
            turns.append(Turn(len(prompt), after.get(HITS, 0) - before.get(HITS, 0), stream.first - stream.sent,
                              stream.token_times[1] - stream.token_times[0], held))
            history = prompt + stream.token_ids
    return turns


def run(args: argparse.Namespace) -> int:
    from vllm_kvcomp.models import served_name

    args.served_name = args.served_name or served_name(args.model)
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    results: dict[str, list[list[Turn]]] = {}
    max_len = args.doc_len + args.turns * (args.question_len + args.answer_len) + 64
    pool = (args.conversations * len(configs) + 2) * (-(-max_len // 32)) * kv_cache_groups(args.model)
    with served(args.model, pool, 4, max_len, args.logs / "multiturn.log", prefix_caching=True) as url:
        asyncio.run(_conversation(url, args, None, seed=0))  # warm-up
        for i, config in enumerate(configs):
            policy, _, ratio = config.partition(":")
            header = header_for(policy, float(ratio) if ratio else None)
            results[config] = [asyncio.run(_conversation(url, args, header, seed=100 * (i + 1) + c))
                               for c in range(args.conversations)]
            print(config, [[(t.hit_tokens, round(t.ttft_s, 3)) for t in conv] for conv in results[config]],
                  flush=True)
    body = _report(args, results)
    print(body)
    write_report(args.out, args.command, body)
    return 0


def _median(runs: list[list[Turn]], turn: int, field: str) -> float:
    return statistics.median(getattr(conv[turn], field) for conv in runs)


def _report(args, results: dict[str, list[list[Turn]]]) -> str:
    full = results.get("full")
    lines = [f"{model_line(args.model)}, block size 32, prefix caching on; "
             f"{args.doc_len}-token document, {args.turns} turns of {args.question_len}-token questions and "
             f"{args.answer_len}-token answers; medians of {args.conversations} conversations per config "
             "(each its own document), one request at a time.", "",
             "| config | turn | prompt tokens | cache hits | hit rate | TTFT (s) | TTFT vs full | token 2 (s) "
             "| kept tokens / head (usage) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for config, runs in results.items():
        for t in range(args.turns):
            prompt = _median(runs, t, "prompt_tokens")
            hits, ttft = _median(runs, t, "hit_tokens"), _median(runs, t, "ttft_s")
            vs = f"{ttft / _median(full, t, 'ttft_s'):.2f}x" if full else "-"
            lines.append(f"| {config} | {t + 1} | {prompt:.0f} | {hits:.0f} | {hits / prompt:.1%} | {ttft:.3f} | "
                         f"{vs} | {_median(runs, t, 'second_s'):.3f} | {_median(runs, t, 'kv_tokens'):.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from vllm_kvcomp.bench import multiturn

    return module_main(multiturn, "multiturn", argv)


if __name__ == "__main__":
    raise SystemExit(main())
