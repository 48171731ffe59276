"""FLOPs, bytes, time and collectives of an optimized HLO module, loops counted.

XLA's `cost_analysis()` visits every computation once, so the body of a while loop
(`lax.scan`, `fori_loop`: the scanned layers, gradient accumulation, the pipeline's
iterations, mHC's Sinkhorn) counts once whatever its trip count. `analyze` reads the
optimized HLO text instead and weighs each computation by how often it runs: the entry
once, a while body `n` times per run of the computation holding the loop (nested loops
multiply), its condition `n + 1` times, a called computation as often as its caller,
each of a conditional's N branches 1 / N times as often (`hlo_loops`).

Per instruction of a non-fused computation (what runs as one kernel):
  flops, bytes  as XLA counts them (`hlo_kernel_cost`: a Pallas kernel by its
                CostEstimate)
  cycles        the TPU compiler's own estimate of the kernel (`estimated_cycles` in its
                backend config): scaled by the program's cycles-to-seconds ratio, the
                compiler's step time with loops counted. A Pallas kernel carries none
                (the compiler costs it by its CostEstimate): its roofline is kept
                apart (`roofline_pallas`) so that a view of the cycles can add it;
                that of the kernels costed analytically (`roofline_analytic`: splash
                attention, which the compiler's step time leaves out) too
  collectives   all-gather, reduce-scatter, all-reduce, collective-permute, all-to-all:
                count and bytes (the larger of the per-device input and output: the
                gathered result, the scattered input)
"""

from __future__ import annotations

import collections
import re
from typing import Any

from attnres_jax.compile_report import hlo_kernel_cost
from attnres_jax.compile_report import hlo_loops
from attnres_jax.compile_report import hlo_text

COLLECTIVES = (
  'all-gather',
  'reduce-scatter',
  'all-reduce',
  'collective-permute',
  'all-to-all',
)


def _bytes(
  instruction: hlo_text.Instruction, computation: hlo_text.Computation, computations
) -> float:
  reads, written = hlo_kernel_cost.kernel_bytes(instruction, computation, computations)
  return sum(reads) + written


def _collective(instruction: hlo_text.Instruction, computations) -> str | None:
  op = instruction.opcode
  if op == 'async-start':
    called = computations.get((instruction.called('calls') or [''])[0], [])
    op = called[-1].opcode if called else ''
  base = op[: -len('-start')] if op.endswith('-start') else op
  return base if base in COLLECTIVES else None


def _collective_bytes(
  instruction: hlo_text.Instruction, computation: hlo_text.Computation
) -> float:
  operands = sum(
    hlo_text.type_bytes(computation.type_of(o)) for o in instruction.operands
  )
  out = hlo_text.type_bytes(instruction.type_str)
  if instruction.opcode.endswith('-start') and instruction.type_str.startswith('('):
    out = hlo_kernel_cost.start_output_bytes(
      instruction,
      [hlo_text.type_bytes(computation.type_of(o)) for o in instruction.operands],
    )
  return max(operands, out)


def _contains_dot(instruction: hlo_text.Instruction, computations) -> bool:
  if instruction.opcode in ('dot', 'convolution'):
    return True
  if instruction.opcode != 'fusion':
    return False
  return any(
    _contains_dot(i, computations) for i in computations[instruction.called('calls')[0]]
  )


def kind_of(instruction: hlo_text.Instruction, computations) -> str:
  """What a kernel's roofline time goes to: matmul (a dot or convolution in it),
  copies (copies and transposes: relayouts and moves between memories), collectives,
  or other (elementwise, reductions, slices)."""
  if _collective(instruction, computations) is not None:
    return 'collectives'
  if instruction.opcode in ('copy', 'copy-start', 'transpose'):
    return 'copies'
  return 'matmul' if _contains_dot(instruction, computations) else 'other'


