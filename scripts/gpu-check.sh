#!/usr/bin/env bash
# Runs every CUDA test (pytest -m cuda) in one go, on a machine with a GPU, then the speed rows
# of benchmarks/README.md: fp8 against bf16 step time (benchmarks/fp8.py, compute capability 8.9
# and newer) and, with 2 GPUs or more, the context-parallel memory row.
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
# context parallelism: the peak memory per rank of one long sequence, CP = 1 vs 2 (benchmarks/README.md)
if [ "$gpus" -ge 2 ]; then
    echo "gpu-check: context_parallel memory, one sequence of 16384 tokens, CP = 1 vs 2:"
    "$PYTHON" -m accelfn launch --nproc-per-node 2 benchmarks/context_parallel_memory.py --length 16384
else
    echo "gpu-check: context_parallel memory row skipped: CP = 2 splits one sequence over 2 GPUs (a process" \
         "each; NCCL refuses two ranks on one GPU), and $gpus GPU(s) are visible"
fi
# fp8 against bf16 step time (benchmarks/README.md); prints why it skipped without a GPU of compute capability 8.9+
"$PYTHON" benchmarks/fp8.py
if [ "$gpus" = "0" ]; then
    echo "gpu-check: no CUDA GPU visible: the CUDA tests were skipped, nothing was checked" >&2
    exit 1
fi
