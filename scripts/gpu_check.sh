#!/usr/bin/env bash
# On a GPU machine (CUDA torch, Triton, nvcc; no vLLM needed): build the CUDA extension for the
# card, run every kernel and paged-cache test on the GPU (the ones CPU machines skip), then the
# kernel benchmark. Everything lands in $OUT (default ./gpu_out):
#   env.txt               card, driver, torch / triton / nvcc versions
#   build.log             the extension's nvcc build (vllm_kvcomp._C)
#   tests.txt, tests.xml  pytest on CUDA tensors (the Triton kernels compiled, the extension, CUDA graphs,
#                         every policy deciding on the device)
#   bench_kernels.md/json `vllm-kvcomp bench kernels --device cuda` (decode, pages, compact, decide)
#   bench_memory.md       `vllm-kvcomp bench memory --device cuda` at Llama-3.1-8B shapes: the peak one
#                         compression holds outside the KV pool vs the bound the engine reserves
# Usage: bash scripts/gpu_check.sh [extra bench arguments]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu_out}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
status=0

{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem --format=csv
  "$PY" -c 'import sys, torch, triton; p = torch.cuda.get_device_properties(0)
print("python", sys.version.split()[0], "| torch", torch.__version__, "| cuda", torch.version.cuda,
      "| triton", triton.__version__)
print("device", p.name, "| sm", f"{p.major}{p.minor}", "| SMs", p.multi_processor_count,
      "| memory", round(p.total_memory / 2**30, 1), "GiB")'
  nvcc --version | tail -2
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

# The extension, built in place for this card's architecture.
ARCH="$("$PY" -c 'import torch; p = torch.cuda.get_device_properties(0); print(f"{p.major}.{p.minor}")')"
echo "== building vllm_kvcomp._C for sm_${ARCH/./} =="
if TORCH_CUDA_ARCH_LIST="$ARCH" VLLM_KVCOMP_BUILD_CUDA=1 MAX_JOBS=16 \
    "$PY" setup.py build_ext --inplace > "$OUT/build.log" 2>&1; then
  echo "built: $(ls vllm_kvcomp/_C*.so)"
else
  echo "BUILD FAILED (tail of build.log):"; tail -30 "$OUT/build.log"; status=1
fi

# Every kernel test on CUDA tensors (the slow cross product too), the paged cache's, and the
# policies deciding on the device what they decide on the host.
echo "== tests on the GPU =="
"$PY" -m pytest -q -p no:cacheprovider --run-slow --junitxml="$OUT/tests.xml" \
  tests/kernels tests/engine/test_paged_cache.py tests/policies/test_device.py > "$OUT/tests.txt" 2>&1 || status=1
tail -25 "$OUT/tests.txt"

echo "== bench kernels =="
"$PY" -m vllm_kvcomp.bench.kernels --device cuda --out "$OUT/bench_kernels.md" \
  --json "$OUT/bench_kernels.json" "$@" > "$OUT/bench.log" 2>&1 || status=1
tail -60 "$OUT/bench.log"

echo "== bench memory (Llama-3.1-8B shapes) =="
"$PY" -m vllm_kvcomp.bench.memory --device cuda --layers 32 --kv-heads 8 --group 4 --head-dim 128 \
  --block-size 16 --lengths 8192,32768 --widest --out "$OUT/bench_memory.md" > "$OUT/bench_memory.log" 2>&1 || status=1
tail -30 "$OUT/bench_memory.log"
exit $status
