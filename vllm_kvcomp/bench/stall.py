"""Stalls: the compression work one engine step carries, next to the median decode step of the
same batch, per policy (issue #69: no step should carry more than half a decode step of
compression work, so that no step with it is longer than 1.5x the median).

In-process engine (bundled model, vLLM CPU, prefix caching off): ``--streams`` uncompressed
requests decode while one request of ``N`` tokens (``--lengths``) arrives with the policy's spec,
is prefilled, compressed and decodes ``--decode-tokens`` tokens (recompressing where its policy
does), once per ``--compression-lag`` (set on the live worker between runs): 0 decides and packs
each compression inside a step (the prompt-end one when the step after the prompt's last chunk
binds, ``prefill=stream`` / ``block`` chunks and decode recompressions after a step's forward);
``auto`` decides the prompt-end one and recompressions on the side thread and packs them at a
later step (:mod:`vllm_kvcomp.engine.offload`). Every engine step is timed; the worker's
compressions come with their in-step seconds from its ``listeners`` (the engine runs in this
process), and a step during which a decision was being made off it counts as a step with
compression work. From the arriving request's first token on, the median step without
compression work is the batch's decode step; the table gives against it the most compression
work one step carried (the target: at most half of it), the longest step with compression work
(the target: at most 1.5x; a ``prefill=stream`` / ``block`` chunk's step is long by its own
prefill too), how many tokens each decision waited to be packed, and the longest step without
(the noise floor: full cache's row).

::

    vllm-kvcomp bench stall                                    # every policy, 2048 and 8000 tokens
    vllm-kvcomp bench stall --policies h2o,snapkv:decode=recompress --lengths 2048 --compression-lag auto
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import random
import statistics
import time
from dataclasses import dataclass, field

from vllm_kvcomp.bench.common import model_line, module_main, spec_xargs, write_report
from vllm_kvcomp.policies.registry import policy_names

STREAM_PROMPT = 256  # tokens of each decoding stream's prompt


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="model folder or fetchable name (default: the bundled SmolLM2)")
    parser.add_argument("--lengths", default="2048,8000", help="prompt lengths of the arriving request")
    parser.add_argument("--ratio", type=float, default=0.25,
                        help="kept fraction (a policy that refuses it on this model runs at the smallest it accepts)")
    parser.add_argument("--policies", default=",".join(policy_names()),
                        help="comma list of POLICY or POLICY:SETTINGS (header grammar, e.g. "
                             "'snapkv:decode=recompress'); full is the control (default: every policy)")
    parser.add_argument("--streams", type=int, default=4, help="uncompressed requests decoding meanwhile")
    parser.add_argument("--decode-tokens", type=int, default=96, help="output tokens of the arriving request")
    parser.add_argument("--chunk", type=int, default=2048, help="tokens per engine step (the prefill chunk)")
    parser.add_argument("--server", action="store_true",
                        help="through `vllm-kvcomp serve` (one server per --compression-lag) instead of "
                             "in-process: the streams' longest inter-token gap while the request decodes, "
                             "against their median")
    parser.add_argument("--compression-lag", default="0,auto",
                        help="comma list of the engine's compression_lag values to run each config at, side by "
                             "side: 0 (inside the step), auto (decided off the step, packed when ready), k steps")


@dataclass
class Step:
    seconds: float
    compression: float  # seconds of compression work in this step
    kinds: list[str] = field(default_factory=list)  # "prompt end", "prefill chunk", "decode"
    in_flight: bool = False  # a compression was being decided off the step during it

    @property
    def loaded(self) -> bool:
        return bool(self.kinds) or self.in_flight


@dataclass
class Stalls:
    label: str
    length: int
    median: float  # median step without compression work, after the request's first token
    longest: Step | None  # the longest step with compression work
    heaviest: Step | None  # the step with the most compression work
    other: float  # the longest step without compression work
    compressions: int
    lags: list[int]  # tokens decoded between each decision and its packing (0: inside the step)


class CompressionClock:
    """The worker's compressions of the current step (the engine runs in this process)."""

    def __init__(self, length: int = 0) -> None:
        self.step = Step(0.0, 0.0)
        self.length = length  # the arriving request's prompt: a compression before it is a chunk's
        self.packed = 0  # compressions packed (their events)
        self.lags: list[int] = []  # tokens decoded between each decision and its packing

    def __call__(self, event) -> None:
        self.step.compression += event.step_seconds
        kind = "decode" if event.decode else "prefill chunk" if event.num_tokens < self.length else "prompt end"
        self.step.kinds.append(kind)
        self.packed += 1
        self.lags.append(event.switched - event.num_tokens)


