"""Memory during prefill: compressing after every chunk (``prefill=stream``) vs at the end vs full.

For each prompt length, one request at a time is prefilled in ``--chunk``-token chunks (vLLM's
``max_num_batched_tokens``) on the bundled model; after every engine step the KV blocks the
request holds are read from vLLM's block pool. Reported: the peak blocks during prefill (and as a
fraction of full cache's peak) and the prefill time (add -> first token), each config side by side
with full cache in one run. A last engine has a pool of ``--small-pool`` blocks and
``--allow-prompts-beyond-kv-cache``: a prompt ``--times``x its size completes only when streamed.

::

    vllm-kvcomp bench prefill                          # 4K, 256-token chunks, and a 4x-pool prompt (~4 min)
    vllm-kvcomp bench prefill --lengths 4096 --policies streamingllm
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from vllm_kvcomp.bench.common import model_line, module_main, write_report
from vllm_kvcomp.policies.registry import streaming_policy_names

POLICIES = streaming_policy_names()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="model folder or fetchable name, e.g. gemma-3-270m (default: the bundled SmolLM2)")
    parser.add_argument("--lengths", default="4096", help="prompt lengths (the bundled model has 8K positions)")
    parser.add_argument("--chunk", type=int, default=256)
    parser.add_argument("--ratio", type=float, default=0.25)
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--small-pool", type=int, default=60,
                        help="blocks of the last engine's pool (x --times x 32 tokens must stay under the model's 8K positions)")
    parser.add_argument("--times", type=int, default=4, help="prompt of that engine = times x its pool")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)


def _child(args: argparse.Namespace) -> None:
    """One engine (settings in --child as JSON), every request in turn; prints one JSON line each."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import random

    from vllm import SamplingParams

    from vllm_kvcomp.engine.plugin import kv_transfer_config
    from vllm_kvcomp.server.cli import cpu_kv_cache_bytes

    job = json.loads(args.child)
    from vllm import LLM

    from vllm_kvcomp import vllm_compat

    llm = LLM(model=job["model"], dtype="float32", enforce_eager=True, block_size=32,
              num_gpu_blocks_override=job["pool"], max_model_len=job["max_len"], max_num_seqs=4,
              max_num_batched_tokens=job["chunk"], distributed_executor_backend="uni", enable_prefix_caching=False,
              kv_cache_memory_bytes=cpu_kv_cache_bytes(), seed=0, kv_transfer_config=kv_transfer_config(long_prompts=job["long"]))
    engine = llm.llm_engine
    manager = engine.engine_core.engine_core.scheduler.kv_cache_manager
    rng = random.Random(0)
    for n, header in job["requests"]:
        extra = {f"kvcomp_{k}": v for k, v in header.items()} or None
        engine.add_request(f"r{n}", {"prompt_token_ids": [rng.randrange(10, 40000) for _ in range(n)]},
                           SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, extra_args=extra))
        start, first, peak = time.perf_counter(), None, 0
        while engine.has_unfinished_requests():
            outputs = engine.step()
            held = vllm_compat.pool_blocks(manager) - 1 - vllm_compat.free_block_count(manager)
            peak = max(peak, held)
            if first is None and any(o.outputs and o.outputs[0].token_ids for o in outputs):
                first = time.perf_counter() - start
        engine.step()
        print("ROW " + json.dumps({"n": n, "spec": header, "peak": peak, "prefill_s": first}), flush=True)


def _run(model: str, pool: int, max_len: int, chunk: int, long: bool, requests: list) -> list[dict]:
    job = {"model": model, "pool": pool, "max_len": max_len, "chunk": chunk, "long": long, "requests": requests}
    proc = subprocess.run([sys.executable, "-m", "vllm_kvcomp.bench.prefill", "--child", json.dumps(job)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-3000:])
    return [json.loads(line[4:]) for line in proc.stdout.splitlines() if line.startswith("ROW ")]


def run(args: argparse.Namespace) -> int:
    if args.child:
        _child(args)
        return 0
    from vllm_kvcomp.models import resolve_model

    model = resolve_model(args.model)
    lengths = [int(n) for n in args.lengths.split(",")]
    policies = [p for p in args.policies.split(",") if p]
    requests = []
    for n in lengths:
        requests.append([n, {}])
        for policy in policies:
            for prefill in ("end", "stream"):
                requests.append([n, {"policy": policy, "ratio": args.ratio, "prefill": prefill}])
    rows = _run(model, max(lengths) // 32 + 64, max(lengths) + 64, args.chunk, False, requests)
    small = args.small_pool * 32 * args.times
    streamed = [[small, {"policy": p, "ratio": min(args.ratio, 0.125), "prefill": "stream"}] for p in policies]
    rows += _run(model, args.small_pool + 1, small + 64, args.chunk, True, streamed)
    body = _report(args, rows, small)
    print(body)
    write_report(args.out, args.command, body)
    return 0


def _report(args: argparse.Namespace, rows: list[dict], small: int) -> str:
    full = {r["n"]: r for r in rows if not r["spec"]}
    lines = [f"{model_line(args.model)}, block size 32, {args.chunk}-token prefill chunks, "
             "one request at a time, 2 output tokens.", "",
             "| prompt | policy | prefill | peak KV blocks | vs full | prefill s | vs full | vs at-end |",
             "|---|---|---|---|---|---|---|---|"]
    at_end = {(r["n"], r["spec"].get("policy")): r for r in rows if r["spec"].get("prefill") == "end"}
    for r in rows:
        spec = r["spec"]
        base = full.get(r["n"])
        label = "full" if not spec else f"{spec['policy']} {spec['ratio']:g}"
        peak_vs = f"{r['peak'] / base['peak']:.2f}x" if base else "full cannot run"
        time_vs = f"{r['prefill_s'] / base['prefill_s']:.2f}x" if base else "-"
        end = at_end.get((r["n"], spec.get("policy")))
        end_vs = f"{r['prefill_s'] / end['prefill_s']:.2f}x" if end and spec.get("prefill") == "stream" else "-"
        lines.append(f"| {r['n']} | {label} | {spec.get('prefill', '-')} | {r['peak']} | {peak_vs} | "
                     f"{r['prefill_s']:.1f} | {time_vs} | {end_vs} |")
    lines += ["", f"The {small}-token prompts ran on a pool of {args.small_pool} blocks ({args.small_pool * 32} "
              f"tokens; {args.times}x smaller than the prompt) with --allow-prompts-beyond-kv-cache: vLLM would "
              "not start such an engine otherwise, and a full-cache request for them gets HTTP 400 from the server."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from vllm_kvcomp.bench import prefill

    return module_main(prefill, "prefill", argv)


if __name__ == "__main__":
    raise SystemExit(main())
