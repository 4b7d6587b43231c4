#!/usr/bin/env bash
# Runs every CUDA test (pytest -m cuda) in one go, on a machine with a GPU, then the speed rows
# (benchmarks/fp8.py: fp8 against bf16 step time, on compute capability 8.9 and newer).
#
#   scripts/gpu-check.sh [extra pytest args]
#
# Uses $PYTHON (default: python3) with the repository on PYTHONPATH, so accelfn need not be
# installed. Prints the GPUs and versions first; without a GPU every test skips, and the
# script says so and exits 1 so that a check on a machine without one is not taken as passed.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1

command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv || true
"$PYTHON" - <<'PY'
import torch
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, GPUs visible: {torch.cuda.device_count()}")
PY
gpus=$("$PYTHON" -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)")
"$PYTHON" -m pytest -m cuda -v -rs -p no:cacheprovider tests "$@"
# speed rows (benchmarks/README.md records them); each prints why it skipped on a machine without a suitable GPU
"$PYTHON" benchmarks/fp8.py
if [ "$gpus" = "0" ]; then
    echo "gpu-check: no CUDA GPU visible: the CUDA tests were skipped, nothing was checked" >&2
    exit 1
fi