@dataclass
class Gaps:
    """Through the server: the streams' inter-token gaps while the arriving request decoded."""

    label: str
    length: int
    median: float  # the streams' median gap in that window
    longest: float  # their longest gap in it
    compressions: int  # the arriving request's (its usage)


def run(args: argparse.Namespace) -> int:
    if args.server:
        return _run_server(args)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the worker runs here: its compressions are timed
    from vllm import LLM

    from vllm_kvcomp.bench.serving import feasible_ratios
    from vllm_kvcomp.engine.plugin import active_worker, kv_transfer_config
    from vllm_kvcomp.models import resolve_model
    from vllm_kvcomp.server.cli import cpu_kv_cache_bytes

    lengths = [int(n) for n in args.lengths.split(",") if n.strip()]
    labels = [p.strip() for p in args.policies.split(",") if p.strip()]
    model = resolve_model(args.model)
    floors = feasible_ratios(model, [label.partition(":")[0] for label in labels], [args.ratio])
    llm = LLM(model=model, dtype="float32", enforce_eager=True, block_size=32,
              max_model_len=max(lengths) + args.decode_tokens + 64, max_num_batched_tokens=args.chunk,
              distributed_executor_backend="uni", enable_prefix_caching=False,
              kv_transfer_config=kv_transfer_config(compression_lag=0),
              kv_cache_memory_bytes=cpu_kv_cache_bytes(), seed=0)
    clock = CompressionClock()
    worker = active_worker()
    worker.listeners.append(clock)
    rows, lags = [], [_lag(value.strip()) for value in args.compression_lag.split(",") if value.strip()]
    for n in lengths:
        for label in ["full", *(label for label in labels if label != "full")]:
            policy, _, settings = label.partition(":")
            ratio = floors.get(policy, [args.ratio])[0]
            for lag in lags[:1] if label == "full" else lags:
                worker.configure_offload(None if lag == "auto" else lag)  # the engine's compression_lag
                shown = label if label == "full" or len(lags) == 1 else f"{label}, lag {lag}"
                rows.append(_measure(llm.llm_engine, worker, clock, args, shown, n,
                                     spec_xargs(policy, ratio, settings)))
                _print(rows[-1])
    body = _report(args, rows, floors)
    print(body)
    write_report(args.out, args.command, body)
    return 0


def _lag(value: str) -> int | str:
    return value if value == "auto" else int(value)


