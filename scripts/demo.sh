#!/usr/bin/env bash
# Set up (idempotent) and run the disaggregated demo; extra arguments go to `akv demo`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/akv demo "$@"
