#!/usr/bin/env bash
# The README's second command (and CI's): set up, then lint, type-check and test.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PATH="$PWD/.venv/bin:$PATH"

echo "== generated stubs are up to date"
bash scripts/gen_proto.sh
if [ -n "$(git status --porcelain -- clients/python/rollserve/v1)" ]; then
  git status --porcelain -- clients/python/rollserve/v1
  git diff --stat -- clients/python/rollserve/v1
  echo "the committed stubs differ from proto/: run scripts/gen_proto.sh and commit" >&2
  exit 1
fi

echo "== ruff"
ruff check .
ruff format --check .

echo "== mypy"
mypy

echo "== pytest"
python -m pytest "$@"
