#!/usr/bin/env bash
# The compute-optimal ladder at about 10x the CPU ladder's sizes (configs/ladders.py
# OPTIMAL_10X: 0.3M to 2.7M non-embedding parameters, 6 to 10 layers, 20 tokens per
# parameter in batches of 64 x 128), standard against Block AttnRes with N = 4 blocks,
# 5 seeds, on one GPU; then the fit and the multiplier (bench/scaling.py's report).
# Resumable: finished runs are skipped, interrupted ones resume from their checkpoint.
#
#   bench/gpu_ladder.sh [RUN_ROOT] [OUT_DIR]    # default runs/optimal_10x, bench/results
#
# On a GPU, install JAX with its CUDA plugin first (docs/training.md, "Accelerators").
set -euo pipefail
root=${1:-runs/optimal_10x}
out=${2:-bench/results}
cd "$(dirname "$0")/.."
python=${PYTHON:-python}
"$python" -c 'import jax; print("jax", jax.__version__, jax.devices())'
PYTHONPATH=. "$python" bench/ladder.py --ladder=optimal_10x --root="$root" \
  --seeds=0,1,2,3,4 --out="$out" --name=optimal_10x
