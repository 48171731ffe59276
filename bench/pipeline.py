"""Pipeline parallelism on 8 simulated CPU devices: what crosses a stage boundary
(naive vs cached AttnRes transfer), the schedule's bubble, step time and memory.

1. Communication: for P stages x V virtual stages, Block AttnRes with N = 8 blocks and
   Full AttnRes, the bytes one device sends per stage transition, read from the
   collective-permutes in the loop of the compiled (forward) pipelined loss, naive
   ('preallocated': the whole K-slot buffer) vs cached (a W-slot window); beside them
   the paper's naive, which sends only the slots written so far (per-slot bytes from
   the measured naive message times the accumulated slots, averaged over the
   transitions), and the logical count of block transmissions per microbatch
   (`TransferPlan.block_transmissions`, embedding excluded).
2. Step time and memory: one train step (loss, gradients, AdamW) per configuration,
   timed interleaved (median), against the same model data-parallel on the same 8
   devices; peak per-device memory from XLA's `memory_analysis()` (temporaries +
   arguments + outputs of one device's program), cached vs naive.

3. TPU (`--topology=v5p:2x2x1`, compile-only with libtpu,
   `attnres_jax/compile_report/aot.py`): per device temp memory and the estimated step
   time (loops counted with their trip counts) of the train step for standard, Block
   S=4 and Full AttnRes, FSDP over all chips (no pipeline) against stage x data with M
   microbatches, each pipeline schedule given ('remat', 'remat_rerun', 'gpipe'), with
   the bubble fraction; with --tpu_hlo_dir, each row's optimized HLO and its estimate
   split by loop and kind (`time_by_loop`); with --tpu_top_kernels=N also the schedule
   loop's N costliest kernels (`top_kernels`).

  python bench/pipeline.py                               # parts comm and time
  python bench/pipeline.py --parts=comm --stages=2 --virtual_stages=2 --out=/tmp/pp.jsonl
  JAX_PLATFORMS=cpu python bench/pipeline.py --parts=tpu --topology=v5p:2x2x1 \\
      --out=/tmp/pp_tpu.jsonl

The simulated devices share the host's cores: a step-time ratio says how much more
work the pipelined program does in total (bubble slots still compute, masked), not
how fast P real devices would run it.
"""

from __future__ import annotations

import os

if 'xla_force_host_platform_device_count' not in os.environ.get('XLA_FLAGS', ''):
  os.environ['XLA_FLAGS'] = (
    os.environ.get('XLA_FLAGS', '') + ' --xla_force_host_platform_device_count=8'
  )

import functools
import statistics
import time

from absl import app, flags
import jax
import numpy as np

from attnres_jax import config as config_lib
from attnres_jax import modes
from attnres_jax.compile_report import aot
from attnres_jax.compile_report import pipeline_hlo
from attnres_jax.nn import sharding
from attnres_jax.parallel import pipeline
from attnres_jax.parallel import pipeline_plan
from attnres_jax.runs import checkpointing
from attnres_jax.runs import metrics as metrics_lib
from attnres_jax.training import optim
from attnres_jax.training import step as train

from configs import default as default_config

