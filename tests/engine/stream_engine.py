"""A vLLM engine with a given chunk size, run in its own process for tests/engine/test_streaming.py.

``python -m tests.engine.stream_engine MODEL CHUNK POOL MAX_LEN LONG_PROMPTS [CONNECTOR [TP [ARGS]]] < requests.json`` runs
each batch of requests to completion (step by step) and prints one JSON line per request: its
tokens, logprobs, ``kv_transfer_params['kvcomp']``, the chunk ends its prefill was cut at, per
decode forward the draft tokens it verified and the tokens it confirmed (speculative decoding),
and the peak number of KV blocks the batch held; then the pool's free count at the end. CONNECTOR 0 runs
plain vLLM (no kvcomp connector) for comparisons.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_engine(model_dir: Path, chunk: int, batches: list[list[dict]], pool: int = 160, max_len: int = 2048,
               long_prompts: bool = False, connector: bool = True, tensor_parallel: int = 1,
               engine_args: dict | None = None) -> tuple[list[dict], dict]:
    """Run ``batches`` (lists of :func:`engine_request`) on an engine in a child process; returns
    the per-request results and the pool's final free count. With ``tensor_parallel`` 2 each rank
    gets one core (vLLM's CPU backend refuses two ranks on one NUMA node otherwise);
    ``engine_args`` are more ``LLM`` keyword arguments (e.g. ``speculative_config``)."""
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "0|1"} if tensor_parallel > 1 else None
    proc = subprocess.run(
        [sys.executable, "-m", "tests.engine.stream_engine", str(model_dir), str(chunk), str(pool), str(max_len),
         "1" if long_prompts else "0", "1" if connector else "0", str(tensor_parallel), json.dumps(engine_args or {})],
        input=json.dumps(batches), capture_output=True, text=True, cwd=ROOT, timeout=900, env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    results = [json.loads(line[len("RESULT "):]) for line in lines if line.startswith("RESULT ")]
    free = next(json.loads(line[len("FREE "):]) for line in lines if line.startswith("FREE "))
    return results, free


def engine_request(name: str, prompt: list[int], spec: dict | None, max_tokens: int) -> dict:
    """One request of a batch: greedy, ``max_tokens`` tokens, ``spec`` as kvcomp_* extra args."""
    extra = {f"kvcomp_{k}": v for k, v in spec.items()} if spec else None
    return {"name": name, "prompt": prompt, "max_tokens": max_tokens, "extra": extra}


def _run_batch(engine, scheduler, pool, batch: list[dict]) -> list[dict]:
    from vllm import SamplingParams

    ids = []
    for i, req in enumerate(batch):
        sp = SamplingParams(max_tokens=req["max_tokens"], temperature=0.0, logprobs=0, ignore_eos=True,
                            extra_args=req.get("extra") or None)
        engine.add_request(f"{req['name']}-{i}", {"prompt_token_ids": req["prompt"]}, sp)
        ids.append(f"{req['name']}-{i}")
    ends: dict[str, list[int]] = {rid: [] for rid in ids}
    aborts = {rid: req["abort_after"] for rid, req in zip(ids, batch) if req.get("abort_after") is not None}
    peak, outputs, steps = 0, {}, 0
    forwards: dict[str, list[list[int]]] = {rid: [] for rid in ids}  # decode: [drafts, confirmed] per step
    while engine.has_unfinished_requests():
        steps += 1
        before = {rid: (r.num_computed_tokens, len(r.spec_token_ids or ())) for rid, r in scheduler.requests.items()
                  if r.num_computed_tokens >= r.num_prompt_tokens}
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out
        for rid in [rid for rid, after in aborts.items() if after == steps]:
            engine.abort_request([rid])
            del aborts[rid]
        for rid, request in scheduler.requests.items():
            name = next((i for i in ids if rid.startswith(i)), None)
            if name is not None and rid in before:
                computed, drafts = before[rid]
                forwards[name].append([drafts, request.num_computed_tokens - computed])
            prefilling = name is not None and request.num_computed_tokens <= request.num_prompt_tokens
            if prefilling and (not ends[name] or ends[name][-1] != request.num_computed_tokens):
                ends[name].append(request.num_computed_tokens)
        peak = max(peak, pool.num_gpu_blocks - 1 - pool.get_num_free_blocks())
    engine.step()  # the worker hears about the finished requests
    results = []
    for rid in ids:
        out = outputs.get(rid)
        if out is None:  # aborted: vLLM reports nothing more for it
            results.append({"name": rid, "aborted": True, "peak_blocks": peak})
            continue
        completion = out.outputs[0]
        results.append({
            "name": rid, "tokens": list(completion.token_ids),
            "logprobs": [lp[t].logprob for t, lp in zip(completion.token_ids, completion.logprobs or [])],
            "kvcomp": (out.kv_transfer_params or {}).get("kvcomp"), "finish_reason": completion.finish_reason,
            "chunk_ends": ends[rid], "peak_blocks": peak, "decode_forwards": forwards[rid],
        })
    return results


def main() -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    model, chunk, pool_blocks, max_len, long_prompts = sys.argv[1:6]
    connector = sys.argv[6] != "0" if len(sys.argv) > 6 else True
    tensor_parallel = int(sys.argv[7]) if len(sys.argv) > 7 else 1
    engine_args = json.loads(sys.argv[8]) if len(sys.argv) > 8 else {}
    from vllm import LLM

    from tests.helpers.tiny_llama import ENGINE_KV_CACHE_BYTES
    from vllm_kvcomp.engine.plugin import kv_transfer_config

    llm = LLM(model=model, dtype="float32", enforce_eager=True, block_size=32,
              num_gpu_blocks_override=int(pool_blocks), max_model_len=int(max_len), max_num_seqs=8,
              max_num_batched_tokens=int(chunk), enable_prefix_caching=False, tensor_parallel_size=tensor_parallel,
              distributed_executor_backend="uni" if tensor_parallel == 1 else "mp",
              kv_cache_memory_bytes=ENGINE_KV_CACHE_BYTES, seed=0,
              kv_transfer_config=kv_transfer_config(long_prompts=long_prompts == "1") if connector else None,
              **engine_args)
    engine = llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler
    pool = scheduler.kv_cache_manager.block_pool
    for batch in json.load(sys.stdin):
        for result in _run_batch(engine, scheduler, pool, batch):
            print("RESULT " + json.dumps(result), flush=True)
    print("FREE " + json.dumps({"free": pool.get_num_free_blocks(), "total": pool.num_gpu_blocks - 1}), flush=True)


if __name__ == "__main__":
    main()
