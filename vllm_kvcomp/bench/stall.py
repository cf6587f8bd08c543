"""Stalls: the compression work one engine step carries, next to the median decode step of the
same batch, per policy (issue #69: no step should carry more than half a decode step of
compression work, so that no step with it is longer than 1.5x the median).

In-process engine (bundled model, vLLM CPU, prefix caching off): ``--streams`` uncompressed
requests decode while one request of ``N`` tokens (``--lengths``) arrives with the policy's spec,
is prefilled, compressed and decodes ``--decode-tokens`` tokens (recompressing where its policy
does). Every engine step is timed; the worker's compressions come with their seconds from its
``listeners`` (the engine runs in this process; the prompt-end one runs when the step after the prompt's last chunk binds, ``prefill=stream`` /
``block`` chunks and decode recompressions after a step's forward). From the arriving request's
first token on, the median step without compression work is the batch's decode step; the table
gives against it the most compression work one step carried (the target: at most half of it),
the longest step with compression work (a ``prefill=stream`` / ``block`` chunk's step is long by
its own prefill too), and the longest step without (the noise floor: full cache's row).

::

    vllm-kvcomp bench stall                                    # every policy, 2048 and 8000 tokens
    vllm-kvcomp bench stall --policies h2o,snapkv:decode=recompress --lengths 2048
"""

from __future__ import annotations

import argparse
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


@dataclass
class Step:
    seconds: float
    compression: float  # seconds of compression work in this step
    kinds: list[str] = field(default_factory=list)  # "prompt end", "prefill chunk", "decode"


@dataclass
class Stalls:
    label: str
    length: int
    median: float  # median step without compression work, after the request's first token
    longest: Step | None  # the longest step with compression work
    heaviest: Step | None  # the step with the most compression work
    other: float  # the longest step without compression work
    compressions: int


class CompressionClock:
    """The worker's compressions of the current step (the engine runs in this process)."""

    def __init__(self, length: int = 0) -> None:
        self.step = Step(0.0, 0.0)
        self.length = length  # the arriving request's prompt: a compression before it is a chunk's

    def __call__(self, event) -> None:
        self.step.compression += event.seconds
        kind = "decode" if event.decode else "prefill chunk" if event.num_tokens < self.length else "prompt end"
        self.step.kinds.append(kind)


def run(args: argparse.Namespace) -> int:
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
              kv_transfer_config=kv_transfer_config(), kv_cache_memory_bytes=cpu_kv_cache_bytes(), seed=0)
    clock = CompressionClock()
    active_worker().listeners.append(clock)
    rows = []
    for n in lengths:
        for label in ["full", *(label for label in labels if label != "full")]:
            policy, _, settings = label.partition(":")
            ratio = floors.get(policy, [args.ratio])[0]
            rows.append(_measure(llm.llm_engine, clock, args, label, n, spec_xargs(policy, ratio, settings)))
            _print(rows[-1])
    body = _report(args, rows, floors)
    print(body)
    write_report(args.out, args.command, body)
    return 0


def _measure(engine, clock: CompressionClock, args: argparse.Namespace, label: str, n: int,
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
    steps, started, compressions = [], False, 0
    clock.length = n
    while True:
        clock.step = Step(0.0, 0.0)
        t0 = time.perf_counter()
        outputs = engine.step()
        clock.step.seconds = time.perf_counter() - t0
        compressions += len(clock.step.kinds)
        mine = [o for o in outputs if o.request_id == target]
        if started or clock.step.kinds:
            steps.append(clock.step)
        started = started or any(o.outputs and o.outputs[0].token_ids for o in mine)
        if any(o.finished for o in mine):
            break
    engine.abort_request(streams)
    while engine.has_unfinished_requests():
        engine.step()
    plain = [s.seconds for s in steps if not s.kinds]
    loaded = [s for s in steps if s.kinds]
    return Stalls(label, n, statistics.median(plain), max(loaded, key=lambda s: s.seconds, default=None),
                  max(loaded, key=lambda s: s.compression, default=None), max(plain), compressions)


def _print(r: Stalls) -> None:
    worst = "no compression" if r.heaviest is None else (
        f"most compression work in a step {1e3 * r.heaviest.compression:.0f} ms "
        f"({r.heaviest.compression / r.median:.2f}x, {', '.join(r.heaviest.kinds)}), longest step with it "
        f"{1e3 * r.longest.seconds:.0f} ms ({r.longest.seconds / r.median:.2f}x)")
    print(f"{r.label:32s} {r.length:6d}: median step {1e3 * r.median:.1f} ms, {worst}", flush=True)


def _report(args: argparse.Namespace, rows: list[Stalls], floors: dict[str, list[float]]) -> str:
    lifted = "; ".join(f"{p} at {r[0]:g} (refuses {args.ratio:g})" for p, r in floors.items())
    lines = [f"{model_line(args.model)}, block size 32, {args.chunk}-token steps; {args.streams} uncompressed "
             f"streams ({STREAM_PROMPT}-token prompts) decode while a request of N tokens at ratio {args.ratio:g} "
             f"arrives, is compressed and decodes {args.decode_tokens} tokens" + (f"; {lifted}" if lifted else "")
             + ". Steps from its first token on (and any step with compression work). Target: no step carries "
             "more than half a median decode step of compression work.", "",
             "| config | N | median step ms | most compression work in a step ms (kinds) | vs median (target "
             "<= 0.5) | longest step with compression vs median | compressions | longest other step vs median |",
             "|---|---:|---:|---|---:|---:|---:|---:|"]
    for r in rows:
        if r.heaviest is None:
            worst = "| - | - | - "
        else:
            worst = (f"| {1e3 * r.heaviest.compression:.0f} ({', '.join(sorted(set(r.heaviest.kinds)))}) | "
                     f"**{r.heaviest.compression / r.median:.2f}x** | {r.longest.seconds / r.median:.2f}x ")
        lines.append(f"| {r.label} | {r.length} | {1e3 * r.median:.1f} {worst}| {r.compressions} | "
                     f"{r.other / r.median:.2f}x |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from vllm_kvcomp.bench import stall

    return module_main(stall, "stall", argv)


if __name__ == "__main__":
    raise SystemExit(main())
