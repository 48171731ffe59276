"""Where a training step's device time goes, per residual mode: a `jax.profiler` trace
of a few steps of `bench/memory.py`'s step (same flags: --layers, --modes, --d_model,
--dtype, ...), summarised from its Perfetto export as device time per step by kernel
and by kind of kernel (matmul, reduction, elementwise loop, copy or transpose, ...),
with the kernel launches per step. The modes' summaries side by side show what an
AttnRes step adds over the standard one; --hlo_dir also writes each mode's optimized
HLO, where a kernel can be looked up (its name is its fusion's, '.' written '_':
kernel `input_reduce_fusion_25` is `%input_reduce_fusion.25`).

  python bench/profile_step.py --layers=2 --modes=standard,full --d_model=128
  python bench/profile_step.py --layers=32 --d_model=1024 --num_heads=8 \\
      --vocab_size=32768 --seq_len=1024 --dtype=bfloat16 \\
      --modes=standard,block:4/bf16,full/bf16 --out=/tmp/profile.json --hlo_dir=/tmp/hlo

On a CPU the trace has no device lanes: the kernels are the host's XLA thunks.
"""

from __future__ import annotations

import os

from absl import app, flags

from bench import memory
from bench import trace_summary

FLAGS = flags.FLAGS
flags.DEFINE_integer('profile_steps', 3, 'Traced steps per mode (after two warm-ups).')
flags.DEFINE_integer('top', 12, 'Kernels listed per mode.')
flags.DEFINE_string('hlo_dir', '', "Write each mode's optimized HLO here.")


def profile_mode(mode: str, num_layers: int) -> dict:
  compiled, args, record = memory.compile_step(mode, num_layers)
  if FLAGS.hlo_dir:
    os.makedirs(FLAGS.hlo_dir, exist_ok=True)
    name = f'{mode.replace("/", "+")}_{num_layers}L.txt'
    with open(os.path.join(FLAGS.hlo_dir, name), 'w') as f:
      f.write(compiled.as_text())

  def step():
    state, metrics = compiled(*args)
    args[0] = state  # donated: use the new one
    return metrics['loss']

  for _ in range(2):
    step().block_until_ready()
  summary = trace_summary.traced(lambda: step().block_until_ready(), FLAGS.profile_steps)
  return dict(record, **summary)


def main(argv):
  del argv
  rows = []
  for num_layers in map(int, FLAGS.layers):
    for mode in FLAGS.modes:
      row = profile_mode(mode, num_layers)
      rows.append(row)
      trace_summary.print_summary(f'{mode} at {num_layers} layers', row, FLAGS.top)
  if FLAGS.out:
    trace_summary.write_rows(FLAGS.out, rows)


if __name__ == '__main__':
  FLAGS.set_default('out', '')  # bench/memory.py's default is its own results file
  app.run(main)
