"""Train-step memory and time of Standard, Full and Block AttnRes across depth.

For every (mode, depth) it compiles the training step `train.py` runs (loss, gradients,
clipping, AdamW update: `training/step.py`) and reads XLA's `memory_analysis()` of the
compiled executable: temporary bytes (what autodiff keeps alive: activations, the
AttnRes buffers), argument and output bytes. It then times the modes of one depth
interleaved (a step of each in turn, per round; the median per mode). Ratios are to the
standard model at the same depth, measured in the same run.

  python bench/memory.py                       # the full grid (d=256, T=256, B=8)
  python bench/memory.py --layers=4,8 --steps=2 --out=/tmp/memory_quick.jsonl
  python bench/memory.py --modes=standard,full,block:4,hc,mhc --layers=4 --d_model=128
  python bench/memory.py --io        # the residual's memory I/O per sublayer (counted)
  python bench/memory.py --layers=8 --d_model=1024 --num_heads=8 --vocab_size=32768 \
      --seq_len=1024 --dtype=bfloat16 --steps=20   # a GPU's size (bench/gpu.sh)

Modes: 'standard', 'full', 'block:S', 'hc:m', 'mhc:m' (Hyper-Connections / mHC with m
streams, default 4).
"""

from __future__ import annotations

import functools
import json
import os
import statistics
import time

from absl import app, flags
import jax
import jax.numpy as jnp
from flax import nnx


import attnres_jax as ar
from attnres_jax import flops
from attnres_jax import modes
from attnres_jax.runs import metrics as metrics_lib
from attnres_jax.training import optim
from attnres_jax.training import step as train
from configs import default as default_config

FLAGS = flags.FLAGS
flags.DEFINE_list('layers', ['4', '8', '16', '32'], 'Transformer layers to measure.')
flags.DEFINE_list(
  'modes',
  ['standard', 'full', 'block:2', 'block:4', 'block:8'],
  f'Residual modes ({modes.SYNTAX}); without @G the schedule segment is automatic.',
)
flags.DEFINE_integer('d_model', 256, 'Model width.')
flags.DEFINE_integer('num_heads', 0, 'Attention heads (0: d_model / 64).')
flags.DEFINE_integer('vocab_size', 256, 'Vocabulary (256: bytes).')
flags.DEFINE_enum('dtype', 'float32', ['float32', 'bfloat16'], 'Compute dtype.')
flags.DEFINE_integer('seq_len', 256, 'Sequence length.')
flags.DEFINE_integer('batch_size', 8, 'Batch size.')
flags.DEFINE_integer(
  'steps',
  3,
  'Timed rounds (after one warm-up round); each round '
  'times one step of every mode in turn.',
)
flags.DEFINE_string('remat', 'none', 'Remat policy, the same for every row.')
flags.DEFINE_string(
  'out', 'bench/results/memory.jsonl', 'JSON output (one record per row).'
)
flags.DEFINE_bool(
  'io',
  False,
  'Only print and write (to --io_out) the residual memory I/O '
  'table: a counted model (attnres_jax.flops.residual_io_per_sublayer) '
  "next to the paper's Table 1.",
)
flags.DEFINE_string('io_out', 'bench/results/residual_io.json', 'JSON output of --io.')


