#!/usr/bin/env bash
# One TorchTitan run of the GPU kit's side-by-side (steps torchtitan-b4, torchtitan-b8): the
# anchor's run_tt.sh from the bundle's torchtitan/ folder, given TorchTitan CLI overrides.
#
#   bash tools/gpu/torchtitan.sh TT_DIR [--training.local_batch_size 8 ...]
#
# The step sets run_tt.sh's knobs in the environment (TT_TIE, TT_WORK, TT_SITE, OUT, PYTHON,
# and TT_ENTRY in a dry run); see ../shared/torchtitan-anchor/NOTES.md.
set -euo pipefail
dir="$1"
shift
# run_tt.sh bounds itself (training under `timeout`, then its summary into $OUT/tt.log): given
# the seconds the runner grants this step less a margin, a slow compile still leaves a summary
# instead of being killed by the runner with nothing written
export TT_DEADLINE="$((${GPU_KIT_BUDGET_S:-300} - 15))"
# the kit's PYTHONPATH is llmtrain's installed bundle (torchao, zarr, ...): not TorchTitan's
unset PYTHONPATH
exec bash "$dir/run_tt.sh" "$@"
