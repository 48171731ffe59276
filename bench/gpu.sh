#!/usr/bin/env bash
# The benchmarks that the paper's claims are about, measured on one GPU: the training
# step (time and compiled memory) of standard, Block and Full AttnRes at the depth
# core's size (bench/aot.py's d1024 row: d_model 1024, 8 heads of 128, MLP 4096,
# vocabulary 32768, 8 sequences of 1024 tokens, bf16 compute, the depth buffer in
# bf16) at 8 and 32 layers; cached decoding (batch 8 and 64, a 1024-token prompt); the
# HC/mHC comparators and the loop-structure control standard@2. Full runs with its
# automatic Phase 1 prefixes (a lax.switch per segment). Every part times its modes
# interleaved against its own standard (bench/memory.py, bench/decode.py).
#
#   bench/gpu.sh [OUT_DIR]          # default bench/results/gpu; about 7 min on one H200
#   bench/gpu.sh /tmp/gpu quick     # the same parts at toy sizes (a smoke run, any host)
#
# Each part runs under its own time limit (a slow compile ends that part only) and
# writes its records and log to OUT_DIR when it finishes. On a GPU, install JAX with its
# CUDA plugin first (docs/training.md, "Accelerators").
set -u
out=${1:-bench/results/gpu}
size=${2:-full}
mkdir -p "$out"
out=$(cd "$out" && pwd)
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
python=${PYTHON:-python}

if [ "$size" = quick ]; then
  train=(--d_model=64 --num_heads=2 --vocab_size=512 --seq_len=32 --batch_size=2
    --dtype=bfloat16 --steps=2)
  shallow=2 deep=4 decode=(--sizes=64x2 --batches=1,2 --prompt_len=16 --new_tokens=5)
else
  train=(--d_model=1024 --num_heads=8 --vocab_size=32768 --seq_len=1024 --batch_size=8
    --dtype=bfloat16 --steps=20)
  shallow=8 deep=32 decode=(--sizes=1024x8 --batches=8,64 --prompt_len=1024 --new_tokens=33)
fi

failed=()
part() {  # part NAME SECONDS COMMAND...: runs COMMAND, its log in OUT_DIR/NAME.log
  local name=$1 seconds=$2
  shift 2
  echo "== $name ($(date -u +%H:%M:%S), limit ${seconds} s)"
  timeout "$seconds" "$@" 2>&1 | tee "$out/$name.log" | grep -v '^[WI]0000'
  local status=${PIPESTATUS[0]}
  echo "== $name: exit $status"
  [ "$status" = 0 ] || failed+=("$name")
}

"$python" -c 'import jax; print("jax", jax.__version__, jax.devices())'
part train_shallow 240 "$python" bench/memory.py "${train[@]}" --layers=$shallow \
  --modes=standard,block:4/bf16,block:8/bf16,full/bf16 \
  --out="$out/train_shallow.jsonl"
part decode 120 "$python" bench/decode.py "${decode[@]}" --repeats=3 --dtype=bfloat16 \
  --modes=standard,full,block:4 --jsonl_out="$out/decode.jsonl" \
  --table_out="$out/decode.md"
part train_deep 260 "$python" bench/memory.py "${train[@]}" --layers=$deep \
  --modes=standard,block:4/bf16,block:8/bf16,full/bf16 \
  --out="$out/train_deep.jsonl"
part comparators 180 "$python" bench/memory.py "${train[@]}" --layers=$shallow \
  --modes=standard,standard@2,hc,mhc --out="$out/comparators.jsonl"
# Every part runs; the script's own status says whether any failed.
if [ ${#failed[@]} -gt 0 ]; then
  echo "== failed: ${failed[*]}"
  exit 1
fi
