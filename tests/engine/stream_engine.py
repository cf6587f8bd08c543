"""A vLLM engine with a given chunk size, run in its own process for tests/engine/test_streaming.py.

``python -m tests.engine.stream_engine MODEL CHUNK POOL MAX_LEN LONG_PROMPTS < requests.json`` runs
each batch of requests to completion (step by step) and prints one JSON line per request: its
tokens, logprobs, ``kv_transfer_params['kvcomp']``, the chunk ends its prefill was cut at, and the
peak number of KV blocks the batch held; then the pool's free count at the end.
"""

from __future__ import annotations

import json
import os
import sys


def _run_batch(engine, scheduler, pool, batch: list[dict]) -> list[dict]:
    from vllm import SamplingParams

    ids = []
    for i, req in enumerate(batch):
        sp = SamplingParams(max_tokens=req["max_tokens"], temperature=0.0, logprobs=0, ignore_eos=True,
                            extra_args=req.get("extra") or None)
        engine.add_request(f"{req['name']}-{i}", {"prompt_token_ids": req["prompt"]}, sp)
        ids.append(f"{req['name']}-{i}")
    ends: dict[str, list[int]] = {rid: [] for rid in ids}
    peak, outputs = 0, {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out
        for rid, request in scheduler.requests.items():
            name = next((i for i in ids if rid.startswith(i)), None)
            prefilling = name is not None and request.num_computed_tokens <= request.num_prompt_tokens
            if prefilling and (not ends[name] or ends[name][-1] != request.num_computed_tokens):
                ends[name].append(request.num_computed_tokens)
        peak = max(peak, pool.num_gpu_blocks - 1 - pool.get_num_free_blocks())
    engine.step()  # the worker hears about the finished requests
    results = []
    for rid in ids:
        out = outputs[rid]
        completion = out.outputs[0]
        results.append({
            "name": rid, "tokens": list(completion.token_ids),
            "logprobs": [lp[t].logprob for t, lp in zip(completion.token_ids, completion.logprobs or [])],
            "kvcomp": (out.kv_transfer_params or {}).get("kvcomp"), "finish_reason": completion.finish_reason,
            "chunk_ends": ends[rid], "peak_blocks": peak,
        })
    return results


def main() -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    model, chunk, pool_blocks, max_len, long_prompts = sys.argv[1:6]
    from vllm import LLM

    from vllm_kvcomp.engine.plugin import kv_transfer_config

    llm = LLM(model=model, dtype="float32", enforce_eager=True, block_size=32,
              num_gpu_blocks_override=int(pool_blocks), max_model_len=int(max_len), max_num_seqs=8,
              max_num_batched_tokens=int(chunk), distributed_executor_backend="uni", enable_prefix_caching=False,
              gpu_memory_utilization=0.1, kv_transfer_config=kv_transfer_config(long_prompts=long_prompts == "1"),
              seed=0)
    engine = llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler
    pool = scheduler.kv_cache_manager.block_pool
    for batch in json.load(sys.stdin):
        for result in _run_batch(engine, scheduler, pool, batch):
            print("RESULT " + json.dumps(result), flush=True)
    print("FREE " + json.dumps({"free": pool.get_num_free_blocks(), "total": pool.num_gpu_blocks - 1}), flush=True)


if __name__ == "__main__":
    main()