def _measure(engine, worker, clock: CompressionClock, args: argparse.Namespace, label: str, n: int,
             extra: dict | None) -> Stalls:
    """One arriving request (``extra``'s spec) among ``args.streams`` decoding ones."""
    from vllm import SamplingParams

    rng = random.Random(n)
    stream = SamplingParams(max_tokens=100_000, temperature=0.0, ignore_eos=True)
    streams = [f"{label}-{n}-s{i}" for i in range(args.streams)]
    for rid in streams:
        engine.add_request(rid, {"prompt_token_ids": [rng.randrange(10, 48000) for _ in range(STREAM_PROMPT)]}, stream)
    for _ in range(3):  # every stream past its prefill
        engine.step()
    target = f"{label}-{n}"
    sp = SamplingParams(max_tokens=args.decode_tokens, temperature=0.0, ignore_eos=True, extra_args=extra)
    engine.add_request(target, {"prompt_token_ids": [rng.randrange(10, 48000) for _ in range(n)]}, sp)
    steps, started = [], False
    clock.length, clock.packed, clock.lags = n, 0, []
    while True:
        clock.step = Step(0.0, 0.0, in_flight=worker.in_flight > 0)
        t0 = time.perf_counter()
        outputs = engine.step()
        clock.step.seconds = time.perf_counter() - t0
        clock.step.in_flight |= worker.in_flight > 0
        mine = [o for o in outputs if o.request_id == target]
        if started or clock.step.loaded:
            steps.append(clock.step)
        started = started or any(o.outputs and o.outputs[0].token_ids for o in mine)
        if any(o.finished for o in mine):
            break
    engine.abort_request(streams)
    while engine.has_unfinished_requests():
        engine.step()
    plain = [s.seconds for s in steps if not s.loaded]  # none: decided off the step until the end
    loaded = [s for s in steps if s.loaded]
    return Stalls(label, n, statistics.median(plain or [s.seconds for s in steps]), max(loaded, key=lambda s: s.seconds, default=None),
                  max(loaded, key=lambda s: s.compression, default=None), max(plain, default=0.0), clock.packed,
                  clock.lags)


