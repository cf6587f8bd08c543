"""Packed per-head pages through the server: memory held, admission and decode speed vs full cache.

Every number comes from a running ``vllm-kvcomp serve`` of the bundled model (or ``--model``),
with full cache and every policy x ratio side by side in one run (2K-token random prompts,
block size 32):

- ``held``: a pool that fits everything; 4 concurrent streams per config. While all 4 decode
  (from the last stream's second token: its prompt-end compression is done, see ``Stream.decoding``),
  ``/metrics`` is sampled: KV blocks held per request (``vllm:kv_cache_usage_perc`` x pool / 4,
  vLLM's own gauge, the same for full and compressed) and the aggregate decode tokens/s (tokens
  that arrived in that window / its length); ``usage.kv_compression.kept_fraction`` too. Full
  cache runs first and last; the table uses their mean and shows both.
- ``admit``: a fixed pool (``--admit-pool`` blocks); ``--admit-requests`` clients at once, each
  ``--admit-tokens`` output tokens: the peak of ``vllm:num_requests_running``, watched until the
  pool bounds it (requests wait, KV use >= ``FULL_USAGE`` and no new peak for ``--admit-settle``
  seconds) or ``--admit-seconds`` pass; the table says which (a peak the window cut short is
  a lower bound: on a slow machine the prefill rate, not the memory, limits it).
- ``membound``: a pool of about two full-cache requests (``--membound-pool``), 8 clients at once,
  long outputs: output tokens/s over the whole run, at ``--membound-ratio``.
- ``limit``: every config at each ``--limit-lengths`` prompt length next to its physical limit, an
  uncompressed request whose prompt is as long as what the compressed one keeps (same kernel, same
  bytes read): decode tok/s side by side. ``--limit-mode concurrent`` runs each pair's two sides
  at once on two servers, each on half the cores, so that the machine's drift cancels.

::

    vllm-kvcomp bench pages                         # all three phases (about 2-3 hours on 2 cores)
    vllm-kvcomp bench pages --phases held --ratios 0.25
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from vllm_kvcomp.bench.common import model_line, module_main, write_report
from vllm_kvcomp.bench.serving import (
    MetricsSampler,
    Stream,
    header_for,
    kv_cache_groups,
    prompts,
    refusal,
    served,
    stream_completion,
)
from vllm_kvcomp.policies.registry import compressing_policy_names, policy_variants


def configs() -> list[tuple[str, str, str]]:
    """(label, policy, extra header settings) of every compressing policy and its ``VARIANTS``."""
    return [(label, policy, "; ".join(f"{key}={value}" for key, value in settings.items()))
            for label, policy, settings in policy_variants(compressing_policy_names())]


USAGE = "vllm:kv_cache_usage_perc"
LIMIT_MODES = ("sequential", "concurrent")
RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
#: KV use from which the admit phase counts the pool as full (a compressed request being
#: prefilled holds its whole prompt until its compression, so a full pool stops below 100 %)
FULL_USAGE = 0.8


@dataclass
class Admitted:
    running: int  # peak running requests
    usage: float  # peak KV-cache use, 0..1
    bound: str  # what ended the watch: "pool" (full, requests waiting), "clients" (all ran), "time"


@dataclass
class Held:
    blocks: float  # KV blocks held per request while all streams decode
    decode_tps: float  # aggregate decode tokens/s over that window
    kept_fraction: float


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="model folder or fetchable name, e.g. gemma-3-270m (default: the bundled SmolLM2)")
    parser.add_argument("--served-name", default=None,
                        help="the name the server answers to (default: what `vllm-kvcomp serve MODEL` names it)")
    parser.add_argument("--phases", default="held,admit,membound",
                        help="comma list of held, admit, membound, limit")
    parser.add_argument("--limit-lengths", default="2048,8000",
                        help="limit: prompt lengths (the bundled model has 8192 positions)")
    parser.add_argument("--limit-repeats", type=int, default=1,
                        help="limit: pairs (compressed, its limit) per config on new prompts; each side's best "
                             "counts (a shared machine's noise is ±10%% per run)")
    parser.add_argument("--limit-mode", choices=LIMIT_MODES, default="sequential",
                        help="limit: sequential = each pair back to back in one server; concurrent = two servers, "
                             "each on half the CPU cores, running each pair's two sides at once (sides swapped "
                             "every pair) and timing both over the window where both decode, so that a drift of "
                             "the machine's speed slows both alike")
    parser.add_argument("--policies", default=",".join(c[0] for c in configs()),
                        help="config labels to run; LABEL:SETTINGS adds header settings to one, e.g. "
                             "snapkv:decode=recompress (several: snapkv:decode=recompress;window=16)")
    parser.add_argument("--ratios", default="0.5,0.25,0.125")
    parser.add_argument("--prompt-len", type=int, default=2048)
    parser.add_argument("--decode-tokens", type=int, default=96, help="held: output tokens per stream")
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--admit-pool", type=int, default=16 * 66, help="admit: KV blocks (16 full requests; x the model's KV-cache groups)")
    parser.add_argument("--admit-requests", type=int, default=64)
    parser.add_argument("--admit-ratios", default="0.25", help="admit: ratios to run (each costs ~5 min)")
    parser.add_argument("--admit-seconds", type=float, default=900,
                        help="admit: watch at most this long, then cancel what is left")
    parser.add_argument("--admit-settle", type=float, default=60,
                        help="admit: the pool bounds the peak once requests wait at full KV use for this long "
                        "without a new peak")
    parser.add_argument("--admit-tokens", type=int, default=128,
                        help="admit: output tokens per request (long enough that the pool, not the prefill rate, "
                             "bounds how many run at once)")
    parser.add_argument("--membound-pool", type=int, default=2 * 72, help="membound: KV blocks (~2 full; x the model's KV-cache groups)")
    parser.add_argument("--membound-clients", type=int, default=8)
    parser.add_argument("--membound-tokens", type=int, default=256)
    parser.add_argument("--membound-ratio", type=float, default=0.25)
    parser.add_argument("--membound-chunk", type=int, default=2048,
                        help="membound: tokens per engine step (the prefill chunk); a smaller one lets a "
                             "prefill=stream request start with less free memory")
    parser.add_argument("--logs", type=Path, default=Path("bench-logs"), help="server logs folder")


def _configs(args: argparse.Namespace) -> list[tuple[str, str, str, float]]:
    """(label, policy, header settings, ratio) of every ``--policies`` entry at every ratio, in
    the registry's order; an entry ``LABEL:SETTINGS`` is LABEL's config with SETTINGS added
    (label ``LABEL SETTINGS``), next to LABEL's own when both are asked for."""
    known = configs()
    wanted: dict[str, list[str]] = {}
    for entry in (p.strip() for p in args.policies.split(",")):
        if entry:
            label, _, settings = entry.partition(":")
            wanted.setdefault(label.strip(), []).append(settings.strip())
    unknown = set(wanted) - {c[0] for c in known}
    if unknown:
        raise SystemExit(f"--policies: unknown {sorted(unknown)} (choose from {', '.join(c[0] for c in known)})")
    ratios = [float(r) for r in args.ratios.split(",")]
    out = []
    for ratio in ratios:
        for label, policy, extra in known:
            for settings in wanted.get(label, ()):
                header = "; ".join(p for p in (extra, settings) if p)
                name = f"{label} {settings}" if settings else label
                why = refusal(args.model, header_for(policy, ratio, header))
                if why is None:
                    out.append((name, policy, header, ratio))
                else:  # e.g. razor below its retrieval heads' share: the server says 400
                    print(f"skip {name} at {ratio:g}: the server refuses it: {why}", flush=True)
    return out


