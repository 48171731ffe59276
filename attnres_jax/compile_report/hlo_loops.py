"""How often each computation of an optimized HLO module runs: while loops by their trip
count (the compiler's `known_trip_count`, else read from the loop's condition), nested
loops multiplied, called computations as often as their caller, and each of a
conditional's N branches 1 / N times as often: the mean, exact where each branch is
taken equally often (as AttnRes's Phase 1 prefixes are over the segment scan,
`AttnResResidual.phase1_prefixes`). XLA's own cost totals count every computation
once."""

from __future__ import annotations

import collections
import re

from attnres_jax.compile_report import hlo_text

# The callee attributes of call and conditional: one of them runs once per call.
_CALLED_ONCE = (
  'to_apply',
  'branch_computations',
  'true_computation',
  'false_computation',
)


def called_once(instruction: hlo_text.Instruction) -> list[str]:
  """A call's computation, or a conditional's branches (one of which runs)."""
  return [c for key in _CALLED_ONCE for c in instruction.called(key)]


def trip_count(
  computations, while_instr: hlo_text.Instruction, caller: hlo_text.Computation
) -> int | None:
  """A while loop's trip count: the compiler's `known_trip_count`, else from a
  condition `counter < N` (or <=) with the counter's start a constant."""
  known = re.search(r'"known_trip_count":\{"n":"(\d+)"', while_instr.attrs)
  if known:
    return int(known.group(1))
  condition = hlo_text.Computation(computations[while_instr.called('condition')[0]])
  root = condition.root
  if root is None or root.opcode != 'compare':
    return None
  direction = re.search(r'direction=(\w+)', root.attrs)
  lhs, rhs = (condition.by_name.get(o) for o in root.operands)
  if lhs is None or rhs is None:
    return None
  if lhs.opcode == 'constant':
    lhs, rhs = rhs, lhs
    flipped = {'GT': 'LT', 'GE': 'LE'}.get(direction.group(1)) if direction else None
  else:
    flipped = direction.group(1) if direction else None
  if lhs.opcode != 'get-tuple-element' or rhs.opcode != 'constant':
    return None
  limit = _constant_value(rhs)
  index = int(re.search(r'index=(\d+)', lhs.attrs).group(1))
  start = _start_value(caller, while_instr.operands[0], index)
  if limit is None or start is None or flipped not in ('LT', 'LE'):
    return None
  return max(0, limit - start + (flipped == 'LE'))


def _constant_value(instruction: hlo_text.Instruction) -> int | None:
  try:
    return int(instruction.operands[0])
  except (ValueError, IndexError):
    return None


def _start_value(caller: hlo_text.Computation, tuple_name: str, index: int) -> int | None:
  """The constant a while loop's tuple element starts from (through copies)."""
  tuple_instr = caller.by_name.get(tuple_name)
  if tuple_instr is None or tuple_instr.opcode != 'tuple':
    return None
  value = caller.by_name.get(tuple_instr.operands[index])
  while value is not None and value.opcode in ('copy', 'bitcast'):
    value = caller.by_name.get(value.operands[0])
  return (
    _constant_value(value) if value is not None and value.opcode == 'constant' else None
  )


def multiplicities(computations, entry: str) -> tuple[dict[str, float], list[str]]:
  """How often each non-fused computation runs per call of the entry, and the while
  loops whose trip count could not be read (counted once)."""
  counts: dict[str, float] = collections.defaultdict(float)
  counts[entry] = 1.0
  unknown, order, seen = [], [], set()

  def visit(name):  # callers before callees
    if name in seen:
      return
    seen.add(name)
    for instruction in computations[name]:
      if instruction.opcode in ('while', 'call', 'conditional'):
        for key in ('body', 'condition', *_CALLED_ONCE):
          for callee in instruction.called(key):
            visit(callee)
    order.append(name)

  visit(entry)
  for name in reversed(order):
    computation = hlo_text.Computation(computations[name])
    for instruction in computation.instructions:
      if instruction.opcode == 'while':
        n = trip_count(computations, instruction, computation)
        if n is None:
          unknown.append(instruction.name)
          n = 1
        counts[instruction.called('body')[0]] += counts[name] * n
        counts[instruction.called('condition')[0]] += counts[name] * (n + 1)
      elif instruction.opcode in ('call', 'conditional'):
        callees = called_once(instruction)
        for callee in callees:  # a call has one; one branch of N runs
          counts[callee] += counts[name] / len(callees)
  return dict(counts), unknown
