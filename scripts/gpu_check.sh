#!/usr/bin/env bash
# Every check that needs a GPU, in one run (scripts/gpu_check.py says which):
#
#   scripts/gpu_check.sh [--out DIR] [--quick|--full] [--hbm-fraction F] [--checks a,b] [--budget-s S]
#
# Writes DIR/gpu_check.json and DIR/gpu_check.md (default DIR: gpu_check_out/), after every check.
# Exit codes: 0 all passed or skipped/refused for a stated reason, 1 a check failed, 3 no CUDA device.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [ -x "$root/.venv/bin/python" ]; then
    python="$root/.venv/bin/python"
else
    python="$(command -v python3)"
fi
export HF_HUB_OFFLINE=1
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
exec "$python" "$root/scripts/gpu_check.py" "$@"