async def _streams(url: str, args, header: str | None, count: int, tokens: int, seed: int,
                   prompt_len: int | None = None):
    import httpx

    async with httpx.AsyncClient(timeout=None) as client:
        jobs = [stream_completion(client, url, args.served_name, p, tokens, header)
                for p in prompts(count, prompt_len or args.prompt_len, seed)]
        return await asyncio.gather(*jobs)


async def _held_one(url: str, args, header: str | None, seed: int, prompt_len: int | None = None) -> Held:
    async with MetricsSampler(url, (USAGE,)) as sampler:
        streams = await _streams(url, args, header, args.streams, args.decode_tokens, seed, prompt_len)
    start, end = _decode_window(streams)
    usage = sampler.values(USAGE, start, end)
    return replace(_held_in(streams, start, end),
                   blocks=statistics.median(usage) * args.pool_held / len(streams) if usage else float("nan"))


@dataclass
class Limit:
    """One compressed config at one prompt length next to its physical limit: an uncompressed
    request whose prompt is as long as what the compressed one keeps."""

    prompt_len: int
    compressed: Held
    limit_len: int
    limit: Held
    #: each pair's compressed decode tok/s over its limit's (pairs run back to back, so a drift
    #: of the machine's speed over the run cancels in each)
    pairs: tuple[float, ...] = ()

    @property
    def share(self) -> float:
        """Compressed decode tok/s over the limit's (the best run of each side)."""
        return self.compressed.decode_tps / self.limit.decode_tps


