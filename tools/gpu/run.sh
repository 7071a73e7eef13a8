#!/usr/bin/env bash
# The GPU kit's one command on the accelerator machine (see tools/README.md, "GPU kit"):
#   bash tools/gpu/run.sh --bundle .gpu-bundle --out "$OUT"      # GPU: every check, one report
#   bash tools/gpu/run.sh --dry-run --out /tmp/gpu-dry           # CPU: every step parses, starts
# Arguments go to runner.py (--only STEPS, --time-limit S, --list, --merge REPORTS).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
exec "${PYTHON:-python3}" tools/gpu/runner.py "$@"
