#!/usr/bin/env bash
# The reference evaluation (one sample per cell, superseded by docs/results/quality/): bundled SmolLM2 on vLLM CPU (float32).
# Starts the server with docs/results/quality/operator.yaml (razor/pod profiles from `vllm-kvcomp calibrate`),
# then runs every task at 1K/2K/4K tokens for full and every policy at ratios 0.5 and 0.25.
set -euo pipefail
cd "$(dirname "$0")/../../../.."
PORT=${PORT:-8765}
python3 -m vllm_kvcomp serve --host 127.0.0.1 --port "$PORT" --kv-compression-config docs/results/quality/operator.yaml &
trap 'kill %1' EXIT
until curl -sf "http://127.0.0.1:$PORT/health" >/dev/null; do sleep 2; done
python3 -m vllm_kvcomp eval --url "http://127.0.0.1:$PORT" --model SmolLM2-135M-Instruct \
  --tasks passkey5,passkey64,niah,multi_niah,multiturn \
  --policies full,streamingllm,snapkv,h2o,knorm,sagekv,lagkv,entropy,razor,pod --ratios 0.5,0.25 \
  --lengths 1k,2k,4k --samples 1 --seed 0 --concurrency 2 \
  --out docs/results/archive/reference/reference.jsonl --summary docs/results/archive/reference/reference.md \
  --plots docs/results/archive/reference