def _tps(held: Held) -> float:
    return held.decode_tps


def _limit_pool(args, lengths: list[int]) -> int:
    args.pool_held = (args.streams * (max(lengths) + args.decode_tokens) // 32 + 64) * kv_cache_groups(args.model)
    return args.pool_held


def _add_pair(best: Limit | None, n: int, compressed: Held, kept: int, limit: Held) -> Limit:
    """``best`` (the best run of each side so far) with one more pair."""
    pair = compressed.decode_tps / limit.decode_tps
    if best is None:
        return Limit(n, compressed, kept, limit, (pair,))
    return Limit(n, max(best.compressed, compressed, key=_tps), max(best.limit_len, kept),
                 max(best.limit, limit, key=_tps), (*best.pairs, pair))


def _phase_limit(args, configs) -> dict:
    """Each config at each ``--limit-lengths`` prompt length, then full cache with a prompt of the
    kept length (``kept_fraction`` x length, as reported), side by side in one server; full at
    every length too. ``--limit-mode concurrent``: :func:`_phase_limit_concurrent`."""
    if args.limit_mode == "concurrent":
        return _phase_limit_concurrent(args, configs)
    lengths = [int(n) for n in args.limit_lengths.split(",")]
    pool = _limit_pool(args, lengths)
    out: dict = {}
    with served(args.model, pool, 16, max(lengths) + args.decode_tokens + 64, args.logs / "limit.log") as url:
        asyncio.run(_held_one(url, args, None, seed=5, prompt_len=min(lengths)))  # warm-up
        for n in lengths:
            out[("full", n)] = asyncio.run(_held_one(url, args, None, seed=6 + n, prompt_len=n))
        for i, (label, policy, extra, ratio) in enumerate(configs):
            for n in lengths:
                best: Limit | None = None
                for repeat in range(args.limit_repeats):  # pairs on new prompts; the best of each side
                    seed = 100_000 + 1000 * i + n + 100 * repeat
                    compressed = asyncio.run(_held_one(url, args, header_for(policy, ratio, extra), seed, n))
                    kept = max(1, round(compressed.kept_fraction * n))
                    limit = asyncio.run(_held_one(url, args, None, seed + 500_000, kept))
                    _print_pair(label, ratio, n, compressed, kept, limit)
                    best = _add_pair(best, n, compressed, kept, limit)
                out[(label, ratio, n)] = best
    return out


def _print_pair(label: str, ratio: float, n: int, compressed: Held, kept: int, limit: Held) -> None:
    print(f"limit {label:16s} {ratio:<6g} {n:>5}: {compressed.decode_tps:.1f} tok/s vs {limit.decode_tps:.1f} at "
          f"{kept} tokens ({compressed.decode_tps / limit.decode_tps:.2f})", flush=True)


def limit_cores() -> tuple[list[int], list[int]]:
    """The CPU cores this process may use, in two halves (one per server of ``--limit-mode
    concurrent``); SystemExit on a single core."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        raise SystemExit(f"--limit-mode concurrent runs two servers on disjoint cores; this process has "
                         f"{len(cpus)} core (use --limit-mode sequential)")
    return cpus[: len(cpus) // 2], cpus[len(cpus) // 2 :]


def _phase_limit_concurrent(args, configs) -> dict:
    """:func:`_phase_limit` on two servers of the same settings, each on half the cores: each
    pair's compressed side on one and its limit on the other (swapped every pair, so that neither
    half's speed favours a side), the limit's streams sent so that both decode together, both
    timed over the window where every stream of both decodes (:func:`_pair_at_once`). The kept
    length comes first from one compressed request (its ``kept_fraction``); full at each length
    runs on both servers at once (their mean)."""
    lengths = [int(n) for n in args.limit_lengths.split(",")]
    pool, max_len = _limit_pool(args, lengths), max(lengths) + args.decode_tokens + 64
    halves = limit_cores()
    out: dict = {}
    with contextlib.ExitStack() as stack:
        urls = tuple(stack.enter_context(served(args.model, pool, 16, max_len, args.logs / f"limit-{side}.log",
                                                cpus=cores))
                     for side, cores in zip("ab", halves))
        asyncio.run(_pair_at_once(urls, args, None, 5, min(lengths), min(lengths)))  # warm-up
        for n in lengths:
            sides = asyncio.run(_pair_at_once(urls, args, None, 6 + n, n, n))  # at once
            print(f"limit full {n:>5} on both servers at once: {sides[0].decode_tps:.1f} and {sides[1].decode_tps:.1f} "
                  f"tok/s ({sides[0].decode_tps / sides[1].decode_tps:.2f})", flush=True)
            out[("full", n)] = _mean_held(list(sides))
        for i, (label, policy, extra, ratio) in enumerate(configs):
            header = header_for(policy, ratio, extra)
            for n in lengths:
                fraction = asyncio.run(_kept_fraction(urls[0], args, header, 200_000 + 1000 * i + n, n))
                kept = max(1, round(fraction * n))
                best: Limit | None = None
                for repeat in range(args.limit_repeats):
                    seed = 100_000 + 1000 * i + n + 100 * repeat
                    sides = urls if repeat % 2 == 0 else urls[::-1]
                    compressed, limit = asyncio.run(_pair_at_once(sides, args, header, seed, n, kept))
                    _print_pair(label, ratio, n, compressed, kept, limit)
                    best = _add_pair(best, n, compressed, kept, limit)
                out[(label, ratio, n)] = best
    return out


async def _kept_fraction(url: str, args, header: str | None, seed: int, prompt_len: int) -> float:
    """``usage.kv_compression.kept_fraction`` of one request of ``prompt_len`` new tokens (8 output
    tokens: the prompt-end compression runs in the step after the first token's)."""
    import httpx

    async with httpx.AsyncClient(timeout=None) as client:
        stream = await stream_completion(client, url, args.served_name, prompts(1, prompt_len, seed)[0], 8, header)
    return _kept(stream.usage or {})


async def _pair_at_once(urls: tuple[str, str], args, header: str | None, seed: int, prompt_len: int,
                        limit_len: int) -> tuple[Held, Held]:
    """``args.streams`` requests of ``prompt_len`` tokens with ``header`` on ``urls[0]`` and as
    many uncompressed ones of ``limit_len`` on ``urls[1]``, sent once all but the last
    ``streams · limit_len / prompt_len`` (rounded up) of the first have their first token: the
    limit's prefill, that much shorter, runs next to the last of theirs, so that the two decode
    together. Each side's decode tok/s over the window where all of them decode (blocks not
    sampled: nan)."""
    import httpx

    lead = args.streams - math.ceil(args.streams * limit_len / prompt_len)  # first tokens before the limit starts
    first_tokens, limit_starts = 0, asyncio.Event()
    if lead <= 0:
        limit_starts.set()

    def on_first() -> None:
        nonlocal first_tokens
        first_tokens += 1
        if first_tokens >= lead:
            limit_starts.set()

    async def limit_side(client) -> list[Stream]:
        await limit_starts.wait()
        return await asyncio.gather(*(stream_completion(client, urls[1], args.served_name, p, args.decode_tokens, None)
                                      for p in prompts(args.streams, limit_len, seed + 500_000)))

    async with httpx.AsyncClient(timeout=None) as client:
        compressed = asyncio.gather(*(stream_completion(client, urls[0], args.served_name, p, args.decode_tokens,
                                                        header, on_first=on_first)
                                      for p in prompts(args.streams, prompt_len, seed)))
        ours, theirs = await asyncio.gather(compressed, limit_side(client))
    start, end = both_decoding(ours, theirs)
    return _held_in(ours, start, end), _held_in(theirs, start, end)


def both_decoding(*sides: Sequence[Stream]) -> tuple[float, float]:
    """The window where every stream of every side decodes: from the latest second token
    (:attr:`Stream.decoding`) to the earliest last token. SystemExit when they never overlap
    (decode too short for its prefill: raise ``--decode-tokens``)."""
    start, end = _decode_window([s for side in sides for s in side])
    if end <= start:
        raise SystemExit("limit: the two sides never decoded at the same time; raise --decode-tokens")
    return start, end


def _decode_window(streams: Sequence[Stream]) -> tuple[float, float]:
    """(latest second token, earliest last token) of ``streams``: while all of them decode (empty
    when the second is not before the first)."""
    return max(s.decoding for s in streams), min(s.last for s in streams)


def _kept(usage: dict) -> float:
    """``usage.kv_compression.kept_fraction`` of one response (1.0: uncompressed)."""
    return (usage.get("kv_compression") or {}).get("kept_fraction", 1.0)


def _held_in(streams: Sequence[Stream], start: float, end: float) -> Held:
    """Decode tok/s of ``streams`` over ``(start, end]`` (nan when empty) and their mean
    kept_fraction; blocks nan."""
    tokens = sum(1 for s in streams for t in s.token_times if start < t <= end)
    fractions = [_kept(s.usage) for s in streams if s.usage]
    return Held(blocks=float("nan"), decode_tps=tokens / (end - start) if end > start else float("nan"),
                kept_fraction=statistics.mean(fractions) if fractions else float("nan"))


def _phase_held(args, configs) -> dict:
    args.pool_held = (args.streams * (args.prompt_len + args.decode_tokens) // 32 + 64) * kv_cache_groups(args.model)
    out: dict = {}
    with served(args.model, args.pool_held, 16, args.prompt_len + 512, args.logs / "held.log") as url:
        asyncio.run(_held_one(url, args, None, seed=1))  # warm-up
        out["full"] = [asyncio.run(_held_one(url, args, None, seed=2))]
        for i, (label, policy, extra, ratio) in enumerate(configs):
            out[(label, ratio)] = asyncio.run(_held_one(url, args, header_for(policy, ratio, extra), seed=10 + i))
            print(f"held  {label:16s} {ratio:<6g} {out[(label, ratio)]}", flush=True)
        out["full"].append(asyncio.run(_held_one(url, args, None, seed=8)))  # new prompts: no cache hits
    return out


def pool_bound(samples: list[tuple[float, dict[str, float]]], settle: float) -> bool:
    """Whether the pool bounds admission: over the last ``settle`` seconds of ``samples`` ((time,
    gauges), oldest first, covering more than ``settle``) requests waited, KV use stayed >=
    ``FULL_USAGE`` and the running count never rose above its earlier peak."""
    if not samples or samples[-1][0] - samples[0][0] <= settle:
        return False
    cut = samples[-1][0] - settle
    recent = [g for t, g in samples if t >= cut]
    before = [g.get(RUNNING, 0.0) for t, g in samples if t < cut]
    return (all(g.get(WAITING, 0.0) > 0 and g.get(USAGE, 0.0) >= FULL_USAGE for g in recent)
            and max(g.get(RUNNING, 0.0) for g in recent) <= max(before, default=0.0))


async def _admitted(url: str, args, header: str | None, seed: int) -> Admitted:
    """Peak running requests, watched until the pool bounds it (:func:`pool_bound`), every client
    has run, or ``--admit-seconds``; the rest are then cancelled (the server aborts them) and the
    server drains before the next config."""
    async with MetricsSampler(url, (RUNNING, WAITING, USAGE), period=0.5) as sampler:
        job = asyncio.ensure_future(_streams(url, args, header, args.admit_requests, args.admit_tokens, seed))
        deadline, bound = time.perf_counter() + args.admit_seconds, "time"
        while not job.done() and time.perf_counter() < deadline:
            await asyncio.sleep(1)
            if pool_bound(sampler.samples, args.admit_settle):
                bound = "pool"
                break
        if not job.done():
            job.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await job
        running, usage = max(sampler.values(RUNNING), default=0), max(sampler.values(USAGE), default=0.0)
        while sampler.values(RUNNING) and sampler.values(RUNNING)[-1] > 0:
            await asyncio.sleep(1)
    if bound == "time" and running >= args.admit_requests:
        bound = "clients"
    return Admitted(int(running), usage, bound)


def _phase_admit(args, configs) -> dict:
    ratios = {float(r) for r in args.admit_ratios.split(",")}
    configs = [c for c in configs if c[3] in ratios]
    out: dict = {}
    pool = args.admit_pool * kv_cache_groups(args.model)
    with served(args.model, pool, args.admit_requests, args.prompt_len + 64, args.logs / "admit.log") as url:
        out["full"] = asyncio.run(_admitted(url, args, None, seed=3))
        print(f"admit full {out['full']}", flush=True)
        for i, (label, policy, extra, ratio) in enumerate(configs):
            out[(label, ratio)] = asyncio.run(_admitted(url, args, header_for(policy, ratio, extra), seed=20 + i))
            print(f"admit {label:16s} {ratio:<6g} {out[(label, ratio)]}", flush=True)
    return out


async def _throughput(url: str, args, header: str | None, seed: int) -> float:
    started = time.perf_counter()
    streams = await _streams(url, args, header, args.membound_clients, args.membound_tokens, seed)
    return sum(len(s.token_times) for s in streams) / (time.perf_counter() - started)


def _phase_membound(args, configs) -> dict:
    out: dict = {}
    max_len = args.prompt_len + args.membound_tokens + 32
    labels = [c for c in configs if c[3] == configs[0][3]]
    pool = args.membound_pool * kv_cache_groups(args.model)
    with served(args.model, pool, args.membound_clients, max_len, args.logs / "membound.log",
                chunk=args.membound_chunk) as url:
        out["full"] = [asyncio.run(_throughput(url, args, None, seed=4))]
        for i, (label, policy, extra, _) in enumerate(labels):
            header = header_for(policy, args.membound_ratio, extra)
            out[label] = asyncio.run(_throughput(url, args, header, seed=30 + i))
            print(f"membound {label:16s} {out[label]:.1f} tok/s (full {out['full'][0]:.1f})", flush=True)
        out["full"].append(asyncio.run(_throughput(url, args, None, seed=5)))  # new prompts: no cache hits
    return out


def run(args: argparse.Namespace) -> int:
    from vllm_kvcomp.models import served_name

    args.served_name = args.served_name or served_name(args.model)
    configs = _configs(args)
    phases = {p.strip() for p in args.phases.split(",")}
    results = {
        "held": _phase_held(args, configs) if "held" in phases else None,
        "admit": _phase_admit(args, configs) if "admit" in phases else None,
        "membound": _phase_membound(args, configs) if "membound" in phases else None,
        "limit": _phase_limit(args, configs) if "limit" in phases else None,
    }
    body = _report(args, configs, results)
    print(body)
    write_report(args.out, args.command, body)
    return 0


def _report(args, configs, results) -> str:
    held, admit, membound = results["held"], results["admit"], results["membound"]
    sizes = [str(args.prompt_len)] if any(results[name] for name in ("held", "admit", "membound")) else []
    if results["limit"]:
        sizes += [n for n in args.limit_lengths.split(",") if n not in sizes]
    prompts = " / ".join(sizes) + "-token"
    lines = [f"{model_line(args.model)}, block size 32, "
             f"{prompts} random prompts, through `vllm-kvcomp serve`.", ""]
    if held or admit:
        lines += [_held_header(held, admit), "|" + "---|" * _columns(held, admit)]
        full_held = _mean_held(held["full"]) if held else None
        lines.append(_row("full", "-", full_held, full_held, admit and admit["full"], admit and admit["full"]))
        for label, _, _, ratio in configs:
            lines.append(_row(label, f"{ratio:g}", held and held[(label, ratio)], full_held,
                              admit and admit.get((label, ratio)), admit and admit["full"]))
        if held:
            a, b = held["full"]
            lines += ["", f"Full cache ran first and last: {a.decode_tps:.1f} and {b.decode_tps:.1f} decode tok/s, "
                      f"{a.blocks:.1f} and {b.blocks:.1f} blocks per request (the table uses their mean).",
                      f"held: {args.streams} streams x {args.decode_tokens} output tokens, pool {args.pool_held} blocks."]
        if admit:
            lines.append(f"admit: pool {args.admit_pool} blocks, {args.admit_requests} clients at once, "
                         f"{args.admit_tokens} output tokens each; peak running requests, watched until the pool "
                         f"bound it (requests waiting at >= {FULL_USAGE:.0%} KV use, no new peak for "
                         f"{args.admit_settle:g} s) or {args.admit_seconds:g} s passed (bound by: time, a lower "
                         "bound, marked >=).")
    if membound:
        full = statistics.mean(membound["full"])
        lines += ["", f"Memory-bound pool ({args.membound_pool} blocks, {args.membound_clients} clients, "
                  f"{args.membound_tokens} output tokens, {args.membound_chunk}-token steps), ratio "
                  f"{args.membound_ratio:g}: output tokens/s", "",
                  "| policy | tok/s | vs full |", "|---|---|---|",
                  f"| full | {full:.1f} (runs: {', '.join(f'{x:.1f}' for x in membound['full'])}) | 1.00x |"]
        lines += [f"| {k} | {v:.1f} | {v / full:.2f}x |" for k, v in membound.items() if k != "full"]
    if results["limit"]:
        lines += ["", *_limit_table(args, configs, results["limit"])]
    return "\n".join(lines)


def _limit_table(args, configs, limit: dict) -> list[str]:
    """Compressed decode next to its physical limit (full cache holding the kept length)."""
    repeats = args.limit_repeats > 1
    best = f", best of {args.limit_repeats} runs on new prompts per side" if repeats else ""
    if args.limit_mode == "concurrent":
        how = (" Each pair ran at once on two servers, each on half the CPU cores (sides swapped every pair), "
               "both timed over the window where every stream of both decodes; full at the prompt length: both "
               "servers at once, their mean.")
        pairs = " Pairs: each pair's ratio and their median." if repeats else ""
    else:
        how = ""
        pairs = (" Pairs: each pair's ratio (compressed, then its limit, back to back) and their median, which a "
                 "drift of the machine's speed over the run does not move.") if repeats else ""
    lines = [f"Decode at the physical limit ({args.streams} streams x {args.decode_tokens} output tokens{best}): each "
             "compressed config next to full cache with a prompt as long as what it keeps (the same kernel "
             f"reading the same bytes), and full cache at the whole length.{how}{pairs}", "",
             "| policy | ratio | prompt | kept_fraction | decode tok/s | limit: full at the kept length | "
             "vs limit | " + ("pairs (median) | " if repeats else "") + "full at the prompt length | vs full |",
             "|---|---|---|---|---|---|---|" + ("---|" if repeats else "") + "---|---|"]
    for label, _, _, ratio in configs:
        for key, entry in limit.items():
            if key[:2] != (label, ratio):
                continue
            full = limit[("full", entry.prompt_len)]
            pair_cell = (f"{', '.join(f'{x:.2f}' for x in entry.pairs)} ({statistics.median(entry.pairs):.2f}x) | "
                         if repeats else "")
            lines.append(f"| {label} | {ratio:g} | {entry.prompt_len} | {entry.compressed.kept_fraction:.3f} | "
                         f"{entry.compressed.decode_tps:.1f} | {entry.limit.decode_tps:.1f} ({entry.limit_len} "
                         f"tokens) | {entry.share:.2f}x | {pair_cell}{full.decode_tps:.1f} | "
                         f"{entry.compressed.decode_tps / full.decode_tps:.2f}x |")
    return lines


def _columns(held, admit) -> int:
    return 2 + (5 if held else 0) + (4 if admit else 0)


def _held_header(held, admit) -> str:
    cols = ["policy", "ratio"]
    if held:
        cols += ["KV blocks / request (decode)", "vs full", "kept_fraction", "decode tok/s (4 streams)", "vs full"]
    if admit:
        cols += ["max running (fixed pool)", "vs full", "peak KV use", "bound by"]
    return "| " + " | ".join(cols) + " |"


def _mean_held(runs: list[Held]) -> Held:
    return Held(*(statistics.mean(getattr(r, f) for r in runs) for f in ("blocks", "decode_tps", "kept_fraction")))


def _row(label, ratio, held, full_held, running, full_running) -> str:
    cells = [label, ratio]
    if held is not None:
        cells += [f"{held.blocks:.1f}", f"{held.blocks / full_held.blocks:.2f}x", f"{held.kept_fraction:.3f}",
                  f"{held.decode_tps:.1f}", f"{held.decode_tps / full_held.decode_tps:.2f}x"]
    if full_running is not None:
        if running is None:
            cells += ["-"] * 4
        else:
            low = ">= " if running.bound == "time" else ""
            cells += [f"{low}{running.running}", f"{low}{running.running / full_running.running:.2f}x",
                      f"{running.usage:.0%}", running.bound]
    return "| " + " | ".join(cells) + " |"


def main(argv: list[str] | None = None) -> int:
    from vllm_kvcomp.bench import pages

    return module_main(pages, "pages", argv)


if __name__ == "__main__":
    raise SystemExit(main())