FLAGS = flags.FLAGS
flags.DEFINE_list(
  'parts',
  ['comm', 'time'],
  'comm: bytes per transition; time: step time, bubble and memory.',
)
flags.DEFINE_integer('d_model', 64, 'Model width.')
flags.DEFINE_integer('seq_len', 64, 'Sequence length.')
flags.DEFINE_integer(
  'comm_layers',
  16,
  'Layers of the communication models '
  '(divisible by P V for P in {2, 4}, V in {1, 2, 4}).',
)
flags.DEFINE_integer('time_layers', 8, 'Layers of the timed model (Block, N = 8).')
flags.DEFINE_integer('time_batch', 32, 'Global batch of the timed steps.')
flags.DEFINE_list('stages', ['2', '4'], 'Communication table: stage counts P.')
flags.DEFINE_list('virtual_stages', ['1', '2', '4'], 'Communication table: V.')
flags.DEFINE_integer('steps', 5, 'Timed rounds after one warm-up round.')
flags.DEFINE_string(
  'out', 'bench/results/pipeline.jsonl', 'JSON output, one record per row.'
)
flags.DEFINE_list('topology', [], 'TPU topologies of part tpu, e.g. v5p:2x2x1.')
flags.DEFINE_list(
  'tpu_modes',
  ['standard', 'block:4', 'full'],
  f'Part tpu: residual modes ({modes.SYNTAX}).',
)
flags.DEFINE_list(
  'tpu_schedules',
  ['remat', 'gpipe'],
  f'Part tpu: pipeline schedules, of {pipeline_plan.SCHEDULES}.',
)
flags.DEFINE_integer('tpu_stages', 2, 'Part tpu: pipeline stages P (the rest data).')
flags.DEFINE_list(
  'tpu_virtual_stages', ['1'], 'Part tpu: virtual stages V, one row each.'
)
flags.DEFINE_integer('tpu_microbatches', 4, 'Part tpu: microbatches M.')
flags.DEFINE_integer('tpu_d_model', 1024, 'Part tpu: model width (heads of 128).')
flags.DEFINE_integer('tpu_layers', 8, 'Part tpu: layers.')
flags.DEFINE_integer('tpu_seq_len', 1024, 'Part tpu: sequence length.')
flags.DEFINE_integer('tpu_per_chip', 8, 'Part tpu: sequences per chip.')
flags.DEFINE_bool(
  'tpu_fsdp', True, 'Part tpu: also the FSDP rows (no pipeline; temp / FSDP needs them).'
)
flags.DEFINE_string(
  'tpu_hlo_dir', None, 'Part tpu: write the optimized HLO of each row under this folder.'
)
flags.DEFINE_integer(
  'tpu_top_kernels',
  0,
  'Part tpu, with --tpu_hlo_dir: also record the costliest kernels of the schedule '
  'loop (forward and backward), this many (`pipeline_hlo.top_kernels`).',
)

NUM_DEVICES = 8


