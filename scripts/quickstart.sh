#!/usr/bin/env bash
# Fresh machine -> installed package, bundled model fetched and converted.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
python3 -m vllm_kvcomp model fetch
