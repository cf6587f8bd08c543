#!/usr/bin/env bash
# The test command of the README: set up (idempotent), lint, run the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
python3 -m ruff check .
TRITON_INTERPRET=1 python3 -m pytest -q "$@"
