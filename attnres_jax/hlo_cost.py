"""FLOPs, bytes, time and collectives of an optimized HLO module, loops counted.

XLA's `cost_analysis()` visits every computation once, so the body of a while loop
(`lax.scan`, `fori_loop`: the scanned layers, gradient accumulation, the pipeline's
iterations, mHC's Sinkhorn) counts once whatever its trip count. `analyze` reads the
optimized HLO text instead and weighs each computation by how often it runs: the entry
once, a while body `n` times per run of the computation holding the loop (nested loops
multiply), its condition `n + 1` times, a called computation or conditional branch as
often as its caller.

Per instruction of a non-fused computation (what runs as one kernel):
  flops         dots and convolutions 2 x output elements x contracted size; other
                arithmetic 1 per output element (reductions: per input element), as
                XLA's HloCostAnalysis counts them; transcendentals apart
  bytes         operands read + result written, from HBM or on-chip memory, as XLA
                counts "bytes accessed": a fusion's operand read only through a
                dynamic-slice counts the slice; an in-place dynamic-update-slice
                counts the update, not the buffer
  cycles        the TPU compiler's own estimate of the kernel (`estimated_cycles` in its
                backend config): scaled by the program's cycles-to-seconds ratio, the
                compiler's step time with loops counted
  collectives   all-gather, reduce-scatter, all-reduce, collective-permute, all-to-all:
                count and bytes (the larger of the per-device input and output: the
                gathered result, the scattered input)
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import re
from typing import Any

_DTYPE_BYTES = {
    'pred': 1, 's4': 0.5, 'u4': 0.5, 's8': 1, 'u8': 1, 'f8e4m3fn': 1, 'f8e5m2': 1,
    'f8e4m3': 1, 'f8e4m3fnuz': 1, 'f8e5m2fnuz': 1, 's16': 2, 'u16': 2, 'f16': 2,
    'bf16': 2, 's32': 4, 'u32': 4, 'f32': 4, 's64': 8, 'u64': 8, 'f64': 8, 'c64': 8,
    'c128': 16,
}
_ARRAY = re.compile(r'\b(' + '|'.join(sorted(_DTYPE_BYTES, key=len, reverse=True))
                    + r')\[([0-9,]*)\]')
_LAID_OUT = re.compile(r'\b(' + '|'.join(sorted(_DTYPE_BYTES, key=len, reverse=True))
                       + r')\[([0-9,]*)\](?:\{([^}]*)\})?')
_HEADER = re.compile(r'^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->.*\{\s*$')
_INSTRUCTION = re.compile(r'^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$')
COLLECTIVES = ('all-gather', 'reduce-scatter', 'all-reduce', 'collective-permute',
               'all-to-all')
# No data of their own moves: structure, aliases, control.
_FREE = {'parameter', 'constant', 'get-tuple-element', 'tuple', 'bitcast', 'while',
         'call', 'conditional', 'after-all', 'partition-id', 'replica-id', 'iota',
         'opt-barrier', 'add-dependency', 'domain', 'copy-done', 'all-gather-done',
         'all-reduce-done', 'collective-permute-done', 'async-done', 'async-update',
         'send-done', 'recv-done'}
_TRANSCENDENTAL = {'exponential', 'exponential-minus-one', 'log', 'log-plus-one',
                   'rsqrt', 'sqrt', 'cbrt', 'tanh', 'logistic', 'sine', 'cosine', 'tan',
                   'power', 'atan2', 'erf'}
_ARITHMETIC = {'add', 'subtract', 'multiply', 'divide', 'maximum', 'minimum', 'negate',
               'abs', 'compare', 'select', 'and', 'or', 'xor', 'not', 'sign', 'floor',
               'ceil', 'round-nearest-afz', 'round-nearest-even', 'remainder', 'clamp',
               'shift-left', 'shift-right-logical', 'shift-right-arithmetic',
               'is-finite'}


@dataclasses.dataclass
class Instruction:
  name: str
  type_str: str
  opcode: str
  operands: list[str]
  attrs: str  # everything after the operand list
  is_root: bool = False

  def called(self, key: str) -> list[str]:
    match = re.search(key + r'=\{?([^}\s]*(?:,\s*%[\w.\-]+)*)\}?', self.attrs)
    if not match:
      return []
    return [c.strip().lstrip('%') for c in match.group(1).split(',') if c.strip()]


def _split_top(text: str) -> list[str]:
  """`text` split at the commas outside brackets."""
  parts, depth, start = [], 0, 0
  for i, ch in enumerate(text):
    if ch in '([{':
      depth += 1
    elif ch in ')]}':
      depth -= 1
    elif ch == ',' and depth == 0:
      parts.append(text[start:i])
      start = i + 1
  parts.append(text[start:])
  return [p.strip() for p in parts if p.strip()]


def _closing(text: str, start: int) -> int:
  """The index of the bracket closing the one at `start`."""
  depth = 0
  for i in range(start, len(text)):
    if text[i] in '([{':
      depth += 1
    elif text[i] in ')]}':
      depth -= 1
      if depth == 0:
        return i
  raise ValueError(f'Unbalanced HLO text: {text[:120]}')


def _parse_instruction(line: str) -> Instruction | None:
  match = _INSTRUCTION.match(line)
  if not match:
    return None
  name, rest = match.group(2), match.group(3)
  if rest.startswith('('):
    end = _closing(rest, 0)
    type_str, rest = rest[:end + 1], rest[end + 1:].lstrip()
  else:
    type_str, _, rest = rest.partition(' ')
  paren = rest.find('(')
  if paren < 0:
    return None
  opcode = rest[:paren].strip()
  end = _closing(rest, paren)
  operands = [re.findall(r'%?([\w.\-]+)$', o)[0] if re.search(r'%?[\w.\-]+$', o) else o
              for o in _split_top(rest[paren + 1:end])]
  return Instruction(name, type_str, opcode, operands, rest[end + 1:],
                     is_root=bool(match.group(1)))


def parse_module(hlo_text: str) -> tuple[dict[str, list[Instruction]], str]:
  """The computations of an HLO module's text (name -> instructions) and the entry."""
  computations, entry, current = {}, None, None
  for line in hlo_text.splitlines():
    header = _HEADER.match(line)
    if header and current is None:
      current = header.group(2)
      computations[current] = []
      if header.group(1):
        entry = current
    elif current is not None and line.strip() == '}':
      current = None
    elif current is not None:
      instruction = _parse_instruction(line)
      if instruction is not None:
        computations[current].append(instruction)
  if entry is None:
    raise ValueError('No ENTRY computation in the HLO text.')
  return computations, entry


