#!/usr/bin/env bash
# Gemma 3 270M (real weights, `vllm-kvcomp model fetch gemma-3-270m`) as a second column of the
# quality harness (issue #30): its 3 global layers compressed, its 15 sliding-window layers
# (512 tokens) left to vLLM. A base model, so plain completions (scope=all; scope=context needs
# chat messages).
#
#   bash docs/results/quality/run_gemma.sh                 # run, or resume after an interruption
#   REPORT_ONLY=1 bash docs/results/quality/run_gemma.sh   # rebuild gemma.md and the plots only
#
# One `vllm-kvcomp eval` through `vllm-kvcomp serve gemma-3-270m`, greedy, prompts fixed by
# --seed 0, at kept 0.25 of the global layers' KV: 20 samples per cell, full + 13 policies, 2
# tasks (560 samples, ~80 min on 2 cores; SAMPLES=5 is the first pilot's grid, whose samples are
# the first 5 of these). razor is left out: its shipped profile makes all 3 global KV heads
# retrieval heads (they keep everything: the server refuses any ratio below 1); duoattention has
# no profile for this model (its 3 compressed KV heads would be split 3 ways at most).
set -euo pipefail
cd "$(dirname "$0")/../../.."
PORT=${PORT:-8768}
OUT=docs/results/quality/gemma.jsonl
MODEL_DIR=${MODEL_DIR:-$HOME/.cache/vllm-kvcomp/models/gemma-3-270m}
POLICIES="full,streamingllm,snapkv,h2o,knorm,sagekv,lagkv,entropy,pod,keydiff,tova,pyramidkv,expected_attention,criticalkv,kvzap"
EVAL=(python3 -m vllm_kvcomp eval --model gemma-3-270m --api completions --tokenizer "$MODEL_DIR"
      --tasks passkey5,niah --policies "$POLICIES" --ratios 0.25 --lengths 2k
      --depths 0,25,50,75,100 --samples "${SAMPLES:-20}" --seed 0
      --out "$OUT" --summary "${OUT%.jsonl}.md" --plots "${OUT%.jsonl}")
if [[ -n "${REPORT_ONLY:-}" ]]; then
  exec "${EVAL[@]}" --report-only
fi
source docs/results/quality/serve.sh
serve "$PORT" gemma-3-270m --max-model-len 4096
"${EVAL[@]}" --url "http://127.0.0.1:$PORT" --concurrency 2 --max-errors 20
