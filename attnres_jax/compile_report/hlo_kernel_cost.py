"""What one kernel of an optimized HLO module costs, as XLA's HloCostAnalysis counts it.

Per instruction of a non-fused computation (what runs as one kernel; `hlo_cost` weighs
each by how often it runs):
  flops         dots and convolutions 2 x output elements x contracted size; other
                arithmetic 1 per output element (reductions: per input element), as
                XLA's HloCostAnalysis counts them; transcendentals apart
  bytes         operands read + result written, from HBM or on-chip memory, as XLA
                counts "bytes accessed": a fusion's operand read only through a
                dynamic-slice counts the slice; an in-place dynamic-update-slice
                counts the update, not the buffer; a custom call that only
                reserves a buffer (AllocateBuffer) counts none; a Pallas TPU kernel
                (`tpu_custom_call`) counts what its CostEstimate states, as the
                compiler's own cost model does (its FLOPs too): its operands'
                sizes would charge, e.g., all K slots of the depth buffer to a
                Phase 1 kernel whose BlockSpecs load only the valid ones; a splash
                attention kernel, which states none, its analytic cost
                (`splash_cost`, marked 'analytic': the compiler's own estimate
                leaves it out)
"""

from __future__ import annotations

import json
import math
import re

from attnres_jax.compile_report import hlo_text
from attnres_jax.compile_report import splash_cost

# No data of their own moves: structure, aliases, control.
_FREE = frozenset(
  'parameter constant get-tuple-element tuple bitcast while call conditional after-all '
  'partition-id replica-id iota opt-barrier add-dependency domain copy-done '
  'all-gather-done all-reduce-done collective-permute-done async-done async-update '
  'send-done recv-done'.split()
)
# Custom calls that move no data: AllocateBuffer reserves the buffer that in-place
# updates (a scan's stacked outputs) then write; its result is never read as a copy.
_FREE_CUSTOM_CALLS = frozenset({'AllocateBuffer'})
# A Pallas kernel's CostEstimate in its backend config (integers written as strings).
_COST_ESTIMATE = re.compile(r'"cost_estimate":(\{[^{}]*\})')
ESTIMATE_KEYS = ('flops', 'transcendentals', 'bytes_accessed')
_TRANSCENDENTAL = frozenset(
  'exponential exponential-minus-one log log-plus-one rsqrt sqrt cbrt tanh logistic '
  'sine cosine tan power atan2 erf'.split()
)
_ARITHMETIC = frozenset(
  'add subtract multiply divide maximum minimum negate abs compare select and or '
  'xor not sign floor ceil round-nearest-afz round-nearest-even remainder clamp '
  'shift-left shift-right-logical shift-right-arithmetic is-finite'.split()
)


def _fusion_operand_bytes(
  fused: hlo_text.Computation, operand_index: int, full: float, computations=None
) -> float:
  """Bytes a fusion reads of its operand: the slices if it only feeds (dynamic)
  slices (or is the buffer of an in-place dynamic-update-slice), through bitcasts and
  nested fusions; else all of it."""
  parameter = next(
    (
      i
      for i in fused.instructions
      if i.opcode == 'parameter' and i.operands == [str(operand_index)]
    ),
    None,
  )
  if parameter is None:
    return full
  return min(full, _value_read_bytes(fused, parameter.name, full, computations))


def _value_read_bytes(
  computation: hlo_text.Computation, name: str, full: float, computations
) -> float:
  if computation.root is not None and computation.root.name == name:
    # The value leaves the computation (a nested fusion that only bitcasts an operand
    # hands it to its caller, e.g. a bf16 weight on its way to a dot): read whole.
    return full
  total = 0.0
  for user in computation.instructions:
    if name not in user.operands:
      continue
    if user.opcode in ('dynamic-slice', 'slice') and user.operands[0] == name:
      total += hlo_text.type_bytes(user.type_str)
    elif user.opcode == 'dynamic-update-slice' and user.operands[0] == name:
      continue
    elif user.opcode == 'bitcast':
      total += _value_read_bytes(computation, user.name, full, computations)
    elif user.opcode == 'fusion' and computations is not None:
      nested = hlo_text.Computation(computations[user.called('calls')[0]])
      for k, operand in enumerate(user.operands):
        if operand == name:
          total += _fusion_operand_bytes(nested, k, full, computations)
    else:
      return full
  return total


