"""Memory and throughput of kvcomp inside vLLM, full cache vs every policy, side by side.

(a) memory-bound: a fixed KV pool (``--pool-blocks``); N long requests at once. Reports the peak
    number of concurrently running requests and output tokens/s per policy x ratio, as ratios to
    ``full``, plus the ceiling: ``full`` at the best compressed concurrency with an unlimited pool.
(b) overhead: a pool large enough for everything; throughput compressed/full and compression
    time as a fraction of prefill time.

Each engine runs in its own subprocess (vLLM engines do not tear down cleanly in one process)
and warms up with one request before the first measured config. The defaults are the run in
docs/engine.md (bundled SmolLM2 on CPU; about 45 minutes on 2 cores)::

    vllm-kvcomp bench engine     # 24 x 2048-token requests, 396-block pool of 32-token blocks
    python -m vllm_kvcomp.bench.engine --skip-overhead

The tables are printed and written to ``--out`` (default docs/results/bench_engine.md).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from vllm_kvcomp.bench.common import module_main, write_report
from vllm_kvcomp.policies.registry import compressing_policy_names


def _run_engine(args: argparse.Namespace, pool_blocks: int, configs: list[tuple[str, float]]) -> list[dict]:
    """Child process body: one engine, every config in turn; returns one result per config."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import random

    from vllm import LLM, SamplingParams

    from vllm_kvcomp.engine.plugin import kv_transfer_config
    from vllm_kvcomp.server.cli import cpu_kv_cache_bytes

    llm = LLM(model=args.model, dtype="float32", enforce_eager=True, block_size=args.block_size,
              num_gpu_blocks_override=pool_blocks, max_model_len=args.prompt_len + args.output_len + 64,
              max_num_seqs=args.num_requests, max_num_batched_tokens=max(2048, args.prompt_len),
              distributed_executor_backend="uni", enable_prefix_caching=False,
              kv_transfer_config=kv_transfer_config(), seed=0, kv_cache_memory_bytes=cpu_kv_cache_bytes())
    engine = llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler
    rng = random.Random(0)
    vocab = llm.get_tokenizer().vocab_size
    prompts = [[rng.randrange(10, vocab) for _ in range(args.prompt_len)] for _ in range(args.num_requests)]
    warm = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompts[0]}], warm, use_tqdm=False)  # first-call costs out of every config
    results = []
    for policy, ratio in configs:
        extra = None if policy == "full" else {"kvcomp_policy": policy, "kvcomp_ratio": ratio}
        sp = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True, extra_args=extra)
        for i, prompt in enumerate(prompts):
            engine.add_request(f"{policy}-{ratio}-{i}", {"prompt_token_ids": prompt}, sp)
        peak, out_tokens, compress_s = 0, 0, 0.0
        prefill_s, start = 0.0, time.perf_counter()
        while engine.has_unfinished_requests():
            t0 = time.perf_counter()
            prefilling = bool(scheduler.waiting) or any(
                r.num_computed_tokens < r.num_prompt_tokens for r in scheduler.running
            )
            for out in engine.step():
                if out.finished:
                    out_tokens += len(out.outputs[0].token_ids)
                    stats = (out.kv_transfer_params or {}).get("kvcomp") or {}
                    compress_s += stats.get("compression_seconds", 0.0)
            if prefilling:
                prefill_s += time.perf_counter() - t0
            peak = max(peak, len(scheduler.running))
        wall = time.perf_counter() - start
        results.append({"policy": policy, "ratio": ratio, "pool_blocks": pool_blocks, "peak_running": peak,
                        "tokens_per_s": out_tokens / wall, "wall_s": wall, "compress_s": compress_s,
                        "prefill_s": prefill_s})
        print(json.dumps(results[-1]), file=sys.stderr, flush=True)
    return results


