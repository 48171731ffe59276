"""The bytes of an optimized TPU module that cross HBM, loops counted.

`hlo_cost.analyze` counts bytes as XLA's "bytes accessed" does: every operand read and
every result written, wherever it lives. The TPU compiler places some buffers in
on-chip memory (memory space 1, the `S(1)` in a layout) and prefetches weights and
activations there with async copies (`copy-start`); "bytes accessed" then counts such a
value three times (the copy's read, its write on chip, the consumer's on-chip read),
although it crosses HBM once. Here an operand or result in on-chip memory counts
nothing and an async copy counts only its HBM side, so a prefetched value costs what
it costs a program that reads it straight from HBM.

`hbm_costs` totals those bytes and a roofline over them (per kernel the larger of
FLOPs / peak and HBM bytes / bandwidth), with loops counted as in `hlo_cost`.
"""

from __future__ import annotations

import collections

from attnres_jax.compile_report import hlo_kernel_cost
from attnres_jax.compile_report import hlo_loops
from attnres_jax.compile_report import hlo_text

ON_CHIP = 'S(1)'  # the memory-space mark of an on-chip (VMEM) buffer in a TPU layout


def on_chip(type_str: str) -> bool:
  return ON_CHIP in type_str


def _off_chip_share(type_str: str) -> float:
  """The fraction of a (tuple) type's bytes that is not in on-chip memory."""
  parts = hlo_text.split_top(type_str[1:-1]) if type_str.startswith('(') else [type_str]
  total = sum(hlo_text.type_bytes(p) for p in parts)
  off_chip = sum(hlo_text.type_bytes(p) for p in parts if not on_chip(p))
  return off_chip / total if total else 0.0


def kernel_hbm_bytes(
  instruction: hlo_text.Instruction, computation: hlo_text.Computation, computations
) -> float:
  """Bytes of one kernel that cross HBM: `hlo_kernel_cost.kernel_bytes` less what lies in
  on-chip memory; an async copy (destination, source, context) counts its off-chip
  side; a Pallas kernel its CostEstimate's bytes (`hlo_kernel_cost.kernel_estimate`) less
  the share of its operands and results held on chip."""
  if instruction.opcode == 'copy-start':
    source = computation.type_of(instruction.operands[0])
    destination = hlo_text.split_top(instruction.type_str[1:-1])[0]
    return sum(
      0.0 if on_chip(t) else hlo_text.type_bytes(t) for t in (source, destination)
    )
  types = [computation.type_of(o) for o in instruction.operands]
  estimate = hlo_kernel_cost.kernel_estimate(instruction)
  if estimate is not None:
    # A Pallas kernel states its traffic in all, not per operand: the share of it
    # that crosses HBM taken as its operands' and results' off-chip share of bytes.
    sizes = [hlo_text.type_bytes(t) for t in types]
    total = sum(sizes) + hlo_text.type_bytes(instruction.type_str)
    off_chip = sum(b for b, t in zip(sizes, types) if not on_chip(t))
    off_chip += hlo_text.type_bytes(instruction.type_str) * _off_chip_share(
      instruction.type_str
    )
    return estimate['bytes_accessed'] * (off_chip / total if total else 1.0)
  reads, written = hlo_kernel_cost.kernel_bytes(instruction, computation, computations)
  off_chip_reads = sum(b for b, t in zip(reads, types) if not on_chip(t))
  return off_chip_reads + written * _off_chip_share(instruction.type_str)


def hbm_costs(text: str, peak_flops: float = 1.0, bandwidth: float = 1.0) -> dict:
  """{'hbm_bytes', 'hbm_seconds'} of one device's optimized TPU module, loops counted."""
  computations, entry = hlo_text.parse_module(text)
  counts, _ = hlo_loops.multiplicities(computations, entry)
  totals = collections.Counter({'hbm_bytes': 0.0, 'hbm_seconds': 0.0})
  for name, times in counts.items():
    computation = hlo_text.Computation(computations[name])
    for instruction in computation.instructions:
      moved = kernel_hbm_bytes(instruction, computation, computations)
      flops, _ = hlo_kernel_cost.arithmetic(instruction, computation, computations)
      totals['hbm_bytes'] += times * moved
      totals['hbm_seconds'] += times * max(flops / peak_flops, moved / bandwidth)
  return dict(totals)