def model_config(residual: str, num_layers: int):
  block_size = 1 if residual == 'full' else 2 * num_layers // 8  # N = 8 blocks
  return config_lib.model_config(
    vocab_size=256,
    d_model=FLAGS.d_model,
    num_heads=max(1, FLAGS.d_model // 32),
    mlp_dim=4 * FLAGS.d_model,
    num_layers=num_layers,
    residual=residual,
    block_size=block_size,
  )


def mesh_config(stages: int, virtual: int, micro: int, transfer: str):
  return sharding.default_mesh_config(
    shape=(-1, 1, 1),
    stage=stages,
    virtual_stages=virtual,
    num_microbatches=micro,
    pipeline_transfer=transfer,
  )


def tokens(batch_size: int) -> dict[str, np.ndarray]:
  rng = np.random.default_rng(0)
  ids = rng.integers(1, 256, (batch_size, FLAGS.seq_len + 1)).astype(np.int32)
  return {
    'inputs': ids[:, :-1],
    'targets': ids[:, 1:],
    'weights': np.ones((batch_size, FLAGS.seq_len), np.float32),
  }


def plan_counts(plan, embedding: bool = False) -> dict:
  """A transfer plan's counts: blocks sent (logical, eqs. 7-8), slots on the wire
  (naive: the whole preallocated buffer, cached: the window) and the paper's naive
  (the accumulated slots only); with `embedding`, the block counts with it too."""
  counts = {}
  counts['blocks_naive'], counts['blocks_cached'] = plan.block_transmissions()
  if embedding:
    counts['blocks_naive_with_embedding'], counts['blocks_cached_with_embedding'] = (
      plan.block_transmissions(embedding=True)
    )
  counts['wire_slots_naive'], counts['wire_slots_cached'] = plan.wire_slots()
  counts['accumulated_slots'] = plan.accumulated_slots()
  return counts


# The communication table's columns, each as wide as its title.
COMM_COLUMNS = (
  '  model| P| V|slots naive|slots cached|KiB prealloc|KiB paper|KiB cached|'
  'prealloc/c|paper/c|blocks naive|blocks cached'
).split('|')


def comm_cell(title: str, value) -> str:
  """`value` right-aligned under `title`: KiB with 1 decimal, ratios with 2."""
  spec = '.1f' if title.startswith('KiB') else '.2f' if '/' in title else ''
  return f'{value:>{len(title)}{spec}}'


def communication() -> list[dict]:
  rows = []
  print(' '.join(COMM_COLUMNS))
  for residual in ('block', 'full'):
    cfg = model_config(residual, FLAGS.comm_layers)
    graphdef, _ = checkpointing.abstract_model(cfg)
    params = train.init_train_state(
      cfg, optim.make_optimizer(default_config.get_config().train, cfg)[0], 0
    ).params
    for stages in map(int, FLAGS.stages):
      data = NUM_DEVICES // stages
      for virtual in map(int, FLAGS.virtual_stages):
        micro = stages  # one row per data-parallel device per microbatch
        batch = tokens(micro * data)
        row = dict(
          part='comm',
          model=f'{residual}'
          + (f' N=8 S={cfg.block_size}' if residual == 'block' else ''),
          num_layers=cfg.num_layers,
          stages=stages,
          virtual_stages=virtual,
          num_microbatches=micro,
          d_model=cfg.d_model,
          seq_len=FLAGS.seq_len,
          rows_per_device=1,
        )
        for transfer in ('naive', 'cached'):
          mesh_cfg = mesh_config(stages, virtual, micro, transfer)
          mesh = sharding.make_mesh(mesh_cfg)
          rules = sharding.rules_from_config(mesh_cfg)
          layout = train.make_layout(
            cfg,
            optim.make_optimizer(default_config.get_config().train, cfg)[0],
            mesh,
            rules,
          )
          pipe = pipeline_plan.from_mesh_config(mesh_cfg)
          loss = functools.partial(pipeline.loss_sums, graphdef=graphdef, pipe=pipe)
          with sharding.logical_rules(mesh, rules):
            compiled = (
              jax.jit(loss, in_shardings=(layout.state.params, layout.batch))
              .lower(params, batch)
              .compile()
            )
          hlo = compiled.as_text()
          loop = [c for c in pipeline_hlo.collective_permutes(hlo) if c['in_loop']]
          row[f'{transfer}_bytes'] = sum(c['bytes'] for c in loop)
          row[f'{transfer}_shapes'] = [s for c in loop for s in c['shapes']]
        plan = pipeline_plan.transfer_plan(cfg, pipe)
        row['num_slots'], row['cached_slots'] = plan.num_slots, plan.width
        row.update(plan_counts(plan))
        # The paper's naive: the accumulated slots only, at the measured bytes a slot.
        row['paper_naive_bytes'] = (
          row['naive_bytes']
          / plan.num_slots
          * plan.accumulated_slots()
          / len(plan.needed)
        )
        row['ratio'] = row['naive_bytes'] / row['cached_bytes']
        row['paper_ratio'] = row['paper_naive_bytes'] / row['cached_bytes']
        rows.append(row)
        kib = [
          row[k] / 1024 for k in ('naive_bytes', 'paper_naive_bytes', 'cached_bytes')
        ]
        cells = [residual, stages, virtual, plan.num_slots, plan.width, *kib]
        cells += [row['ratio'], row['paper_ratio'], row['blocks_naive']]
        cells += [row['blocks_cached']]
        print(' '.join(map(comm_cell, COMM_COLUMNS, cells)), flush=True)
  # Eqs. 7-8 at N_p = 1 (8 chunks of one block) and the paper's Fig. 3 (N_p = 1/2).
  for label, block_size in (('eqs. 7-8, N_p = 1', 2), ('Fig. 3, N_p = 1/2', 4)):
    plan = pipeline_plan.transfer_plan(
      config_lib.model_config(num_layers=8, block_size=block_size),
      pipeline_plan.PipelineConfig(4, 2),
    )
    row = dict(part='fig3', setting=label, **plan_counts(plan, embedding=True))
    print(
      f'P=4, V=2, {label}: blocks sent {row["blocks_naive"]} naive, '
      f'{row["blocks_cached"]} cached (with the embedding '
      f'{row["blocks_naive_with_embedding"]}, {row["blocks_cached_with_embedding"]}: '
      f'{row["blocks_naive_with_embedding"] - row["blocks_cached_with_embedding"]} '
      f'removed); on the wire {row["wire_slots_naive"]} slots preallocated, '
      f'{row["accumulated_slots"]} accumulated, {row["wire_slots_cached"]} cached.'
    )
    rows.append(row)
  return rows


def compile_step(cfg, mesh_cfg, batch):
  tx, schedule = optim.make_optimizer(default_config.get_config().train, cfg)
  mesh = sharding.make_mesh(mesh_cfg)
  layout = train.make_layout(cfg, tx, mesh, sharding.rules_from_config(mesh_cfg))
  state = train.create_train_state(cfg, tx, 0, layout)
  global_batch = layout.to_global(batch)
  graphdef, _ = checkpointing.abstract_model(cfg)
  step = train.jit_train_step(
    layout,
    graphdef=graphdef,
    tx=tx,
    schedule=schedule,
    loss_fn=pipeline.make_loss_fn(pipeline_plan.from_mesh_config(mesh_cfg)),
  )
  start = time.perf_counter()
  compiled = step.lower(state, global_batch).compile()
  compile_s = time.perf_counter() - start
  memory = compiled.memory_analysis()
  peak = (
    memory.temp_size_in_bytes
    + memory.argument_size_in_bytes
    + memory.output_size_in_bytes
  )
  return (
    compiled,
    [state, global_batch],
    dict(temp_bytes=memory.temp_size_in_bytes, peak_bytes=peak, compile_s=compile_s),
  )


def step_times() -> list[dict]:
  cfg = model_config('block', FLAGS.time_layers)
  batch = tokens(FLAGS.time_batch)
  configs = {'data-parallel 8': (sharding.default_mesh_config(shape=(-1, 1, 1)), None)}
  for stages, virtual, micro in ((2, 1, 4), (4, 1, 4), (2, 2, 4), (4, 2, 4)):
    for transfer in ('naive', 'cached'):
      pipe = pipeline_plan.PipelineConfig(stages, virtual, micro, transfer)
      configs[f'P={stages} V={virtual} M={micro} {transfer}'] = (
        mesh_config(stages, virtual, micro, transfer),
        pipe,
      )
  steps = {
    name: compile_step(cfg, mesh_cfg, batch) for name, (mesh_cfg, _) in configs.items()
  }
  times = {name: [] for name in steps}
  for round_index in range(FLAGS.steps + 1):  # round 0 warms up
    for name, (compiled, args, _) in steps.items():
      start = time.perf_counter()
      state, metrics = compiled(*args)
      jax.block_until_ready(metrics)
      args[0] = state  # donated
      if round_index:
        times[name].append(time.perf_counter() - start)
  load = os.getloadavg()[0]  # the simulated devices share the host's cores
  base = statistics.median(times['data-parallel 8'])
  rows = []
  print(
    f'{"configuration":>26} {"bubble":>6} {"step s":>7} {"time/DP":>7} '
    f'{"peak MiB/dev":>12} {"temp MiB/dev":>12} {"compile s":>9}'
  )
  for name, (_, _, record) in steps.items():
    pipe = configs[name][1]
    step_s = statistics.median(times[name])
    row = dict(
      part='time',
      configuration=name,
      model=f'block N=8 S={cfg.block_size}',
      num_layers=cfg.num_layers,
      d_model=cfg.d_model,
      seq_len=FLAGS.seq_len,
      batch_size=FLAGS.time_batch,
      bubble=pipeline_plan.bubble_fraction(pipe) if pipe else 0.0,
      step_s=step_s,
      time_ratio=step_s / base,
      load_average=load,
      cpu_count=os.cpu_count(),
      jax_version=jax.__version__,
      backend=jax.default_backend(),
      **record,
    )
    rows.append(row)
    mib = 2**20
    print(
      f'{name:>26} {row["bubble"]:>6.3f} {step_s:>7.3f} {row["time_ratio"]:>7.2f} '
      f'{row["peak_bytes"] / mib:>12.2f} {row["temp_bytes"] / mib:>12.2f} '
      f'{row["compile_s"]:>9.1f}',
      flush=True,
    )
  print(f'host: {os.cpu_count()} cores, load average {load:.1f} after timing')
  return rows


def tpu_config(mode: str, chips: int, stages: int, virtual: int, schedule: str):
  """The bf16 model of part tpu: FSDP over all chips (stages = 1) or the pipeline."""
  config = default_config.get_config()
  d_model = FLAGS.tpu_d_model
  config.model.update(
    vocab_size=32768,
    dtype='bfloat16',
    d_model=d_model,
    num_layers=FLAGS.tpu_layers,
    num_heads=max(1, d_model // 128),
    mlp_dim=4 * d_model,
    **modes.fields(mode),
  )
  config.train.update(seq_len=FLAGS.tpu_seq_len, batch_size=FLAGS.tpu_per_chip * chips)
  if stages == 1:
    config.mesh.shape = (1, -1, 1)
  else:
    config.mesh.update(
      shape=(-1, 1, 1),
      stage=stages,
      virtual_stages=virtual,
      num_microbatches=FLAGS.tpu_microbatches,
      pipeline_schedule=schedule,
    )
  return config


def tpu_configurations() -> list[tuple[str, int, int, str | None]]:
  """(label, stages, virtual stages, schedule) of part tpu's rows per mode: FSDP
  (--tpu_fsdp), then each virtual stage count and schedule of the pipeline."""
  return [('FSDP', 1, 1, None)] * FLAGS.tpu_fsdp + [
    (
      f'P={FLAGS.tpu_stages} V={virtual} M={FLAGS.tpu_microbatches} {schedule}',
      FLAGS.tpu_stages,
      int(virtual),
      schedule,
    )
    for virtual in FLAGS.tpu_virtual_stages
    for schedule in FLAGS.tpu_schedules
  ]


def tpu_row(topology: str, chips: int, mode: str, configuration: tuple) -> dict:
  """One row of part tpu: the train step compiled for `topology`, or with 'error' the
  compiler's out-of-memory; with --tpu_hlo_dir its estimate by loop (and kernels)."""
  label, stages, virtual, schedule = configuration
  config = tpu_config(mode, chips, stages, virtual, schedule or 'remat')
  pipe = pipeline_plan.from_mesh_config(config.mesh)
  row = dict(part='tpu', topology=topology, model=mode, configuration=label)
  row.update(stages=stages, virtual_stages=virtual, schedule=schedule)
  row['num_microbatches'] = pipe.num_microbatches if pipe else 1
  row['bubble'] = pipeline_plan.bubble_fraction(pipe) if pipe else 0.0
  row.update(d_model=FLAGS.tpu_d_model, num_layers=FLAGS.tpu_layers)
  row.update(seq_len=FLAGS.tpu_seq_len, batch_size=config.train.batch_size)
  try:
    hlo_dir = FLAGS.tpu_hlo_dir and os.path.join(
      FLAGS.tpu_hlo_dir,
      f'{topology}_{mode}_{label}'.replace('/', '+').replace(' ', '_'),
    )
    report = aot.compile_report(
      config, topology, steps=('train',), check_hbm=False, hlo_dir=hlo_dir
    )
  except ValueError as e:  # the compiler's out-of-memory, said as a row
    row['error'] = str(e)
    return row
  step = report['steps']['train']
  row.update(
    temp_bytes=step['memory']['temp_bytes'],
    total_bytes=step['memory']['total_bytes'],
    est_step_seconds=step['est_step_seconds'],
    # The compiler's per-kernel cycles summed with loops counted: a second view that
    # does not rescale the loops-once estimate (the two ratios to the standard differ
    # by up to 0.1 at d1024).
    compiler_cycles_loops_counted=step['compiler_cycles_loops_counted'],
    compile_seconds=step['compile_seconds'],
    while_trip_counts=step['while_trip_counts'],
    unknown_trip_counts=step['unknown_trip_counts'],
    collectives=step['collectives'],
    flops=step['flops'],
    bytes_accessed=step['bytes_accessed'],
    hbm_bytes=step.get('hbm_bytes'),  # from the report's HBM count, where it has one
    time_shares=step.get('time_shares'),  # what the estimate is made of
    load_average=os.getloadavg()[0],  # compile time depends on it, nothing else
  )
  if hlo_dir:
    topo = aot.get_topology(topology)
    with open(os.path.join(hlo_dir, 'train.hlo.txt'), encoding='utf-8') as f:
      text = f.read()
    roofline = (
      row['est_step_seconds'],
      topo.device_peak_flops,
      topo.chip.hbm_bandwidth / topo.devices_per_chip,
    )
    row['time_by_loop'] = pipeline_hlo.time_by_loop(text, *roofline)
    if FLAGS.tpu_top_kernels:
      row['top_kernels'] = pipeline_hlo.top_kernels(
        text, *roofline, count=FLAGS.tpu_top_kernels
      )
  return row


def tpu_rows() -> list[dict]:
  rows = []
  gib = 2**30
  print(
    f'{"topology":<11}{"model":<9}{"configuration":<26}{"bubble":>7}{"temp GiB":>9}'
    f'{"temp/FSDP":>10}{"est. ms":>9}{"vs std":>7}{"cyc x":>7}{"compile s":>10}'
  )
  for topology in FLAGS.topology:
    chips = aot.get_topology(topology).num_chips
    standard, fsdp_temp = {}, {}  # the standard's row per configuration
    for mode in FLAGS.tpu_modes:
      for configuration in tpu_configurations():
        label, stages = configuration[:2]
        row = tpu_row(topology, chips, mode, configuration)
        if 'error' in row:
          rows.append(row)
          print(
            f'{topology:<11}{mode:<9}{label:<26} failed: {row["error"][:100]}',
            flush=True,
          )
          continue
        if stages == 1:
          fsdp_temp[mode] = row['temp_bytes']
        if mode == 'standard':
          standard[label] = row
        row['temp_vs_fsdp'] = (
          row['temp_bytes'] / fsdp_temp[mode] if mode in fsdp_temp else None
        )
        versus_standard = lambda key: (
          row[key] / standard[label][key] if label in standard else None
        )
        row['step_vs_standard'] = versus_standard('est_step_seconds')
        row['cycles_vs_standard'] = versus_standard('compiler_cycles_loops_counted')
        rows.append(row)
        ratio = row['step_vs_standard']
        print(
          f'{topology:<11}{mode:<9}{label:<26}{row["bubble"]:>7.3f}'
          f'{row["temp_bytes"] / gib:>9.2f}'
          f'{row["temp_vs_fsdp"] or float("nan"):>10.2f}'
          f'{row["est_step_seconds"] * 1e3:>9.1f}'
          f'{ratio if ratio is not None else float("nan"):>7.3f}'
          f'{row["cycles_vs_standard"] or float("nan"):>7.3f}'
          f'{row["compile_seconds"]:>10.0f}',
          flush=True,
        )
        metrics_lib.write_jsonl(FLAGS.out, rows)  # a long table keeps what it ran
  return rows


def main(argv):
  del argv
  parts = set(FLAGS.parts)
  if parts - {'comm', 'time', 'tpu'}:
    raise app.UsageError(f'--parts: of comm, time, tpu; got {FLAGS.parts}.')
  if 'tpu' in parts and not FLAGS.topology:
    raise app.UsageError('--parts=tpu needs --topology, e.g. v5p:2x2x1.')
  if parts & {'comm', 'time'}:
    assert jax.device_count() == NUM_DEVICES, jax.devices()
  rows = []
  if 'comm' in FLAGS.parts:
    rows += communication()
  if 'time' in FLAGS.parts:
    rows += step_times()
  if 'tpu' in FLAGS.parts:
    rows += tpu_rows()
  metrics_lib.write_jsonl(FLAGS.out, rows)


if __name__ == '__main__':
  app.run(main)