def model_config(mode: str, num_layers: int):
  """A residual mode (attnres_jax/modes.py: 'standard', 'full', 'block:4@2', 'mhc',
  ...) at `num_layers` layers of the benchmark's width."""
  return ar.model_config(
    d_model=FLAGS.d_model,
    num_heads=FLAGS.num_heads or max(1, FLAGS.d_model // 64),
    mlp_dim=4 * FLAGS.d_model,
    num_layers=num_layers,
    vocab_size=FLAGS.vocab_size,
    dtype=FLAGS.dtype,
    remat=FLAGS.remat,
    **modes.fields(mode),
  )


def compile_step(mode: str, num_layers: int):
  """(compiled step, its arguments, a record of memory and compile time): the real
  training step (`training/step.py`'s `train_step`: loss, gradients, clipping, the
  AdamW update of configs/default.py's optimizer), jitted with the state donated."""
  cfg = model_config(mode, num_layers)
  tx, schedule = optim.make_optimizer(default_config.get_config().train, cfg)
  state = train.init_train_state(cfg, tx, seed=0)
  graphdef = nnx.graphdef(ar.Transformer(cfg, rngs=nnx.Rngs(0)))
  tokens_BT = jax.random.randint(
    jax.random.key(0), (FLAGS.batch_size, FLAGS.seq_len + 1), 0, FLAGS.vocab_size
  )
  batch = {
    'inputs': tokens_BT[:, :-1],
    'targets': tokens_BT[:, 1:],
    'weights': jnp.ones((FLAGS.batch_size, FLAGS.seq_len), jnp.float32),
  }
  step = jax.jit(
    functools.partial(train.train_step, graphdef=graphdef, tx=tx, schedule=schedule),
    donate_argnums=0,
  )
  start = time.perf_counter()
  compiled = step.lower(state, batch).compile()
  compile_s = time.perf_counter() - start
  memory = compiled.memory_analysis()
  record = dict(
    mode=mode,
    num_layers=num_layers,
    num_sublayers=2 * num_layers,
    d_model=FLAGS.d_model,
    num_heads=cfg.num_heads,
    vocab_size=FLAGS.vocab_size,
    dtype=FLAGS.dtype,
    seq_len=FLAGS.seq_len,
    batch_size=FLAGS.batch_size,
    remat=FLAGS.remat,
    schedule_layers=ar.residuals.make(cfg).segment_layers,
    temp_bytes=memory.temp_size_in_bytes,
    argument_bytes=memory.argument_size_in_bytes,
    output_bytes=memory.output_size_in_bytes,
    total_bytes=(
      memory.temp_size_in_bytes
      + memory.argument_size_in_bytes
      + memory.output_size_in_bytes
    ),
    compile_s=compile_s,
    backend=jax.default_backend(),
    device=jax.devices()[0].device_kind,
    jax_version=jax.__version__,
  )
  return compiled, [state, batch], record


def time_interleaved(steps: dict, rounds: int) -> dict:
  """Median step time of every row, the rows timed in turn within each round (the
  machine's load then weighs on every row alike)."""
  times = {key: [] for key in steps}
  for round_index in range(rounds + 1):  # round 0 warms up
    for key, (compiled, args, _) in steps.items():
      start = time.perf_counter()
      state, metrics = compiled(*args)
      loss = metrics['loss'].block_until_ready()
      args[0] = state  # donated: use the new one
      if round_index:
        times[key].append(time.perf_counter() - start)
  return {key: (statistics.median(t), float(loss)) for key, t in times.items()}


# The paper's Table 1 (per-layer memory I/O per token) as far as we have it: mHC with
# m = 4 streams and Block AttnRes (at the paper's block count). Rows we do not have
# are left blank rather than guessed; see docs/comparators.md.
PAPER_TABLE_1 = {'mhc:4': '34d', 'block': '5.5d'}


def _paper_entry(mode: str) -> str:
  fields = modes.fields(mode)
  if 'hc_streams' in fields:
    return PAPER_TABLE_1.get(f'{fields["residual"]}:{fields["hc_streams"]}', '')
  return PAPER_TABLE_1.get(fields['residual'], '')


def forward_bytes_accessed(mode: str, num_layers: int) -> float:
  """XLA's 'bytes accessed' of the compiled forward pass (all ops, after fusion)."""
  cfg = model_config(mode, num_layers)
  graphdef, state = nnx.split(ar.Transformer(cfg, rngs=nnx.Rngs(0)))
  tokens_BT = jnp.zeros((FLAGS.batch_size, FLAGS.seq_len), jnp.int32)
  compiled = (
    jax.jit(lambda state, x: nnx.merge(graphdef, state)(x))
    .lower(state, tokens_BT)
    .compile()
  )
  cost = compiled.cost_analysis()
  return float((cost[0] if isinstance(cost, list) else cost)['bytes accessed'])


def io_table() -> None:
  """The memory I/O of each mode's residual per sublayer, for each depth: counted,
  and measured as the compiled forward pass's bytes accessed beyond the standard
  model's, per sublayer and token, plus the standard residual's counted 3d."""
  rows = []
  print(
    f'{"mode":>9} {"layers":>6} {"read/d":>7} {"write/d":>7} {"total/d":>7} '
    f'{"HLO/d":>7}  paper'
  )
  token_d_bytes = FLAGS.batch_size * FLAGS.seq_len * FLAGS.d_model * 4  # float32
  for num_layers in map(int, FLAGS.layers):
    standard = forward_bytes_accessed('standard', num_layers)
    for mode in FLAGS.modes:
      io = flops.residual_io_per_sublayer(model_config(mode, num_layers))
      extra = forward_bytes_accessed(mode, num_layers) - standard
      io['hlo_total'] = extra / (2 * num_layers) / token_d_bytes + 3.0
      paper = _paper_entry(mode)
      rows.append(
        dict(
          mode=mode,
          num_layers=num_layers,
          paper_table_1=paper,
          d_model=FLAGS.d_model,
          seq_len=FLAGS.seq_len,
          batch_size=FLAGS.batch_size,
          backend=jax.default_backend(),
          **io,
        )
      )
      print(
        f'{mode:>9} {num_layers:>6} {io["read"]:>7.2f} {io["write"]:>7.2f} '
        f'{io["total"]:>7.2f} {io["hlo_total"]:>7.2f}  {paper}',
        flush=True,
      )
  os.makedirs(os.path.dirname(FLAGS.io_out) or '.', exist_ok=True)
  with open(FLAGS.io_out, 'w') as f:
    json.dump(rows, f, indent=1)
  print(f'wrote {len(rows)} records to {FLAGS.io_out}')


def main(argv):
  del argv
  if FLAGS.io:
    io_table()
    return
  rows = []
  header = (
    f'{"mode":>12} {"layers":>6} {"temp MiB":>9} {"total MiB":>9} '
    f'{"step s":>7} {"compile s":>9} {"temp/std":>8} {"total/std":>9} '
    f'{"time/std":>8}'
  )
  print(header)
  for num_layers in map(int, FLAGS.layers):
    steps = {mode: compile_step(mode, num_layers) for mode in FLAGS.modes}
    timed = time_interleaved(steps, FLAGS.steps)
    standard = steps['standard'][2] if 'standard' in steps else None
    for mode, (_, _, row) in steps.items():
      row['step_s'], row['loss'] = timed[mode]
      if standard is not None:
        row['temp_ratio'] = row['temp_bytes'] / standard['temp_bytes']
        row['total_ratio'] = row['total_bytes'] / standard['total_bytes']
        row['time_ratio'] = row['step_s'] / standard['step_s']
      rows.append(row)
      mib = 2**20
      print(
        f'{mode:>12} {num_layers:>6} {row["temp_bytes"] / mib:>9.1f} '
        f'{row["total_bytes"] / mib:>9.1f} {row["step_s"]:>7.3f} '
        f'{row["compile_s"]:>9.1f} '
        f'{row.get("temp_ratio", float("nan")):>8.2f} '
        f'{row.get("total_ratio", float("nan")):>9.2f} '
        f'{row.get("time_ratio", float("nan")):>8.2f}',
        flush=True,
      )
    del steps
  metrics_lib.write_jsonl(FLAGS.out, rows)


if __name__ == '__main__':
  app.run(main)
