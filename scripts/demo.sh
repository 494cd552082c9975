#!/usr/bin/env bash
# The README's first command: set up a fresh machine, then run the demo.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/rollserve demo "$@"
