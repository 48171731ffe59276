"""A pipelined step's compiled HLO read: the bytes of its collective-permutes (the
stage transitions) and where the compiler's estimate goes, loop by loop
(`parallel/pipeline_plan.py` plans the transfers these measure)."""

from __future__ import annotations

import collections
import math
import re
from typing import Any

from attnres_jax.compile_report import hlo_diff
from attnres_jax.compile_report import hlo_text

_ITEMSIZE = {'f64': 8, 'f32': 4, 'bf16': 2, 'f16': 2, 's32': 4, 'u32': 4, 'pred': 1}


def collective_permutes(hlo_text: str) -> list[dict[str, Any]]:
  """Every collective-permute of a compiled module's text: its result shapes (per
  device), bytes per device, and whether it sits inside a loop body (not in the
  entry computation): the pipeline's transitions are the ones inside the schedule's
  loop (forward) and its transpose (backward)."""
  found, in_entry = [], False
  op = re.compile(r'= (.*?) collective-permute(?:-start)?\(')
  for line in hlo_text.splitlines():
    if line and not line[0].isspace() and line.rstrip().endswith('{'):
      in_entry = line.startswith('ENTRY')
    match = op.search(line)
    if not match:
      continue
    shapes, total = [], 0
    for dtype, dims in re.findall(r'(\w+)\[([\d,]*)\]', match.group(1)):
      if dtype in _ITEMSIZE:
        dims = tuple(int(d) for d in dims.split(',') if d)
        shapes.append(dims)
        total += math.prod(dims) * _ITEMSIZE[dtype]
    found.append(dict(shapes=shapes, bytes=total, in_loop=not in_entry))
  return found


def transition_bytes(hlo_text: str) -> int:
  """Bytes one device sends per stage transition: the collective-permutes inside the
  loop bodies of a forward-only module (one loop: the schedule)."""
  return sum(c['bytes'] for c in collective_permutes(hlo_text) if c['in_loop'])


# Where the estimate goes, by loop of the pipelined step: the schedule's loop
# ('outer': receiving, sending, the final read, the parameters' gradients) and the
# chunk's loops inside it, in the forward pass, the `remat` rerun and the backward.
LOOP_KINDS = ('matmul', 'other', 'copies', 'async copies', 'collectives')


def _kernels(text: str, peak_flops: float, bandwidth: float):
  """(loop, kind, roofline seconds with the loop's trip counts, `hlo_diff.Kernel`) per
  kernel of one device's optimized HLO. Loops are named by their op_name (fwd /
  rerun / bwd, outer / chunk); kinds as `hlo_cost`'s, with the asynchronous copies
  (copy-start) apart from the others."""
  names = {}
  for match in re.finditer(r'while\(.*?body=%(\S+?)[,\s].*?op_name="([^"]*)"', text):
    op_name = match.group(2)
    where = (
      'rerun' if 'rematted' in op_name else 'bwd' if 'transpose' in op_name else 'fwd'
    )
    names[match.group(1)] = where + ('/chunk' if op_name.count('while') > 1 else '/outer')
  computations, entry = hlo_text.parse_module(text)
  for kernel in hlo_diff.module_kernels(computations, entry, peak_flops, bandwidth):
    loop = names.get(
      kernel.computation, 'entry' if kernel.computation == entry else 'called'
    )
    kind = 'async copies' if kernel.opcode == 'copy-start' else kernel.kind
    yield loop, kind, kernel.times * kernel.roofline_seconds, kernel


def time_by_loop(text: str, est_seconds: float, peak_flops: float, bandwidth: float):
  """{loop: {kind: estimated seconds}} of one device's optimized HLO: per kernel the
  roofline (as `hlo_cost.analyze`), loops counted, scaled to the step's estimate.
  Loops are named by their op_name (fwd / rerun / bwd, outer / chunk); kinds as
  `hlo_cost`'s, with the asynchronous copies (copy-start: the compiler's moves
  between HBM and on-chip memory, which overlap compute) apart from the others."""
  split = collections.defaultdict(lambda: dict.fromkeys(LOOP_KINDS, 0.0))
  total = 0.0
  for loop, kind, seconds, _ in _kernels(text, peak_flops, bandwidth):
    split[loop][kind] += seconds
    total += seconds
  scale = est_seconds / total if total else 0.0
  return {
    loop: {kind: seconds * scale for kind, seconds in kinds.items()}
    for loop, kinds in sorted(split.items())
    if any(kinds.values())
  }


def top_kernels(
  text: str,
  est_seconds: float,
  peak_flops: float,
  bandwidth: float,
  loops: tuple[str, ...] = ('fwd/outer', 'bwd/outer'),
  count: int = 30,
) -> list[dict[str, Any]]:
  """The `count` costliest kernels of the given loops (`time_by_loop`'s names), with
  their estimated seconds (trip counts included, scaled as `time_by_loop`), opcode,
  result type and the JAX op that made them: what the schedule loop's transfer code
  and final read cost, kernel by kernel."""
  found, total = [], 0.0
  for loop, kind, seconds, kernel in _kernels(text, peak_flops, bandwidth):
    total += seconds
    if loop in loops:
      found.append(
        dict(
          loop=loop,
          kind=kind,
          seconds=seconds,
          opcode=kernel.opcode,
          type=kernel.type_str,
          op_name=kernel.op_name,
        )
      )
  scale = est_seconds / total if total else 0.0
  found.sort(key=lambda k: -k['seconds'])
  return [dict(k, seconds=k['seconds'] * scale) for k in found[:count]]
