#!/usr/bin/env bash
# Regenerates the Python stubs of proto/ into clients/python/rollserve/v1.
# CI runs this and fails when the committed stubs differ.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
out=clients/python
"$PY" -m grpc_tools.protoc -Iproto \
  --python_out="$out" --mypy_out="$out" \
  --grpc_python_out="$out" --mypy_grpc_out="$out" \
  proto/rollserve/v1/rollserve.proto
touch "$out/rollserve/v1/py.typed"
