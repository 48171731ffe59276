"""Ahead-of-time compilation for a TPU topology, on any host: what a pod would run.

The TPU compiler ships in the `libtpu` wheel and compiles for an abstract topology
(`jax.experimental.topologies`) without a TPU. `compile_report(config, 'v5p:2x2x1')`
builds the config's mesh over the topology's devices, compiles the exact train step,
eval step and decode step (`train.jit_train_step`, `train.jit_eval_step`,
`sampling`'s one-token step) on abstract inputs, and reports per step: memory per
device against the chip's HBM, FLOPs, bytes accessed, the compiler's step-time
estimate, the estimated MFU and the collectives, loops counted (`hlo_cost.py` and
`hlo_loops.py`: XLA's own totals count a loop body once). Memory is that of the
program as configured (scanned layers: the memory a real run allocates).

The topologies and their chips' figures are `tpu_topology`'s.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from attnres_jax.runs import checkpointing
from attnres_jax import config as config_lib
from attnres_jax import flops as flops_lib
from attnres_jax.compile_report import hlo_cost
from attnres_jax.compile_report import hlo_hbm
from attnres_jax.nn import kv_cache
from attnres_jax.models import transformer as model_lib
from attnres_jax.training import optim
from attnres_jax.parallel import pipeline
from attnres_jax.parallel import pipeline_plan
from attnres_jax import residuals
from attnres_jax.inference import sampling
from attnres_jax.nn import sharding
from attnres_jax.training import step as train_lib
from attnres_jax.compile_report.tpu_topology import GIB
from attnres_jax.compile_report.tpu_topology import TOPOLOGY_FORM
from attnres_jax.compile_report.tpu_topology import AotError
from attnres_jax.compile_report.tpu_topology import Topology
from attnres_jax.compile_report.tpu_topology import get_topology

REPORT_JSON = 'compile_report.json'
STEPS = ('train', 'eval', 'decode')


def _structs(tree, shardings):
  return jax.tree.map(
    lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings
  )


def _batch_structs(layout, rows: int, seq_len: int):
  token = jax.ShapeDtypeStruct((rows, seq_len), jnp.int32, sharding=layout.batch)
  weight = jax.ShapeDtypeStruct((rows, seq_len), jnp.float32, sharding=layout.batch)
  return {'inputs': token, 'targets': token, 'weights': weight}


def decode_lowered(config, mesh, rules, weights_dtype=None):
  """`sampling`'s one-token step lowered on abstract inputs for a batch of
  `train.batch_size` rows and a cache of `train.seq_len` slots: the parameters sharded
  as training shards them, each layer's as its slice of the stack, the weight matrices
  cast to `weights_dtype` when given (`sampling.serving_state`)."""
  cfg, rows, slots = config.model, config.train.batch_size, config.train.seq_len
  abstract = nnx.eval_shape(lambda: model_lib.Transformer(cfg, rngs=nnx.Rngs(0)))
  graphdef, abstract_state = nnx.split(abstract)
  specs = sharding.param_shardings(abstract_state, mesh, rules)  # a pure dict

  def served(state):
    _, state, layers = sampling.serving_state(nnx.merge(graphdef, state), weights_dtype)
    return nnx.to_pure_dict(state), tuple(nnx.to_pure_dict(x) for x in layers)

  state_dict, layer_dicts = jax.eval_shape(served, abstract_state)
  layer_specs = jax.tree.map(
    lambda s: NamedSharding(mesh, P(*s.spec[1:])), specs['layers']
  )
  state = jax.tree.map(lambda x: x, abstract_state)
  nnx.replace_by_pure_dict(state, _structs(state_dict, specs))
  layers = []
  for layer_dict in layer_dicts:
    layer = jax.tree.map(lambda x: x, nnx.split(abstract.layers)[1])
    nnx.replace_by_pure_dict(layer, _structs(layer_dict, layer_specs))
    layers.append(layer)

  def placed(shape, dtype, axes):
    spec = sharding.logical_to_spec(axes, rules, mesh=mesh, shape=shape)
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))

  cache = tuple(
    kv_cache.KVCache(
      placed(c.keys_BNHS.shape, c.keys_BNHS.dtype, kv_cache.KEYS_AXES),
      placed(c.values_BNSH.shape, c.values_BNSH.dtype, kv_cache.VALUES_AXES),
    )
    for c in jax.eval_shape(lambda: abstract.init_cache(rows, slots))
  )
  row = placed((rows,), jnp.int32, ('batch',))
  replicated = NamedSharding(mesh, P())
  scalar = lambda dtype: jax.ShapeDtypeStruct((), dtype, sharding=replicated)
  key = jax.eval_shape(lambda: jax.random.PRNGKey(0))
  args = (
    state,
    tuple(layers),
    row,
    cache,
    scalar(jnp.int32),
    row,
    jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=replicated),
    scalar(jnp.float32),
    scalar(jnp.int32),
    jax.ShapeDtypeStruct((1,), jnp.int32, sharding=replicated),
    placed((rows,), jnp.bool_, ('batch',)),
  )
  with sharding.logical_rules(mesh, rules):  # traced here: constrain as in serving
    return sampling._step.lower(graphdef, *args)  # pylint: disable=protected-access


def _model_flops(config, step: str) -> float:
  """Model FLOPs of one step (no recompute): 3x forward to train, 1x to evaluate, one
  token per row to decode."""
  tc = config.train
  per_token = flops_lib.forward_flops_per_token(config.model, tc.seq_len)['total']
  if step == 'decode':
    return per_token * tc.batch_size
  return per_token * tc.batch_size * tc.seq_len * (3.0 if step == 'train' else 1.0)


def residual_floor(model_cfg, tokens: int, num_devices: int) -> dict[str, Any] | None:
  """The least extra HBM bytes per device that the residual must add to a train step
  of `tokens` tokens (`Residual.min_extra_per_sublayer`, in d elements of the compute
  dtype, the depth buffer's storage dtype), spread evenly over the devices; None for a
  residual that declares no floor."""
  cfg = config_lib.ModelConfig.from_config(model_cfg)
  units = residuals.make(cfg).min_extra_per_sublayer()
  if units is None:
    return None
  itemsize = jnp.dtype(cfg.dtype).itemsize
  total = units * cfg.d_model * itemsize * tokens * 2 * cfg.num_layers
  return {'units_per_sublayer': units, 'bytes': total / num_devices}


def extra_over_floor(
  step: dict[str, Any], standard_step: dict[str, Any], key: str = 'bytes_accessed'
) -> float | None:
  """(the step's bytes - the standard step's) / the residual's floor, both train steps
  of the same shape compiled for the same topology; None without a floor. `key`:
  'bytes_accessed' (loops counted, as XLA counts bytes accessed) or 'hbm_bytes', those
  that cross HBM (`hlo_hbm`), the quantity the floor itself counts (bytes accessed
  also count operands held on chip and a prefetched value three times)."""
  floor = step.get('residual_floor')
  if not floor or not floor['bytes']:
    return None
  return (step[key] - standard_step[key]) / floor['bytes']


def _summarize(compiled, seconds: float, topo: Topology, model_flops: float) -> dict:
  memory = compiled.memory_analysis()
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  text = compiled.as_text()
  bandwidth = topo.chip.hbm_bandwidth / topo.devices_per_chip
  costs = hlo_cost.analyze(text, topo.device_peak_flops, bandwidth)
  hbm = hlo_hbm.hbm_costs(text, topo.device_peak_flops, bandwidth)
  compiler_seconds = float(cost.get('optimal_seconds', 0.0))
  step_seconds = hlo_cost.estimated_seconds(costs, compiler_seconds)
  peak = topo.device_peak_flops * len(topo.devices)
  return {
    'compile_seconds': seconds,
    'memory': {
      'argument_bytes': memory.argument_size_in_bytes,
      'output_bytes': memory.output_size_in_bytes,
      'alias_bytes': memory.alias_size_in_bytes,
      'temp_bytes': memory.temp_size_in_bytes,
      # The compiler's own peak (arguments, outputs and temporaries live at once);
      # unlike temp it is not the sum of the step's temporary allocations.
      'peak_bytes': getattr(memory, 'peak_memory_in_bytes', None),
      'code_bytes': memory.generated_code_size_in_bytes,
      'total_bytes': train_lib.summed_memory_bytes(memory),
      # What must fit (`train.compiled_memory_need`): the peak and the code.
      'need_bytes': train_lib.compiled_memory_need(memory),
      'capacity_bytes': topo.device_hbm_bytes,
    },
    'flops': costs['flops'],
    'transcendentals': costs['transcendentals'],
    'bytes_accessed': costs['bytes'],
    'bytes_async_copies': costs['bytes_async_copies'],
    # What crosses HBM (on-chip operands and the on-chip side of prefetches left
    # out, `hlo_hbm`) and a roofline over it, loops counted.
    'hbm_bytes': hbm['hbm_bytes'],
    'hbm_roofline_seconds': hbm['hbm_seconds'],
    'xla_flops_loops_once': float(cost.get('flops', 0.0)),
    'xla_bytes_loops_once': float(cost.get('bytes accessed', 0.0)),
    'xla_seconds_loops_once': compiler_seconds,
    'est_step_seconds': step_seconds,
    # A second view of the step: the compiler's own per-kernel cycle estimates summed
    # with loops counted. `est_step_seconds` scales the compiler's whole-program
    # seconds (loops once) by our roofline's loop factor, which can move two programs
    # apart when their loop bodies differ (docs/results.md, tenth pass).
    'compiler_cycles_loops_counted': costs['cycles'],
    # With every computation once, as `xla_seconds_loops_once` counts: their ratio is
    # not one clock across programs (docs/results.md, thirteenth pass).
    'compiler_cycles_loops_once': costs['cycles_once'],
    # The cycles leave out Pallas kernels (they carry none; the compiler costs them by
    # their CostEstimates, as our roofline does). This view adds them, charged at the
    # program's own rate: its cycles per roofline second of everything else.
    'pallas_roofline_seconds': costs.get('roofline_pallas', 0.0),
    'compiler_cycles_with_kernels': cycles_with_kernels(costs),
    'model_flops': model_flops,
    'est_mfu': model_flops / (step_seconds * peak) if step_seconds else None,
    'collectives': costs['collectives'],
    # Where the estimated time goes: shares of the loop-counted roofline.
    'time_shares': {
      k: costs.get('roofline_' + k, 0.0) / costs['roofline']
      for k in ('matmul', 'matmul_bytes_bound', 'other', 'copies', 'collectives')
    }
    if costs.get('roofline')
    else {},
    'while_trip_counts': costs['while_trip_counts'],
    'unknown_trip_counts': costs['unknown_trip_counts'],
  }


def cycles_with_kernels(costs: dict[str, Any]) -> float:
  """The compiler's cycles with loops counted plus the Pallas kernels' (which carry
  none), each kernel charged its roofline (from its CostEstimate) times the cycles
  the compiler gives a roofline second of the rest of the program."""
  kernels = costs.get('roofline_pallas', 0.0)
  rest = costs.get('roofline', 0.0) - kernels
  if not kernels or rest <= 0:
    return costs['cycles']
  return costs['cycles'] * (1.0 + kernels / rest)


def _compile_uncached(lowered):
  """Compiles without JAX's persistent compilation cache: an executable for abstract
  TPU devices cannot be loaded back on this host (JAX warns, then compiles again), so
  a cache set for the CPU work (JAX_COMPILATION_CACHE_DIR) would only gather unusable
  entries and warnings."""
  previous = jax.config.jax_enable_compilation_cache
  jax.config.update('jax_enable_compilation_cache', False)
  try:
    return lowered.compile()
  finally:
    jax.config.update('jax_enable_compilation_cache', previous)


def compile_report(
  config: ml_collections.ConfigDict,
  topology: str,
  num_slices: int = 1,
  steps=STEPS,
  check_hbm: bool = True,
  hlo_dir: str | None = None,
) -> dict[str, Any]:
  """Compiles `steps` of `config` for a TPU topology; the report (see module doc).

  Raises AotError for a bad topology or missing libtpu and ValueError for a config or
  mesh that cannot work, before compiling; with `check_hbm`, ValueError (from
  `train.check_memory`) for a step that needs more memory per device than the chip has.
  `hlo_dir`: also writes each step's optimized HLO there (`<step>.hlo.txt`).
  """
  unknown = sorted(set(steps) - set(STEPS))
  if unknown:
    raise AotError(f'Unknown steps {unknown}; steps are {STEPS}.')
  topo = get_topology(topology, num_slices)
  # The one validation pass, with the topology's device count: every section, the mesh,
  # the batch over the data-parallel devices and the pipeline.
  config_lib.validate(config, num_devices=len(topo.devices))
  tc = config.train
  pipe = pipeline_plan.from_mesh_config(config.mesh)
  mesh = sharding.make_mesh(config.mesh, devices=topo.devices)
  rules = sharding.rules_from_config(config.mesh)
  train_lib.check_memory(config, topo.device_hbm_bytes, num_devices=len(topo.devices))
  tx, schedule = optim.make_optimizer(tc)
  graphdef, _ = checkpointing.abstract_model(config.model)
  layout = train_lib.make_layout(config.model, tx, mesh, rules)
  batch = _batch_structs(layout, tc.batch_size, tc.seq_len)
  lowering = {
    'train': lambda: train_lib.jit_train_step(
      layout,
      graphdef=graphdef,
      tx=tx,
      schedule=schedule,
      grad_accum_steps=tc.grad_accum_steps,
      loss_fn=pipeline.make_loss_fn(pipe),
    ).lower(layout.abstract_state, batch),
    'eval': lambda: train_lib.jit_eval_step(layout, graphdef=graphdef).lower(
      layout.abstract_state.params, batch
    ),
    'decode': lambda: decode_lowered(config, mesh, rules),
  }
  report = {
    'topology': topology,
    'num_slices': num_slices,
    'chip': dataclasses.asdict(topo.chip),
    'num_chips': topo.num_chips,
    'num_devices': len(topo.devices),
    'mesh': dict(mesh.shape),
    'config': json.loads(config.to_json()),
    'steps': {},
  }
  for step in steps:
    start = time.perf_counter()
    try:
      compiled = _compile_uncached(lowering[step]())
    except jax.errors.JaxRuntimeError as e:
      if 'RESOURCE_EXHAUSTED' not in str(e):
        raise
      said = str(e).splitlines()[0]
      if 'memory space vmem' in said:  # a kernel's on-chip blocks, not the program
        raise ValueError(
          f'The {step} step does not compile for {topology}: the TPU compiler says '
          f'"{said}" (on-chip VMEM of one kernel, e.g. the Pallas depth kernel: '
          f"model.depth_kernel='xla' avoids it)."
        ) from None
      raise ValueError(
        f'The {step} step does not fit on {topology}: the TPU compiler says '
        f'"{said}" (HBM per device). Shard more (mesh.shape: fsdp, '
        'tensor; mesh.stage), lower the batch or seq_len, raise grad_accum_steps, or '
        'set model.remat.'
      ) from None
    summary = _summarize(
      compiled, time.perf_counter() - start, topo, _model_flops(config, step)
    )
    if hlo_dir:
      os.makedirs(hlo_dir, exist_ok=True)
      with open(os.path.join(hlo_dir, f'{step}.hlo.txt'), 'w', encoding='utf-8') as f:
        f.write(compiled.as_text())
    if step == 'train':
      summary['residual_floor'] = residual_floor(
        config.model, tc.batch_size * tc.seq_len, len(topo.devices)
      )
    report['steps'][step] = summary
    if check_hbm:
      train_lib.check_memory(
        config,
        topo.device_hbm_bytes,
        compiled=compiled,
        what=f'The {step} step on {topology}',
      )
  return report


def format_table(report: dict[str, Any]) -> str:
  """The report as a readable table, one row per step."""
  chip = report['chip']
  lines = [
    f'{report["topology"]} x {report["num_slices"]} slice(s): '
    f'{report["num_chips"]} {chip["generation"]} chips, {report["num_devices"]} '
    f'devices, mesh {report["mesh"]}; per device: {chip["hbm_bytes"] / GIB:.0f} GiB '
    f'HBM per chip, {chip["peak_flops"] / 1e12:.0f} TFLOP/s peak per chip.',
    f'{"step":<7}{"args GiB":>9}{"temp GiB":>9}{"need GiB":>10}{"TFLOP":>9}'
    f'{"GB acc.":>9}{"est. ms":>9}{"MFU":>6}  {"collectives (count / GB)":<46}'
    f'{"compile s":>9}',
  ]
  for step, s in report['steps'].items():
    m = s['memory']
    coll = ' '.join(
      f'{"".join(w[0] for w in k.split("-")).upper()} {v["count"]:.0f}/'
      f'{v["bytes"] / 1e9:.2f}'
      for k, v in s['collectives'].items()
      if v['count']
    )
    mfu = f'{s["est_mfu"]:.0%}' if s['est_mfu'] is not None and step != 'decode' else '-'
    lines.append(
      f'{step:<7}{m["argument_bytes"] / GIB:>9.2f}{m["temp_bytes"] / GIB:>9.2f}'
      f'{m["need_bytes"] / GIB:>10.2f}{s["flops"] / 1e12:>9.3f}'
      f'{s["bytes_accessed"] / 1e9:>9.2f}{s["est_step_seconds"] * 1e3:>9.2f}'
      f'{mfu:>6}  {coll or "-":<46}{s["compile_seconds"]:>9.1f}'
    )
    if s.get('time_shares'):
      lines.append(
        '        time: '
        + ', '.join(f'{k.replace("_", " ")} {v:.0%}' for k, v in s['time_shares'].items())
      )
  lines.append(
    'FLOPs, bytes and time per device with loops counted; AG all-gather, '
    'RS reduce-scatter, AR all-reduce, CP collective-permute, ATA all-to-all.'
  )
  return '\n'.join(lines)


def main(config, topology: str | None, num_slices: int, workdir: str | None) -> int:
  """`train.py --compile_only`: prints the table and writes the report (to `workdir`
  or stdout) after every step compiled; on bad input one line and exit code 1, with
  nothing written."""
  try:
    if not topology:
      raise AotError(f'--compile_only needs --topology, of the form {TOPOLOGY_FORM}.')
    report = compile_report(config, topology, num_slices)
  except (AotError, ValueError, jax.errors.JaxRuntimeError) as e:
    print(f'FATAL: {str(e).splitlines()[0]}', file=sys.stderr)
    return 1
  print(format_table(report), file=sys.stderr if workdir is None else sys.stdout)
  text = json.dumps(report, indent=2)
  if workdir is None:
    print(text)
  else:
    os.makedirs(workdir, exist_ok=True)
    path = os.path.join(workdir, REPORT_JSON)
    with open(path + '.tmp', 'w', encoding='utf-8') as f:
      f.write(text)
    os.replace(path + '.tmp', path)
    print(f'Wrote {path}.')
  return 0
