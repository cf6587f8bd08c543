#!/usr/bin/env bash
# The powered run of issue #27 with the leaderboard's protocol: every policy at kept 0.5 / 0.25 /
# 0.125 (0.25 is the leaderboard's operating point, run first), scope=context (the document
# compressed, the question sent apart and kept), bundled SmolLM2 on vLLM CPU (float32), 2K tokens,
# RULER-style tasks.
#
#   bash docs/results/quality/run_context.sh                 # run, or resume after an interruption
#   REPORT_ONLY=1 bash docs/results/quality/run_context.sh   # rebuild context_<scope>.md and the plots only
#   SCOPE=all bash docs/results/quality/run_context.sh       # the same cells with the question compressed too
#   RATIOS=0.25 bash docs/results/quality/run_context.sh     # the leaderboard's operating point only
#
# One `vllm-kvcomp eval` through a default `vllm-kvcomp serve` (every policy allowed, shipped
# calibration profiles for razor / pod / duoattention / kvzap), greedy, prompts fixed by --seed 0, 20
# samples per (task, condition), sample-major (an interrupted run leaves every cell with about
# the same n). Two policies cannot reach 0.25 with this model's shipped profiles (the server
# answers 400 naming the feasible range): razor's 24 retrieval heads hold 0.267 of the cache by
# themselves, so it runs at 0.3; duoattention's gate threshold makes 43 of the 90 (layer, KV
# head) pairs retrieval heads (0.478), so it runs with sparsity=0.9 (9 retrieval heads, the rest
# sink + recent) at 0.25, and with sparsity=0.8 (18 retrieval heads; added 2026-11-27, the best
# cell of the powered run at 0.25). At 0.5 razor, duoattention (its default split) and
# duoattention sparsity=0.8 run too; at 0.125 only duoattention sparsity=0.9 of the calibrated
# ones fits (all four checked against the server before the run). passkey is left out: with the question in a message of its own the
# 135M model answers it without reading the document even with full cache (0/8 in
# docs/results/archive/scope_pilot/scope_pilot.md), so it would measure nothing about the policies; so is RULER's
# variable tracking (vt): full cache answered 0 of its first 3 samples here (it lists the filler
# sentences as variables), while policies that happen to keep the assignments score above it.
#
# Output: docs/results/quality/context_<scope>.jsonl (one line per sample, appended and resumed),
# docs/results/quality/context_<scope>.md (n and Wilson 95 % intervals per cell),
# docs/results/quality/context_<scope>/*.png, and README.md's quality table (both scopes) regenerated.
set -euo pipefail
cd "$(dirname "$0")/../../.."
PORT=${PORT:-8767}
SCOPE=${SCOPE:-context}
OUT=docs/results/quality/context_$SCOPE.jsonl
RATIOS=${RATIOS:-0.5,0.25,0.125}
POLICIES="full,streamingllm,snapkv,h2o,knorm,sagekv,lagkv,entropy,pod"
POLICIES+=",keydiff,tova,pyramidkv,expected_attention,criticalkv,kvzap"
# the calibrated-head policies at the ratios their head split allows (pinned: the others are refused)
POLICIES+=",razor:ratio=0.3,duoattention:sparsity=0.9:ratio=0.25,duoattention:sparsity=0.8:ratio=0.25"
[[ ",$RATIOS," == *,0.5,* ]] && POLICIES+=",razor:ratio=0.5,duoattention:ratio=0.5,duoattention:sparsity=0.8:ratio=0.5"
[[ ",$RATIOS," == *,0.125,* ]] && POLICIES+=",duoattention:sparsity=0.9:ratio=0.125"
EVAL=(python3 -m vllm_kvcomp eval --model SmolLM2-135M-Instruct
      --tasks niah,multi_niah,cwe,fwe --policies "$POLICIES" --ratios "$RATIOS" --scope "$SCOPE"
      --lengths 2k --depths 0,25,50,75,100 --samples "${SAMPLES:-20}" --seed 0
      --out "$OUT" --summary "${OUT%.jsonl}.md" --plots "${OUT%.jsonl}")
if [[ -n "${REPORT_ONLY:-}" ]]; then
  exec "${EVAL[@]}" --report-only
fi
# Prefix caching (vLLM's default): a sample's document is the same under every condition and
# they go out one after another, so each document is prefilled about once.
source docs/results/quality/serve.sh
serve "$PORT"
"${EVAL[@]}" --url "http://127.0.0.1:$PORT" --concurrency 2 --max-errors 50
python3 -m vllm_kvcomp.eval.quality_table --write README.md  # README's quality table, both scopes