def _run_server(args: argparse.Namespace) -> int:
    """One ``vllm-kvcomp serve`` per ``--compression-lag``; in each, every config at every length."""
    import tempfile
    from pathlib import Path

    from vllm_kvcomp.bench.serving import feasible_ratios, header_for, served
    from vllm_kvcomp.models import resolve_model, served_name

    lengths = [int(n) for n in args.lengths.split(",") if n.strip()]
    labels = ["full", *(p.strip() for p in args.policies.split(",") if p.strip() and p.strip() != "full")]
    floors = feasible_ratios(resolve_model(args.model), [label.partition(":")[0] for label in labels], [args.ratio])
    rows, lags = [], [value.strip() for value in args.compression_lag.split(",") if value.strip()]
    max_len = max(lengths) + args.decode_tokens + 64
    blocks = (args.streams + 2) * (-(-max_len // 32) + 1)
    for lag in lags:
        log = Path(tempfile.gettempdir()) / f"kvcomp-stall-server-{lag}.log"
        with served(args.model, blocks, args.streams + 2, max_len, log,
                    ["--compression-lag", lag], chunk=args.chunk) as url:
            for n in lengths:
                for label in labels if lag == lags[0] else labels[1:]:
                    policy, _, settings = label.partition(":")
                    header = header_for(policy, floors.get(policy, [args.ratio])[0], settings.replace(",", ";"))
                    shown = label if label == "full" or len(lags) == 1 else f"{label}, lag {lag}"
                    rows.append(asyncio.run(_gaps(url, served_name(args.model), args, shown, n, header, max_len)))
                    print(f"{shown:32s} {n:6d}: streams' longest gap {rows[-1].longest / rows[-1].median:.2f}x "
                          f"their median ({1e3 * rows[-1].median:.1f} ms)", flush=True)
    body = _server_report(args, rows)
    print(body)
    write_report(args.out, args.command, body)
    return 0


def _server_report(args: argparse.Namespace, rows: list[Gaps]) -> str:
    lines = [f"{model_line(args.model)}, through `vllm-kvcomp serve` (one server per compression_lag), "
             f"block size 32, {args.chunk}-token steps; {args.streams} uncompressed streams ({STREAM_PROMPT}-token "
             f"prompts) decode while a request of N tokens at ratio {args.ratio:g} arrives and decodes "
             f"{args.decode_tokens} tokens. Gaps between the streams' tokens from its first token to its last. "
             "Target: the longest <= 1.5x the median.", "",
             "| config | N | streams' median gap ms | longest gap vs median (target <= 1.5) | compressions |",
             "|---|---:|---:|---:|---:|"]
    lines += [f"| {r.label} | {r.length} | {1e3 * r.median:.1f} | **{r.longest / r.median:.2f}x** | {r.compressions} |"
              for r in rows]
    return "\n".join(lines)


async def _gaps(url: str, model: str, args: argparse.Namespace, label: str, n: int, header: str | None,
                max_len: int) -> Gaps:
    import httpx

    from vllm_kvcomp.bench.serving import Stream, prompts, stream_completion

    async with httpx.AsyncClient(timeout=None) as client:
        records = [Stream(sent=time.perf_counter()) for _ in range(args.streams)]
        streams = [asyncio.create_task(stream_completion(client, url, model, prompt, max_len - STREAM_PROMPT, None,
                                                         into=record))
                   for prompt, record in zip(prompts(args.streams, STREAM_PROMPT, n), records)]
        while not all(len(record.token_times) > 8 for record in records):  # every stream decoding
            for task in streams:
                if task.done():
                    task.result()  # raises what stopped it
            await asyncio.sleep(0.1)
        arriving = await stream_completion(client, url, model, prompts(1, n, n + 1)[0], args.decode_tokens, header)
        for task in streams:
            task.cancel()  # closes its connection: the server aborts it
        await asyncio.gather(*streams, return_exceptions=True)
    gaps = [b - a for record in records for a, b in itertools.pairwise(record.token_times)
            if arriving.first <= a and b <= arriving.last]
    usage = (arriving.usage or {}).get("kv_compression") or {}
    return Gaps(label, n, statistics.median(gaps), max(gaps), int(usage.get("compressions", 0)))


def _kinds(step: Step) -> str:
    return ", ".join([*sorted(set(step.kinds)), *(["in flight"] if step.in_flight else [])])


def _lags(r: Stalls) -> str:
    return "-" if not r.lags else f"{min(r.lags)}-{max(r.lags)}" if len(set(r.lags)) > 1 else str(r.lags[0])


def _print(r: Stalls) -> None:
    worst = "no compression" if r.heaviest is None else (
        f"most compression work in a step {1e3 * r.heaviest.compression:.0f} ms "
        f"({r.heaviest.compression / r.median:.2f}x, {_kinds(r.heaviest)}), longest step with it "
        f"{1e3 * r.longest.seconds:.0f} ms ({r.longest.seconds / r.median:.2f}x), packed after {_lags(r)} tokens")
    print(f"{r.label:32s} {r.length:6d}: median step {1e3 * r.median:.1f} ms, {worst}", flush=True)


def _report(args: argparse.Namespace, rows: list[Stalls], floors: dict[str, list[float]]) -> str:
    lifted = "; ".join(f"{p} at {r[0]:g} (refuses {args.ratio:g})" for p, r in floors.items())
    lines = [f"{model_line(args.model)}, block size 32, {args.chunk}-token steps, each config at compression_lag "
             f"{args.compression_lag.replace(',', ', ')}; {args.streams} uncompressed "
             f"streams ({STREAM_PROMPT}-token prompts) decode while a request of N tokens at ratio {args.ratio:g} "
             f"arrives, is compressed and decodes {args.decode_tokens} tokens" + (f"; {lifted}" if lifted else "")
             + ". Steps from its first token on (and any step with compression work: in the step, or decided "
             "off it meanwhile). Targets: no step carries more than half a median decode step of compression "
             "work; no step with compression work is longer than 1.5x the median.", "",
             "| config | N | median step ms | most compression work in a step ms (kinds) | vs median (target "
             "<= 0.5) | longest step with compression vs median (target <= 1.5) | compressions | packed after "
             "(tokens) | longest other step vs median |",
             "|---|---:|---:|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        if r.heaviest is None:
            worst = "| - | - | - "
        else:
            worst = (f"| {1e3 * r.heaviest.compression:.0f} ({_kinds(r.heaviest)}) | "
                     f"**{r.heaviest.compression / r.median:.2f}x** | **{r.longest.seconds / r.median:.2f}x** ")
        lines.append(f"| {r.label} | {r.length} | {1e3 * r.median:.1f} {worst}| {r.compressions} | {_lags(r)} | "
                     f"{r.other / r.median:.2f}x |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from vllm_kvcomp.bench import stall

    return module_main(stall, "stall", argv)


if __name__ == "__main__":
    raise SystemExit(main())
