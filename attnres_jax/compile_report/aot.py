"""Ahead-of-time compilation for a TPU topology, on any host: what a pod would run.

The TPU compiler ships in the `libtpu` wheel and compiles for an abstract topology
(`jax.experimental.topologies`) without a TPU. `compile_report(config, 'v5p:2x2x1')`
builds the config's mesh over the topology's devices, compiles the exact train step,
eval step and decode step (`training/step.py`'s `jit_train_step` and `jit_eval_step`,
`sampling`'s one-token step: `compile_report/decode_lowering.py`) on abstract inputs,
and reports per step (`compile_report/step_summary.py`): memory per device against
the chip's HBM, FLOPs, bytes accessed, the compiler's step-time estimate, the
estimated MFU and the collectives, loops counted (`compile_report/hlo_cost.py` and
`compile_report/hlo_loops.py`: XLA's own totals count a loop body once). Memory is
that of the program as configured (scanned layers: the memory a real run allocates).

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

from attnres_jax import config as config_lib
from attnres_jax import residuals
from attnres_jax.compile_report import decode_lowering
from attnres_jax.compile_report import step_summary
from attnres_jax.compile_report.tpu_topology import AotError
from attnres_jax.compile_report.tpu_topology import GIB
from attnres_jax.compile_report.tpu_topology import TOPOLOGY_FORM
from attnres_jax.compile_report.tpu_topology import get_topology
from attnres_jax.nn import sharding
from attnres_jax.parallel import pipeline
from attnres_jax.parallel import pipeline_plan
from attnres_jax.runs import checkpointing
from attnres_jax.training import optim
from attnres_jax.training import step as train_lib

REPORT_JSON = 'compile_report.json'
STEPS = ('train', 'eval', 'decode')


def _batch_structs(layout, rows: int, seq_len: int):
  token = jax.ShapeDtypeStruct((rows, seq_len), jnp.int32, sharding=layout.batch)
  weight = jax.ShapeDtypeStruct((rows, seq_len), jnp.float32, sharding=layout.batch)
  return {'inputs': token, 'targets': token, 'weights': weight}


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


def _compile_step(lower, step: str, topology: str):
  """`lower()` compiled for the topology; ValueError with the compiler's words where
  the step runs out of memory, HBM per device or one kernel's on-chip VMEM."""
  try:
    return _compile_uncached(lower())
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
  `training/step.py`'s `check_memory`) for a step that needs more memory per device
  than the chip has.
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
  tx, schedule = optim.make_optimizer(tc, config.model)
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
    'decode': lambda: decode_lowering.decode_lowered(config, mesh, rules),
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
    compiled = _compile_step(lowering[step], step, topology)
    summary = step_summary.summarize(
      compiled,
      time.perf_counter() - start,
      topo,
      step_summary.step_model_flops(config, step),
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
    if s.get('est_source') == 'roofline':
      lines.append(
        "        est.: our per-kernel roofline, loops counted (the compiler's own "
        'estimate was not positive)'
      )
    if s.get('analytic_kernel_seconds'):
      lines.append(
        f'        splash attention: {s["analytic_kernel_seconds"] * 1e3:.2f} ms of the '
        'estimate, costed analytically (its FLOPs and bytes, causal half; the '
        "compiler's estimate leaves the kernel out)"
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