def _fusion_output_bytes(fused: hlo_text.Computation) -> float:
  """Bytes a fusion writes: each output (a multi-output fusion's tuple elements),
  or only the update of an in-place dynamic-update-slice (through bitcasts)."""
  if fused.root is None:
    return 0.0
  outputs = (
    [fused.by_name.get(o) for o in fused.root.operands]
    if fused.root.opcode == 'tuple'
    else [fused.root]
  )
  total = 0.0
  for output in outputs:
    if output is None:
      continue
    value = output
    while value is not None and value.opcode == 'bitcast':
      value = fused.by_name.get(value.operands[0])
    if value is not None and value.opcode == 'dynamic-update-slice':
      total += hlo_text.type_bytes(fused.type_of(value.operands[1]))
    else:
      total += hlo_text.type_bytes(output.type_str)
  return total


def _dot_flops(
  instruction: hlo_text.Instruction, computation: hlo_text.Computation
) -> float:
  out = hlo_text.elements(instruction.type_str)
  if instruction.opcode == 'dot':
    lhs = hlo_text.arrays(computation.type_of(instruction.operands[0]))
    dims = re.search(r'lhs_contracting_dims=\{([0-9,]*)\}', instruction.attrs)
    if not lhs or not dims:
      return 2.0 * out
    shape = lhs[0][1]
    return 2.0 * out * math.prod(shape[int(d)] for d in dims.group(1).split(',') if d)
  lhs = hlo_text.arrays(computation.type_of(instruction.operands[0]))
  kernel = hlo_text.arrays(computation.type_of(instruction.operands[1]))
  labels = re.search(r'dim_labels=(\w+)_(\w+)->(\w+)', instruction.attrs)
  out_shape = hlo_text.arrays(instruction.type_str)
  if not lhs or not kernel or not labels or not out_shape:
    return 2.0 * out
  lhs_labels, kernel_labels, out_labels = labels.groups()
  lhs, kernel, out_shape = lhs[0][1], kernel[0][1], out_shape[0][1]
  window = _window(instruction.attrs)
  macs = float(out) * kernel[kernel_labels.index('i')]
  for d in sorted(c for c in out_labels if c.isdigit()):
    spatial = int(d)
    get = lambda key, default: window.get(key, [default] * (spatial + 1))[spatial]
    o_size = out_shape[out_labels.index(d)]
    macs *= (
      _window_pairs(
        lhs[lhs_labels.index(d)],
        kernel[kernel_labels.index(d)],
        o_size,
        get('pad', (0, 0))[0],
        get('stride', 1),
        get('lhs_dilate', 1),
        get('rhs_dilate', 1),
      )
      / o_size
    )
  return 2.0 * macs


def _window(attrs: str) -> dict[str, list]:
  """A convolution's window attributes: size, pad (lo, hi), stride, dilations."""
  match = re.search(r'window=\{([^}]*)\}', attrs)
  window = {}
  for item in match.group(1).split() if match else []:
    key, _, value = item.partition('=')
    if key == 'pad':
      window[key] = [tuple(int(v) for v in p.split('_')) for p in value.split('x')]
    elif key in ('size', 'stride', 'lhs_dilate', 'rhs_dilate'):
      window[key] = [int(v) for v in value.split('x')]
  return window


