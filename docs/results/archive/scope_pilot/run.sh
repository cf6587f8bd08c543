#!/usr/bin/env bash
# Context-scope vs all-scope, side by side on one server (small: 2 tasks x 8 samples at 2K).
set -euo pipefail
for scope in all context; do
  python3 -m vllm_kvcomp eval --url http://localhost:8000 --model SmolLM2-135M-Instruct \
    --tasks passkey5,niah --lengths 2k --samples 8 --seed 0 \
    --policies full,snapkv,streamingllm,expected_attention,keydiff --ratios 0.25 \
    --scope $scope --concurrency 4 --out docs/results/archive/scope_pilot/scope_$scope.jsonl
done