def arrays(type_str: str) -> list[tuple[str, tuple[int, ...]]]:
  """The (dtype, dims) of every array in a (tuple) type."""
  return [(d, tuple(int(x) for x in dims.split(',') if x))
          for d, dims in _ARRAY.findall(type_str)]


def type_bytes(type_str: str) -> float:
  """Bytes of a (tuple) type as laid out in memory: each array's dimensions padded to
  its layout's tile (`{1,0:T(8,128)}`: the two minor dimensions to 8 x 128), as the
  TPU stores it (and as XLA's cost analysis counts it)."""
  total = 0.0
  for match in _LAID_OUT.finditer(type_str):
    dtype, dims, layout = match.group(1), match.group(2), match.group(3) or ''
    shape = [int(x) for x in dims.split(',') if x]
    minor_to_major, _, rest = layout.partition(':')
    tile = re.match(r'T\(([0-9,]+)\)', rest)
    if tile and shape:
      order = [int(x) for x in minor_to_major.split(',') if x] or list(
          reversed(range(len(shape))))
      physical = [shape[d] for d in reversed(order)]  # major to minor
      sizes = [int(t) for t in tile.group(1).split(',')]
      for k, t in enumerate(reversed(sizes)):
        if k < len(physical):
          physical[-1 - k] = -(-physical[-1 - k] // t) * t
      shape = physical
    total += _DTYPE_BYTES[dtype] * math.prod(shape)
  return total


def _elements(type_str: str) -> int:
  return sum(math.prod(s) for _, s in arrays(type_str))


class _Computation:
  """Instructions by name, for operand look-ups."""

  def __init__(self, instructions: list[Instruction]):
    self.instructions = instructions
    self.by_name = {i.name: i for i in instructions}
    self.root = next((i for i in instructions if i.is_root), None)

  def type_of(self, name: str) -> str:
    instruction = self.by_name.get(name)
    return instruction.type_str if instruction else ''


def trip_count(computations, while_instr: Instruction, caller: _Computation) -> int | None:
  """A while loop's trip count: the compiler's `known_trip_count`, else from a
  condition `counter < N` (or <=) with the counter's start a constant."""
  known = re.search(r'"known_trip_count":\{"n":"(\d+)"', while_instr.attrs)
  if known:
    return int(known.group(1))
  condition = _Computation(computations[while_instr.called('condition')[0]])
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


def _constant_value(instruction: Instruction) -> int | None:
  try:
    return int(instruction.operands[0])
  except (ValueError, IndexError):
    return None


def _start_value(caller: _Computation, tuple_name: str, index: int) -> int | None:
  """The constant a while loop's tuple element starts from (through copies)."""
  tuple_instr = caller.by_name.get(tuple_name)
  if tuple_instr is None or tuple_instr.opcode != 'tuple':
    return None
  value = caller.by_name.get(tuple_instr.operands[index])
  while value is not None and value.opcode in ('copy', 'bitcast'):
    value = caller.by_name.get(value.operands[0])
  return _constant_value(value) if value is not None and value.opcode == 'constant' else None


def _fusion_operand_bytes(fused: _Computation, operand_index: int, full: float,
                          computations=None) -> float:
  """Bytes a fusion reads of its operand: the slices if it only feeds (dynamic)
  slices (or is the buffer of an in-place dynamic-update-slice), through bitcasts and
  nested fusions; else all of it."""
  parameter = next((i for i in fused.instructions if i.opcode == 'parameter'
                    and i.operands == [str(operand_index)]), None)
  if parameter is None:
    return full
  return min(full, _value_read_bytes(fused, parameter.name, full, computations))


def _value_read_bytes(computation: _Computation, name: str, full: float,
                      computations) -> float:
  total = 0.0
  for user in computation.instructions:
    if name not in user.operands:
      continue
    if user.opcode in ('dynamic-slice', 'slice') and user.operands[0] == name:
      total += type_bytes(user.type_str)
    elif user.opcode == 'dynamic-update-slice' and user.operands[0] == name:
      continue
    elif user.opcode == 'bitcast':
      total += _value_read_bytes(computation, user.name, full, computations)
    elif user.opcode == 'fusion' and computations is not None:
      nested = _Computation(computations[user.called('calls')[0]])
      for k, operand in enumerate(user.operands):
        if operand == name:
          total += _fusion_operand_bytes(nested, k, full, computations)
    else:
      return full
  return total


def _fusion_output_bytes(fused: _Computation) -> float:
  """Bytes a fusion writes: each output (a multi-output fusion's tuple elements),
  or only the update of an in-place dynamic-update-slice (through bitcasts)."""
  if fused.root is None:
    return 0.0
  outputs = ([fused.by_name.get(o) for o in fused.root.operands]
             if fused.root.opcode == 'tuple' else [fused.root])
  total = 0.0
  for output in outputs:
    if output is None:
      continue
    value = output
    while value is not None and value.opcode == 'bitcast':
      value = fused.by_name.get(value.operands[0])
    if value is not None and value.opcode == 'dynamic-update-slice':
      total += type_bytes(fused.type_of(value.operands[1]))
    else:
      total += type_bytes(output.type_str)
  return total


def _dot_flops(instruction: Instruction, computation: _Computation) -> float:
  out = _elements(instruction.type_str)
  if instruction.opcode == 'dot':
    lhs = arrays(computation.type_of(instruction.operands[0]))
    dims = re.search(r'lhs_contracting_dims=\{([0-9,]*)\}', instruction.attrs)
    if not lhs or not dims:
      return 2.0 * out
    shape = lhs[0][1]
    return 2.0 * out * math.prod(shape[int(d)] for d in dims.group(1).split(',') if d)
  lhs = arrays(computation.type_of(instruction.operands[0]))
  kernel = arrays(computation.type_of(instruction.operands[1]))
  labels = re.search(r'dim_labels=(\w+)_(\w+)->(\w+)', instruction.attrs)
  out_shape = arrays(instruction.type_str)
  if not lhs or not kernel or not labels or not out_shape:
    return 2.0 * out
  lhs_labels, kernel_labels, out_labels = labels.groups()
  lhs, kernel, out_shape = lhs[0][1], kernel[0][1], out_shape[0][1]
  window = _window(instruction.attrs)
  macs = float(out) * kernel[kernel_labels.index('i')]
  for d in sorted(c for c in out_labels if c.isdigit()):
    spatial = int(d)
    get = lambda key, default: (window.get(key, [default] * (spatial + 1))[spatial])
    o_size = out_shape[out_labels.index(d)]
    macs *= _window_pairs(lhs[lhs_labels.index(d)], kernel[kernel_labels.index(d)],
                          o_size, get('pad', (0, 0))[0], get('stride', 1),
                          get('lhs_dilate', 1), get('rhs_dilate', 1)) / o_size
  return 2.0 * macs


def _window(attrs: str) -> dict[str, list]:
  """A convolution's window attributes: size, pad (lo, hi), stride, dilations."""
  match = re.search(r'window=\{([^}]*)\}', attrs)
  window = {}
  for item in (match.group(1).split() if match else []):
    key, _, value = item.partition('=')
    if key == 'pad':
      window[key] = [tuple(int(v) for v in p.split('_')) for p in value.split('x')]
    elif key in ('size', 'stride', 'lhs_dilate', 'rhs_dilate'):
      window[key] = [int(v) for v in value.split('x')]
  return window


def _window_pairs(size: int, kernel: int, out: int, pad_lo: int, stride: int,
                  lhs_dilate: int, rhs_dilate: int) -> int:
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
      pairs += sum(1 for o in range(out) if 0 <= o * stride + offset <= last
                   and (o * stride + offset) % lhs_dilate == 0)
  return pairs


def _arithmetic(instruction: Instruction, computation: _Computation,
                computations) -> tuple[float, float]:
  """(flops, transcendentals) of one instruction, inside fusions too."""
  op = instruction.opcode
  if op in ('dot', 'convolution'):
    return _dot_flops(instruction, computation), 0.0
  if op == 'fusion':
    fused = _Computation(computations[instruction.called('calls')[0]])
    totals = [_arithmetic(i, fused, computations) for i in fused.instructions]
    return sum(t[0] for t in totals), sum(t[1] for t in totals)
  if op in _TRANSCENDENTAL:
    return 0.0, float(_elements(instruction.type_str))
  if op in _ARITHMETIC:
    return float(_elements(instruction.type_str)), 0.0
  if op in ('reduce', 'reduce-window'):
    return float(sum(_elements(computation.type_of(o))
                     for o in instruction.operands[:len(instruction.operands) // 2])), 0.0
  return 0.0, 0.0


def _bytes(instruction: Instruction, computation: _Computation, computations) -> float:
  op = instruction.opcode
  if op in _FREE:
    return 0.0
  operand_bytes = [type_bytes(computation.type_of(o)) for o in instruction.operands]
  out = type_bytes(instruction.type_str)
  if op == 'fusion':
    fused = _Computation(computations[instruction.called('calls')[0]])
    operand_bytes = [_fusion_operand_bytes(fused, k, b, computations)
                     for k, b in enumerate(operand_bytes)]
    out = _fusion_output_bytes(fused)
  elif op in ('dynamic-slice', 'slice'):
    operand_bytes[0] = out
  elif op == 'dynamic-update-slice':
    operand_bytes[0], out = 0.0, operand_bytes[1]
  elif op.endswith('-start') and instruction.type_str.startswith('('):
    out = _start_output_bytes(instruction, operand_bytes)
  return sum(operand_bytes) + out


def _start_output_bytes(instruction: Instruction, operand_bytes: list[float]) -> float:
  """An async start's result is (operands, results, context): the results alone."""
  parts = _split_top(instruction.type_str[1:-1])
  rest = parts[len(operand_bytes):] if len(parts) > len(operand_bytes) else parts
  return sum(type_bytes(p) for p in rest if arrays(p) and any(s for _, s in arrays(p)))


def _collective(instruction: Instruction, computations) -> str | None:
  op = instruction.opcode
  if op == 'async-start':
    called = computations.get((instruction.called('calls') or [''])[0], [])
    op = called[-1].opcode if called else ''
  base = op[:-len('-start')] if op.endswith('-start') else op
  return base if base in COLLECTIVES else None


def _collective_bytes(instruction: Instruction, computation: _Computation) -> float:
  operands = sum(type_bytes(computation.type_of(o)) for o in instruction.operands)
  out = type_bytes(instruction.type_str)
  if instruction.opcode.endswith('-start') and instruction.type_str.startswith('('):
    out = _start_output_bytes(instruction, [type_bytes(computation.type_of(o))
                                            for o in instruction.operands])
  return max(operands, out)


def _contains_dot(instruction: Instruction, computations) -> bool:
  if instruction.opcode in ('dot', 'convolution'):
    return True
  if instruction.opcode != 'fusion':
    return False
  return any(_contains_dot(i, computations)
             for i in computations[instruction.called('calls')[0]])


def _kind(instruction: Instruction, computations) -> str:
  """What a kernel's roofline time goes to: matmul (a dot or convolution in it),
  copies (copies and transposes: relayouts and moves between memories), collectives,
  or other (elementwise, reductions, slices)."""
  if _collective(instruction, computations) is not None:
    return 'collectives'
  if instruction.opcode in ('copy', 'copy-start', 'transpose'):
    return 'copies'
  return 'matmul' if _contains_dot(instruction, computations) else 'other'


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
      for key in ('body', 'condition', 'to_apply', 'branch_computations',
                  'true_computation', 'false_computation'):
        if instruction.opcode in ('while', 'call', 'conditional'):
          for callee in instruction.called(key):
            visit(callee)
    order.append(name)

  visit(entry)
  for name in reversed(order):
    computation = _Computation(computations[name])
    for instruction in computation.instructions:
      if instruction.opcode == 'while':
        n = trip_count(computations, instruction, computation)
        if n is None:
          unknown.append(instruction.name)
          n = 1
        counts[instruction.called('body')[0]] += counts[name] * n
        counts[instruction.called('condition')[0]] += counts[name] * (n + 1)
      elif instruction.opcode in ('call', 'conditional'):
        for key in ('to_apply', 'branch_computations', 'true_computation',
                    'false_computation'):
          for callee in instruction.called(key):
            counts[callee] += counts[name]
  return dict(counts), unknown


def analyze(hlo_text: str, peak_flops: float = 1.0,
            hbm_bandwidth: float = 1.0) -> dict[str, Any]:
  """Costs of one device's optimized HLO, loops counted (see the module docstring):
  flops, transcendentals, bytes (`bytes_async_copies`: the share of copy-start, async
  moves between memories), cycles, roofline seconds (per kernel the larger of flops /
  `peak_flops` and bytes / `hbm_bandwidth`; `roofline_<kind>` by `_kind`, and
  `roofline_matmul_bytes_bound` of matmul kernels limited by bytes), each also
  `<name>_once` (every
  computation once, as XLA's totals count), collectives by kind, and the trip counts
  found."""
  computations, entry = parse_module(hlo_text)
  counts, unknown = multiplicities(computations, entry)
  totals = collections.defaultdict(float)
  collectives = {kind: {'count': 0.0, 'bytes': 0.0} for kind in COLLECTIVES}
  trips = []
  for name, times in counts.items():
    computation = _Computation(computations[name])
    for instruction in computation.instructions:
      flops, transcendentals = _arithmetic(instruction, computation, computations)
      moved = _bytes(instruction, computation, computations)
      cycles = re.search(r'"estimated_cycles":"(\d+)"', instruction.attrs)
      cycles = float(cycles.group(1)) if cycles else 0.0
      roofline = max(flops / peak_flops, moved / hbm_bandwidth)
      kind = _kind(instruction, computations)
      totals['roofline_' + kind] += times * roofline
      if kind == 'matmul' and moved / hbm_bandwidth > flops / peak_flops:
        totals['roofline_matmul_bytes_bound'] += times * roofline
      for key, once in (('flops', flops), ('transcendentals', transcendentals),
                        ('bytes', moved), ('cycles', cycles), ('roofline', roofline)):
        totals[key] += times * once
        totals[key + '_once'] += once
      if instruction.opcode == 'copy-start':
        totals['bytes_async_copies'] += times * moved
      kind = _collective(instruction, computations)
      if kind is not None:
        collectives[kind]['count'] += times
        collectives[kind]['bytes'] += times * _collective_bytes(instruction, computation)
      if instruction.opcode == 'while':
        trips.append(trip_count(computations, instruction, computation))
  return dict(totals, collectives=collectives, while_trip_counts=trips,
              unknown_trip_counts=unknown)


def estimated_seconds(costs: dict[str, Any], compiler_seconds: float) -> float:
  """The compiler's step time with loops counted: its own estimate (`optimal_seconds`,
  a roofline with loop bodies once) scaled by our roofline with loops counted / once."""
  if not costs.get('roofline_once'):
    return compiler_seconds
  return compiler_seconds * costs['roofline'] / costs['roofline_once']


def to_json(costs: dict[str, Any]) -> str:
  return json.dumps(costs, indent=2, sort_keys=True)