def _child(pool_blocks: int, configs: list[tuple[str, float]], num_requests: int) -> list[dict]:
    job = {"pool": pool_blocks, "configs": configs, "num_requests": num_requests}
    cmd = [sys.executable, "-m", "vllm_kvcomp.bench.engine", "--child", json.dumps(job), *_forwarded]
    done = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def _table(rows: list[dict], base: dict, title: str, ceiling: dict | None = None) -> str:
    lines = [title, f"{'policy':>13} {'ratio':>6} {'running':>8} {'x full':>7} {'tok/s':>8} {'x full':>7}"
             f" {'compress/prefill':>17}"]
    for r in rows:
        lines.append(
            f"{r['policy']:>13} {r['ratio']:>6} {r['peak_running']:>8} {r['peak_running'] / base['peak_running']:>7.2f}"
            f" {r['tokens_per_s']:>8.1f} {r['tokens_per_s'] / base['tokens_per_s']:>7.2f}"
            f" {r['compress_s'] / max(r['prefill_s'], 1e-9):>16.1%}"
        )
    if ceiling:
        lines.append(f"{'ceiling':>13} {'full':>6} {ceiling['peak_running']:>8} {'':>7} {ceiling['tokens_per_s']:>8.1f}"
                     f"  (full, unlimited pool, same concurrency)")
    return "\n".join(lines)


_forwarded: list[str] = []  # this run's own flags, handed to the engine subprocesses
_NOT_FORWARDED = ("child", "skip_overhead", "skip_memory", "overhead_requests", "out", "command")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="HF model folder (default: the bundled SmolLM2)")
    parser.add_argument("--prompt-len", type=int, default=2048)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--num-requests", type=int, default=24)
    parser.add_argument("--pool-blocks", type=int, default=396, help="KV pool for the memory-bound run")
    parser.add_argument("--block-size", type=int, default=32, help="a multiple of 32 on vLLM CPU")
    parser.add_argument("--policies", default=",".join(compressing_policy_names()),
                        help="default: every policy but full (the baseline, always run)")
    parser.add_argument("--ratios", default="0.5,0.25")
    parser.add_argument("--overhead-requests", type=int, default=6, help="requests in the overhead run (b)")
    parser.add_argument("--skip-overhead", action="store_true", help="only the memory-bound run (a)")
    parser.add_argument("--skip-memory", action="store_true", help="only the overhead run (b)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)


def run(args: argparse.Namespace) -> int:
    from vllm_kvcomp.models import default_model_dir

    args.model = args.model or str(default_model_dir())
    if args.child:
        job = json.loads(args.child)
        args.num_requests = job["num_requests"]
        print(json.dumps(_run_engine(args, job["pool"], [tuple(c) for c in job["configs"]])))
        return 0
    _forwarded[:] = [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
                     if k not in _NOT_FORWARDED and v is not None]
    policies = [p for p in args.policies.split(",") if p]
    ratios = [float(r) for r in args.ratios.split(",")]
    configs = [("full", 1.0)] + [(p, r) for r in ratios for p in policies]
    per_request = -(-(args.prompt_len + args.output_len) // args.block_size) + 1
    report: list[str] = []
    if not args.skip_memory:
        bounded = _child(args.pool_blocks, configs, args.num_requests)
        best = max(bounded[1:], key=lambda r: r["peak_running"], default=bounded[0])
        ceiling = _child(per_request * best["peak_running"] + 8, [("full", 1.0)], best["peak_running"])[0]
        report.append(_table(bounded[1:], bounded[0], f"(a) memory-bound: pool {args.pool_blocks} blocks x "
                             f"{args.block_size}, {args.num_requests} requests of {args.prompt_len}+"
                             f"{args.output_len} tokens", ceiling))
        report.append("throughput / ceiling: " + ", ".join(
            f"{r['policy']}@{r['ratio']}={r['tokens_per_s'] / ceiling['tokens_per_s']:.2f}" for r in bounded[1:]))
        print("\n".join(report[-2:]))
    if not args.skip_overhead:
        large = per_request * args.overhead_requests + 8
        overhead = _child(large, configs, args.overhead_requests)
        report.append(_table(overhead[1:], overhead[0], f"(b) overhead: pool {large} blocks (everything fits)"))
        print(report[-1])
    # fixed-width tables: a code block keeps their columns in rendered markdown
    write_report(args.out, args.command, "```\n" + "\n".join(report) + "\n```")
    return 0


def main(argv: list[str] | None = None) -> int:
    return module_main(sys.modules[__name__], "engine", argv)


if __name__ == "__main__":
    sys.exit(main())
