"""Compression cost: seconds spent compressing as a share of the time to first token, per policy.

One engine (bundled model, vLLM CPU, prefix caching off), one request at a time: a
``--prompt-len``-token random prompt, 3 output tokens. TTFT is the time from adding the request
to the engine's first output carrying a token; the prompt-end compression runs right after it,
before the second token, whose gap is reported too. Compression seconds come from the request's
``usage.kv_compression`` (every layer, one compression). Medians of ``--runs`` requests per
policy, full cache measured the same way. A policy that refuses ``--ratio`` on the model (razor,
duoattention: their retrieval heads alone hold more) runs at the smallest ratio it accepts.

::

    vllm-kvcomp bench cost                          # every policy at 2K, ratio 0.25 (~8 min)
    vllm-kvcomp bench cost --prompt-len 8000 --runs 3
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time

from vllm_kvcomp.bench.common import model_line, module_main, spec_xargs, write_report
from vllm_kvcomp.policies.registry import policy_names


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="model folder or fetchable name, e.g. gemma-3-270m (default: the bundled SmolLM2)")
    parser.add_argument("--prompt-len", type=int, default=2048)
    parser.add_argument("--ratio", type=float, default=0.25)
    parser.add_argument("--policies", default=",".join(policy_names()),
                        help="comma list of POLICY or POLICY:SETTINGS (header grammar); default: every policy")
    parser.add_argument("--runs", type=int, default=5)


def _one(engine, rid: str, prompt: list[int], extra: dict | None) -> tuple[float, float, float]:
    """(TTFT, gap to the second token, compression seconds) of one request run alone."""
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, extra_args=extra)
    start = time.perf_counter()
    engine.add_request(rid, {"prompt_token_ids": prompt}, sp)
    times: list[float] = []
    seconds = 0.0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.outputs and len(out.outputs[0].token_ids) > len(times):
                times.append(time.perf_counter() - start)
            if out.finished:
                seconds = ((out.kv_transfer_params or {}).get("kvcomp") or {}).get("compression_seconds", 0.0)
    return times[0], times[1] - times[0], seconds


def run(args: argparse.Namespace) -> int:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM

    from vllm_kvcomp.bench.serving import feasible_ratios
    from vllm_kvcomp.engine.plugin import kv_transfer_config
    from vllm_kvcomp.models import resolve_model
    from vllm_kvcomp.server.cli import cpu_kv_cache_bytes

    llm = LLM(model=resolve_model(args.model), dtype="float32", enforce_eager=True, block_size=32,
              max_model_len=args.prompt_len + 64, max_num_batched_tokens=max(2048, args.prompt_len),
              distributed_executor_backend="uni", enable_prefix_caching=False,
              kv_transfer_config=kv_transfer_config(), kv_cache_memory_bytes=cpu_kv_cache_bytes(), seed=0)
    engine, rng = llm.llm_engine, random.Random(0)
    prompt = lambda: [rng.randrange(10, 48000) for _ in range(args.prompt_len)]  # noqa: E731
    _one(engine, "warm-up", prompt(), None)
    rows = []
    labels = [p.strip() for p in args.policies.split(",") if p.strip()]
    floors = feasible_ratios(resolve_model(args.model), [label.partition(":")[0] for label in labels], [args.ratio])
    for policy in labels:
        name, _, settings = policy.partition(":")
        extra = spec_xargs(name, floors.get(name, [args.ratio])[0], settings)
        runs = [_one(engine, f"{policy}-{i}", prompt(), extra) for i in range(args.runs)]
        ttft, second, seconds = (statistics.median(r[i] for r in runs) for i in range(3))
        rows.append((policy, ttft, second, seconds))
        print(f"{policy:14s} ttft {ttft:.3f} s  token 2 {second:.3f} s  compression {seconds:.3f} s", flush=True)
    full = next((t for p, t, _, _ in rows if p == "full"), None)
    lifted = "".join(f"; {p} at {r[0]:g}" for p, r in floors.items())
    lines = [f"{model_line(args.model)}, {args.prompt_len}-token random prompt, ratio "
             f"{args.ratio:g}{lifted}, one request at a time, medians of {args.runs}.", "",
             "| policy | TTFT (s) | vs full | token 2 (s) | compression (s) | compression / TTFT |",
             "|---|---|---|---|---|---|"]
    for policy, ttft, second, seconds in rows:
        vs = f"{ttft / full:.2f}x" if full else "-"
        lines.append(f"| {policy} | {ttft:.3f} | {vs} | {second:.3f} | {seconds:.3f} | {seconds / ttft:.1%} |")
    body = "\n".join(lines)
    print(body)
    write_report(args.out, args.command, body)
    return 0


def main(argv: list[str] | None = None) -> int:
    from vllm_kvcomp.bench import cost

    return module_main(cost, "cost", argv)


if __name__ == "__main__":
    raise SystemExit(main())
