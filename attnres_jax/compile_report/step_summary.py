"""One compiled step's figures for the report: memory per device against the chip's
HBM, FLOPs, bytes accessed and those that cross HBM, the step-time estimate, the
compiler's cycles, the estimated MFU and the collectives, loops counted
(`compile_report/hlo_cost.py`, `compile_report/hlo_hbm.py`)."""

from __future__ import annotations

from typing import Any

from attnres_jax import flops as flops_lib
from attnres_jax.compile_report import hlo_cost
from attnres_jax.compile_report import hlo_hbm
from attnres_jax.compile_report.tpu_topology import Topology
from attnres_jax.training import step as train_lib


def step_model_flops(config, step: str) -> float:
  """Model FLOPs of one step (no recompute): 3x forward to train, 1x to evaluate, one
  token per row to decode."""
  tc = config.train
  per_token = flops_lib.forward_flops_per_token(config.model, tc.seq_len)['total']
  if step == 'decode':
    return per_token * tc.batch_size
  return per_token * tc.batch_size * tc.seq_len * (3.0 if step == 'train' else 1.0)


def summarize(compiled, seconds: float, topo: Topology, model_flops: float) -> dict:
  """The report's entry for one compiled step (`seconds`: its compile time)."""
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
      # What must fit (`training/step.py`'s `compiled_memory_need`): the peak
      # and the code.
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
    # Which estimate that is: the compiler's scaled by our roofline's loop factor, or,
    # where the compiler's is not positive, our roofline alone.
    'est_source': 'compiler' if compiler_seconds > 0 else 'roofline',
    # A second view of the step: the compiler's own per-kernel cycle estimates summed
    # with loops counted. `est_step_seconds` scales the compiler's whole-program
    # seconds (loops once) by our roofline's loop factor, which can move two programs
    # apart when their loop bodies differ (d1024, Block S=4 against the standard:
    # 1.10x on the estimate, 1.061x in cycles).
    'compiler_cycles_loops_counted': costs['cycles'],
    # With every computation once, as `xla_seconds_loops_once` counts: their ratio is
    # not one clock across programs (1.99 to 2.51 GHz over 14 programs at d1024).
    'compiler_cycles_loops_once': costs['cycles_once'],
    # The cycles leave out Pallas kernels (they carry none; the compiler costs them by
    # their CostEstimates, as our roofline does). This view adds them, charged at the
    # program's own rate: its cycles per roofline second of everything else.
    'pallas_roofline_seconds': costs.get('roofline_pallas', 0.0),
    # Of those, the kernels that state no cost (splash attention), costed analytically
    # (`splash_cost`) and added to `est_step_seconds`, which would leave them out.
    'analytic_kernel_seconds': costs.get('roofline_analytic', 0.0),
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