def _window_pairs(
  size: int,
  kernel: int,
  out: int,
  pad_lo: int,
  stride: int,
  lhs_dilate: int,
  rhs_dilate: int,
) -> int:
  """(output, kernel) position pairs of one spatial dimension that meet a real input
  element (not padding, not a hole of the input dilation): the MACs per output
  feature along it, as XLA counts a convolution."""
  last = (size - 1) * lhs_dilate
  pairs = 0
  for k in range(kernel):
    offset = k * rhs_dilate - pad_lo  # input coordinate o * stride + offset
    if lhs_dilate == 1:
      low = max(0, math.ceil(-offset / stride))
      high = min(out - 1, (last - offset) // stride)
      pairs += max(0, high - low + 1)
    else:
      pairs += sum(
        1
        for o in range(out)
        if 0 <= o * stride + offset <= last and (o * stride + offset) % lhs_dilate == 0
      )
  return pairs


def arithmetic(
  instruction: hlo_text.Instruction, computation: hlo_text.Computation, computations
) -> tuple[float, float]:
  """(flops, transcendentals) of one instruction, inside fusions too; a Pallas
  kernel's from its CostEstimate."""
  op = instruction.opcode
  estimate = kernel_estimate(instruction)
  if estimate is not None:
    return estimate['flops'], estimate['transcendentals']
  if op in ('dot', 'convolution'):
    return _dot_flops(instruction, computation), 0.0
  if op == 'fusion':
    fused = hlo_text.Computation(computations[instruction.called('calls')[0]])
    totals = [arithmetic(i, fused, computations) for i in fused.instructions]
    return sum(t[0] for t in totals), sum(t[1] for t in totals)
  if op in _TRANSCENDENTAL:
    return 0.0, float(hlo_text.elements(instruction.type_str))
  if op in _ARITHMETIC:
    return float(hlo_text.elements(instruction.type_str)), 0.0
  if op in ('reduce', 'reduce-window'):
    return float(
      sum(
        hlo_text.elements(computation.type_of(o))
        for o in instruction.operands[: len(instruction.operands) // 2]
      )
    ), 0.0
  return 0.0, 0.0


def kernel_estimate(instruction: hlo_text.Instruction) -> dict[str, float] | None:
  """The CostEstimate ({'flops', 'transcendentals', 'bytes_accessed'}) a Pallas TPU
  kernel carries in its backend config, or a splash kernel's analytic one (with
  'analytic': 1.0), or None (any other instruction)."""
  if _custom_call_target(instruction) != 'tpu_custom_call':
    return None
  found = _COST_ESTIMATE.search(instruction.attrs)
  if found is None:
    analytic = splash_cost.estimate(instruction)
    return None if analytic is None else {**analytic, 'analytic': 1.0}
  estimate = json.loads(found.group(1))
  return {k: float(estimate.get(k, 0)) for k in ESTIMATE_KEYS}


def kernel_bytes(
  instruction: hlo_text.Instruction, computation: hlo_text.Computation, computations
) -> tuple[list[float], float]:
  """(bytes read of each operand, bytes written) of one kernel, by the rules in the
  module docstring; nothing for an instruction that moves no data. A Pallas kernel's
  CostEstimate states its bytes in all, not per operand: all of them come as one
  read."""
  op = instruction.opcode
  if op in _FREE or _free_custom_call(instruction):
    return [], 0.0
  estimate = kernel_estimate(instruction)
  if estimate is not None:
    return [estimate['bytes_accessed']], 0.0
  operand_bytes = [
    hlo_text.type_bytes(computation.type_of(o)) for o in instruction.operands
  ]
  out = hlo_text.type_bytes(instruction.type_str)
  if op == 'fusion':
    fused = hlo_text.Computation(computations[instruction.called('calls')[0]])
    operand_bytes = [
      _fusion_operand_bytes(fused, k, b, computations)
      for k, b in enumerate(operand_bytes)
    ]
    out = _fusion_output_bytes(fused)
  elif op in ('dynamic-slice', 'slice'):
    operand_bytes[0] = out
  elif op == 'dynamic-update-slice':
    operand_bytes[0], out = 0.0, operand_bytes[1]
  elif op.endswith('-start') and instruction.type_str.startswith('('):
    out = start_output_bytes(instruction, operand_bytes)
  return operand_bytes, out


def _custom_call_target(instruction: hlo_text.Instruction) -> str | None:
  """What a custom call calls (its `custom_call_target`); None for other ops."""
  if instruction.opcode != 'custom-call':
    return None
  target = re.search(r'custom_call_target="([^"]*)"', instruction.attrs)
  return target and target.group(1)


def _free_custom_call(instruction: hlo_text.Instruction) -> bool:
  return _custom_call_target(instruction) in _FREE_CUSTOM_CALLS


def start_output_bytes(
  instruction: hlo_text.Instruction, operand_bytes: list[float]
) -> float:
  """An async start's result is (operands, results, context): the results alone."""
  parts = hlo_text.split_top(instruction.type_str[1:-1])
  rest = parts[len(operand_bytes) :] if len(parts) > len(operand_bytes) else parts
  return sum(
    hlo_text.type_bytes(p)
    for p in rest
    if hlo_text.arrays(p) and any(s for _, s in hlo_text.arrays(p))
  )
