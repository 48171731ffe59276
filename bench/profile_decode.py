"""Where a cached decoding step's device time goes, per residual mode: the one-token
step of `bench/decode.py` (same flags: --sizes, --batches, --modes, --prompt_len,
--dtype, ...) after the prompt's prefill, traced with `jax.profiler` over
--new_tokens - 3 steps (two warm up), summarised as bench/profile_step.py does: device
time per token by kernel and by kind of kernel, and the kernel launches per token
(the fixed cost a small decoding step pays per launch).

  python bench/profile_decode.py --sizes=128x2 --batches=2 --prompt_len=32
  python bench/profile_decode.py --sizes=1024x8 --batches=8 --prompt_len=1024 \\
      --dtype=bfloat16 --modes=standard,full,block:4 --out=/tmp/profile_decode.json
"""

from __future__ import annotations

from absl import app, flags
import jax

from bench import decode
from bench import trace_summary

FLAGS = flags.FLAGS
flags.DEFINE_integer('top', 12, 'Kernels listed per mode.')
flags.DEFINE_string('out', '', 'JSON file for the summaries.')


def profile(mode: str, d_model: int, num_layers: int, batch: int) -> dict:
  block_size = decode.block_size_for(num_layers, FLAGS.num_blocks)
  model = decode.build(mode, d_model, num_layers, block_size)
  runner = decode.Runner(mode, model, batch, FLAGS.prompt_len + FLAGS.new_tokens - 1)
  prompt_BT = jax.random.randint(
    jax.random.key(2), (batch, FLAGS.prompt_len), 1, 256, jax.numpy.int32
  )
  runner.start(prompt_BT)
  for _ in range(2):
    runner.step()
  summary = trace_summary.traced(runner.step, FLAGS.new_tokens - 3)
  return dict(
    mode=mode,
    d_model=d_model,
    num_layers=num_layers,
    batch=batch,
    prompt_len=FLAGS.prompt_len,
    dtype=FLAGS.dtype,
    backend=jax.default_backend(),
    device=jax.devices()[0].device_kind,
    **summary,
  )


def main(argv):
  del argv
  if FLAGS.new_tokens < 4:
    raise app.UsageError('--new_tokens must be >= 4 (two warm-ups, one traced step).')
  rows = []
  for size in FLAGS.sizes:
    d_model, num_layers = map(int, size.lower().split('x'))
    for batch in map(int, FLAGS.batches):
      for mode in FLAGS.modes:
        row = profile(mode, d_model, num_layers, batch)
        rows.append(row)
        trace_summary.print_summary(
          f'{mode}, d{d_model}/{num_layers}L, batch {batch}, per token', row, FLAGS.top
        )
  if FLAGS.out:
    trace_summary.write_rows(FLAGS.out, rows)


if __name__ == '__main__':
  app.run(main)