def analyze(
  text: str, peak_flops: float = 1.0, hbm_bandwidth: float = 1.0
) -> dict[str, Any]:
  """Costs of one device's optimized HLO, loops counted (see the module docstring):
  flops, transcendentals, bytes (`bytes_async_copies`: the share of copy-start, async
  moves between memories), cycles, roofline seconds (per kernel the larger of flops /
  `peak_flops` and bytes / `hbm_bandwidth`; `roofline_<kind>` by `kind_of`, and
  `roofline_matmul_bytes_bound` of matmul kernels limited by bytes,
  `roofline_pallas` of the Pallas kernels, which carry no cycles), each also
  `<name>_once` (as XLA's totals count: every computation once, and of a
  conditional's branches the largest), collectives by kind, and the trip counts
  found."""
  computations, entry = hlo_text.parse_module(text)
  counts, unknown = hlo_loops.multiplicities(computations, entry)
  totals = collections.defaultdict(float)
  own = collections.defaultdict(lambda: collections.defaultdict(float))  # per computation
  collectives = {kind: {'count': 0.0, 'bytes': 0.0} for kind in COLLECTIVES}
  trips = []
  for name, times in counts.items():
    computation = hlo_text.Computation(computations[name])
    for instruction in computation.instructions:
      flops, transcendentals = hlo_kernel_cost.arithmetic(
        instruction, computation, computations
      )
      moved = _bytes(instruction, computation, computations)
      cycles = re.search(r'"estimated_cycles":"(\d+)"', instruction.attrs)
      cycles = float(cycles.group(1)) if cycles else 0.0
      roofline = max(flops / peak_flops, moved / hbm_bandwidth)
      kind = kind_of(instruction, computations)
      totals['roofline_' + kind] += times * roofline
      estimate = hlo_kernel_cost.kernel_estimate(instruction)
      if estimate is not None:
        totals['roofline_pallas'] += times * roofline
      analytic = roofline if estimate and estimate.get('analytic') else 0.0
      if kind == 'matmul' and moved / hbm_bandwidth > flops / peak_flops:
        totals['roofline_matmul_bytes_bound'] += times * roofline
      for key, once in (
        ('flops', flops),
        ('transcendentals', transcendentals),
        ('bytes', moved),
        ('cycles', cycles),
        ('roofline', roofline),
        ('roofline_analytic', analytic),
      ):
        totals[key] += times * once
        own[name][key] += once
      if instruction.opcode == 'copy-start':
        totals['bytes_async_copies'] += times * moved
      kind = _collective(instruction, computations)
      if kind is not None:
        collectives[kind]['count'] += times
        collectives[kind]['bytes'] += times * _collective_bytes(instruction, computation)
      if instruction.opcode == 'while':
        trips.append(hlo_loops.trip_count(computations, instruction, computation))
  for key, once in _once(computations, entry, own).items():
    totals[key + '_once'] = once
  return dict(
    totals, collectives=collectives, while_trip_counts=trips, unknown_trip_counts=unknown
  )


def _once(computations, name, own, memo=None) -> dict[str, float]:
  """`own` (per computation, its instructions' totals) summed as XLA's cost analysis
  sums a program: each called computation once, and per total the largest of a
  conditional's branches (measured: a switch between 1 and 5 matmuls counts 5)."""
  memo = {} if memo is None else memo
  if name in memo:
    return memo[name]
  total = collections.Counter(own[name])
  for instruction in hlo_text.Computation(computations[name]).instructions:
    if instruction.opcode == 'while':
      for key in ('body', 'condition'):
        for callee in instruction.called(key):
          total.update(_once(computations, callee, own, memo))
    elif instruction.opcode in ('call', 'conditional'):  # a call: its one callee
      callees = [
        _once(computations, c, own, memo) for c in hlo_loops.called_once(instruction)
      ]
      for key in {k for callee in callees for k in callee}:
        total[key] += max(callee.get(key, 0.0) for callee in callees)
  memo[name] = dict(total)
  return memo[name]


def estimated_seconds(costs: dict[str, Any], compiler_seconds: float) -> float:
  """The compiler's step time with loops counted: its own estimate (`optimal_seconds`,
  a roofline with loop bodies once) scaled by our roofline with loops counted / once,
  both without the kernels costed analytically, whose roofline (loops counted) is
  added: the compiler's estimate leaves them out (`splash_cost`). Where the compiler's
  estimate is not positive (v6e-256, the 1B step: -16.0 s), our roofline alone."""
  if compiler_seconds <= 0:
    return costs['roofline']
  analytic = costs.get('roofline_analytic', 0.0)
  rest_once = costs.get('roofline_once', 0.0) - costs.get('roofline_analytic_once', 0.0)
  if rest_once <= 0:
    return compiler_seconds + analytic
  return compiler_seconds * (costs['roofline'] - analytic) / rest_once + analytic
