"""Where two compiled programs differ in the TPU compiler's own cost, kernel by kernel.

The compile-only report's step estimate is the compiler's (every loop body once) scaled
by our roofline with loops counted (`hlo_cost.estimated_seconds`). The optimized HLO
also carries the compiler's cycle estimate of each kernel (`estimated_cycles` in its
backend config). Multiplied by each loop's trip count and summed, those cycles
track the estimate's ratio between two programs (d1024 v5p:2x2x1, Block S=4 against
the standard step: 1.058x in both, measured once; 1.050x in cycles against the
estimate's 1.036x after a change to the depth buffer's indexing: they part where the
compiler's cycles and our roofline disagree), so a difference can be attributed
kernel by kernel, including what the byte roofline does not see: the compiler
charges reductions and relayouting pads several times their bytes. Kernels are
grouped by direction (forward or backward: 'transpose' in the JAX op that made them),
kind (`hlo_cost.kind_of`) and what they do (the opcode, or for a fusion the JAX op
that made its root). `bench/hlo_diff.py` prints the table for two dumps of
`bench/aot.py --hlo_dir`.
"""

from __future__ import annotations

import collections
import re
from typing import NamedTuple

from attnres_jax.compile_report import hlo_cost
from attnres_jax.compile_report import hlo_hbm
from attnres_jax.compile_report import hlo_kernel_cost
from attnres_jax.compile_report import hlo_loops
from attnres_jax.compile_report import hlo_text


class Kernel(NamedTuple):
  """One instruction of the program (in computation `computation`), with its loop's
  trip count (`times`), the compiler's cycles for one execution and our roofline
  seconds for one."""

  computation: str
  name: str
  opcode: str
  type_str: str
  op_name: str
  kind: str
  times: float
  cycles: float
  roofline_seconds: float
  hbm_bytes: float  # one execution's bytes that cross HBM (`hlo_hbm`)

  @property
  def direction(self) -> str:
    return 'bwd' if 'transpose(' in self.op_name else 'fwd'

  @property
  def what(self) -> str:
    """The opcode, or for a fusion 'fusion:' and the last JAX op of its op_name
    without a numeric suffix ('fusion:reduce_sum')."""
    if self.opcode != 'fusion':
      return self.opcode
    last = self.op_name.rsplit('/', 1)[-1]
    return 'fusion:' + re.sub(r'\.\d+$', '', last)

  @property
  def group(self) -> tuple[str, str, str]:
    return self.direction, self.kind, self.what


def kernels(text: str, peak_flops: float, bandwidth: float) -> list[Kernel]:
  """Every instruction of one device's optimized HLO with its trip count."""
  return module_kernels(*hlo_text.parse_module(text), peak_flops, bandwidth)


def module_kernels(computations, entry: str, peak_flops: float, bandwidth: float):
  """`kernels` of an HLO module already parsed (`hlo_text.parse_module`)."""
  counts, _ = hlo_loops.multiplicities(computations, entry)
  found = []
  for name, times in counts.items():
    computation = hlo_text.Computation(computations[name])
    for instruction in computation.instructions:
      flops, _ = hlo_kernel_cost.arithmetic(instruction, computation, computations)
      reads, written = hlo_kernel_cost.kernel_bytes(
        instruction, computation, computations
      )
      cycles = re.search(r'"estimated_cycles":"(\d+)"', instruction.attrs)
      op_name = re.search(r'op_name="([^"]*)"', instruction.attrs)
      found.append(
        Kernel(
          computation=name,
          name=instruction.name,
          opcode=instruction.opcode,
          type_str=instruction.type_str,
          op_name=op_name.group(1) if op_name else '',
          kind=hlo_cost.kind_of(instruction, computations),
          times=times,
          cycles=float(cycles.group(1)) if cycles else 0.0,
          roofline_seconds=max(flops / peak_flops, (sum(reads) + written) / bandwidth),
          hbm_bytes=hlo_hbm.kernel_hbm_bytes(instruction, computation, computations),
        )
      )
  return found


SUMMED = ('cycles', 'roofline_seconds', 'hbm_bytes')  # per group, loops counted


def by_group(found: list[Kernel]) -> dict[tuple[str, str, str], dict[str, float]]:
  """{(direction, kind, what): {'cycles', 'roofline_seconds', 'hbm_bytes'}}, loops
  counted."""
  groups = collections.defaultdict(lambda: dict.fromkeys(SUMMED, 0.0))
  for kernel in found:
    for key in SUMMED:
      groups[kernel.group][key] += kernel.times * getattr(kernel, key)
  return dict(groups)


def total_cycles(found: list[Kernel]) -> float:
  return sum(kernel.times * kernel.cycles for kernel in found)


def diff(base: list[Kernel], other: list[Kernel], by: str = 'cycles') -> list[dict]:
  """Per group, the base's and the other's cycles, roofline seconds and HBM bytes
  (loops counted) and the other minus the base, largest difference in `by` ('cycles'
  or 'hbm_bytes') first."""
  base_groups, other_groups = by_group(base), by_group(other)
  zero = dict.fromkeys(SUMMED, 0.0)
  rows = []
  for group in set(base_groups) | set(other_groups):
    a, b = base_groups.get(group, zero), other_groups.get(group, zero)
    rows.append(
      dict(
        direction=group[0],
        kind=group[1],
        what=group[2],
        base_cycles=a['cycles'],
        other_cycles=b['cycles'],
        delta_cycles=b['cycles'] - a['cycles'],
        delta_roofline_seconds=b['roofline_seconds'] - a['roofline_seconds'],
        base_hbm_bytes=a['hbm_bytes'],
        other_hbm_bytes=b['hbm_bytes'],
        delta_hbm_bytes=b['hbm_bytes'] - a['hbm_bytes'],
      )
    )
  rows.sort(key=lambda row: -abs(row[f'delta_{by}']))
  return rows


def costliest(found: list[Kernel], count: int) -> list[Kernel]:
  """The `count` kernels with the most cycles, loops counted."""
  return sorted(found, key=lambda kernel: -kernel.times * kernel.cycles)[:count]
