#!/usr/bin/env bash
# Create .venv and install akv with its test extras. torch goes first, pinned, so that
# nixl's unpinned torch requirement does not drag CUDA wheels onto a CPU machine.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q "torch==${AKV_TORCH_VERSION:-2.13.0}"
.venv/bin/python -m pip install -q -e ".[test]"
