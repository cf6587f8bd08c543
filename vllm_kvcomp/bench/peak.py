"""Peak KV one request holds around its compaction, through the server, every policy vs full.

One ``vllm-kvcomp serve`` (prefix caching on, as by default: compressed requests share the cache
and pack into spare blocks, copy-on-compress) runs, one at a time, a full-cache request and one
request per policy (and benchmarked variant) on a prompt nobody sent before, while vLLM's own
gauge ``vllm:kv_cache_usage_perc`` is sampled every ``--period`` seconds. Per request: the peak
blocks held, the mean held after the first token, and the kept fraction it reports. The target
(issue #31): peak <= the full request's prompt blocks + its kept blocks + 2 blocks. Usage::

    vllm-kvcomp bench peak                        # bundled model, ratio 0.25, ~2.1K-token prompts
"""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
from dataclasses import dataclass
from pathlib import Path

from vllm_kvcomp.bench.common import module_main, write_report
from vllm_kvcomp.bench.serving import (
    MetricsSampler,
    feasible_ratios,
    header_for,
    prompts,
    served,
    stream_completion,
)
from vllm_kvcomp.models import MODEL_NAME, fetch_default_model
from vllm_kvcomp.policies.registry import compressing_policy_names, policy_variants

USAGE = "vllm:kv_cache_usage_perc"
BLOCK = 32


@dataclass
class Peak:
    label: str
    peak_blocks: float
    mean_blocks: float
    kept_fraction: float
    refused: str | None = None  # the server's 400 (e.g. razor below its retrieval heads' share)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="model folder (default: the bundled model)")
    p.add_argument("--served-name", default=MODEL_NAME, help="the model name the server answers to")
    p.add_argument("--ratio", type=float, default=0.25)
    p.add_argument("--prompt-len", type=int, default=2100)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--pool-blocks", type=int, default=512)
    p.add_argument("--period", type=float, default=0.05, help="gauge sampling period, seconds")
    p.add_argument("--policies", help="comma list of policies (default: every policy and benchmarked variant)")
    p.add_argument("--log", type=Path, default=Path("/tmp/kvcomp_bench_peak.log"))


def configs(args: argparse.Namespace) -> list[tuple[str, str | None]]:
    """(label, header) of the full request and every policy variant asked for; a policy whose
    profile refuses ``--ratio`` on this model (razor, duoattention: their retrieval heads alone
    hold more) runs at the smallest ratio it accepts, named in its label."""
    names = tuple(args.policies.split(",")) if args.policies else compressing_policy_names()
    model_dir = Path(args.model) if args.model else fetch_default_model()
    feasible = feasible_ratios(model_dir, names, [args.ratio]) if model_dir.is_dir() else {}
    floors = {name: ratios[0] for name, ratios in feasible.items()}
    out: list[tuple[str, str | None]] = [("full", None)]
    for label, policy, settings in policy_variants(names):
        extra = "; ".join(f"{k}={v}" for k, v in settings.items())
        ratio = floors.get(policy, args.ratio) if not settings else args.ratio
        out.append((label if ratio == args.ratio else f"{label} at {ratio:g}", header_for(policy, ratio, extra)))
    return out


async def _one(url: str, args, label: str, header: str | None, prompt: list[int]) -> Peak:
    import httpx

    pool = args.pool_blocks - 1  # the gauge counts the usable pool (the null block excluded)
    async with httpx.AsyncClient(timeout=600) as client, MetricsSampler(url, (USAGE,), args.period) as sampler:
        try:
            stream = await stream_completion(client, url, args.served_name, prompt, args.max_tokens, header)
        except RuntimeError as err:
            if not str(err).startswith("HTTP 400"):
                raise
            return Peak(label, 0.0, 0.0, 0.0, refused=str(err)[:160])
        await asyncio.sleep(2 * args.period)
    held = sampler.values(USAGE, stream.sent, stream.last)
    decode = sampler.values(USAGE, stream.first, stream.last) or held
    kept = (stream.usage or {}).get("kv_compression", {}).get("kept_fraction", 1.0)
    return Peak(label, max(held, default=0.0) * pool, sum(decode) / max(len(decode), 1) * pool, float(kept))


async def _all(url: str, args) -> list[Peak]:
    cases = configs(args)
    texts = prompts(len(cases), args.prompt_len, seed=4242)  # unique: no prefix-cache hit between them
    out = []
    for (label, header), prompt in zip(cases, texts, strict=True):
        out.append(await _one(url, args, label, header, prompt))
        print(f"{label}: peak {out[-1].peak_blocks:.1f} blocks", flush=True)
    return out


def table(args, peaks: list[Peak]) -> str:
    full = peaks[0]
    prompt_blocks = math.ceil(args.prompt_len / BLOCK)
    lines = [f"prompt {args.prompt_len} tokens ({prompt_blocks} blocks of {BLOCK}), ratio {args.ratio:g}, "
             f"{args.max_tokens} new tokens, gauge every {args.period:g} s, prefix caching on", "",
             "| request | peak blocks | peak vs full | mean in decode vs full | kept | target: prompt + kept + 2 "
             "| met |", "|---|---:|---:|---:|---:|---:|---|"]
    for p in peaks:
        if p.refused:
            lines.append(f"| {p.label} | refused | | | | | {p.refused} |")
            continue
        target = prompt_blocks + math.ceil(p.kept_fraction * prompt_blocks) + 2
        met = "–" if p is full else "yes" if p.peak_blocks <= target + 0.5 else "**no**"
        lines.append(f"| {p.label} | {p.peak_blocks:.0f} | {p.peak_blocks / full.peak_blocks:.2f}x "
                     f"| {p.mean_blocks / full.mean_blocks:.2f}x | {p.kept_fraction:.2f} "
                     f"| {'–' if p is full else target} | {met} |")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    with served(args.model, args.pool_blocks, 4, args.prompt_len + args.max_tokens + 64, args.log,
                prefix_caching=True) as url:
        peaks = asyncio.run(_all(url, args))
    text = table(args, peaks)
    print(text)
    write_report(args.out, args.command, text)
    return 0


def main(argv: list[str] | None = None) -> int:
    return module_main(sys.modules[__name__], "peak", argv)


if __name__ == "__main__":
    sys.exit(main())
