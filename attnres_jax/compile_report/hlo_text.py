"""Reading optimized HLO text: computations, instructions, shapes and their bytes.

Enough of the HLO text grammar for the cost readers (`compile_report/hlo_cost.py`,
`hlo_kernel_cost.py`, `hlo_hbm.py`, `hlo_diff.py`): each computation's instructions
with their result type, opcode, operand names and attributes, and array sizes as the
TPU lays them out (dimensions padded to the layout's tile).
"""

from __future__ import annotations

import dataclasses
import math
import re

_DTYPE_BYTES = {
  'pred': 1,
  's4': 0.5,
  'u4': 0.5,
  's8': 1,
  'u8': 1,
  'f8e4m3fn': 1,
  'f8e5m2': 1,
  'f8e4m3': 1,
  'f8e4m3fnuz': 1,
  'f8e5m2fnuz': 1,
  's16': 2,
  'u16': 2,
  'f16': 2,
  'bf16': 2,
  's32': 4,
  'u32': 4,
  'f32': 4,
  's64': 8,
  'u64': 8,
  'f64': 8,
  'c64': 8,
  'c128': 16,
}
_ARRAY = re.compile(
  r'\b(' + '|'.join(sorted(_DTYPE_BYTES, key=len, reverse=True)) + r')\[([0-9,]*)\]'
)
_LAID_OUT = re.compile(
  r'\b('
  + '|'.join(sorted(_DTYPE_BYTES, key=len, reverse=True))
  + r')\[([0-9,]*)\](?:\{([^}]*)\})?'
)
_HEADER = re.compile(r'^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->.*\{\s*$')
_INSTRUCTION = re.compile(r'^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$')


@dataclasses.dataclass
class Instruction:
  name: str
  type_str: str
  opcode: str
  operands: list[str]
  attrs: str  # everything after the operand list
  is_root: bool = False

  def called(self, key: str) -> list[str]:
    match = re.search(key + r'=\{?([^},\s]*(?:,\s*%[\w.\-]+)*)\}?', self.attrs)
    if not match:
      return []
    return [c.strip().lstrip('%') for c in match.group(1).split(',') if c.strip()]


def split_top(text: str) -> list[str]:
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


def parse_instruction(line: str) -> Instruction | None:
  match = _INSTRUCTION.match(line)
  if not match:
    return None
  name, rest = match.group(2), match.group(3)
  if rest.startswith('('):
    end = _closing(rest, 0)
    type_str, rest = rest[: end + 1], rest[end + 1 :].lstrip()
  else:
    type_str, _, rest = rest.partition(' ')
  paren = rest.find('(')
  if paren < 0:
    return None
  opcode = rest[:paren].strip()
  end = _closing(rest, paren)
  operands = [
    re.findall(r'%?([\w.\-]+)$', o)[0] if re.search(r'%?[\w.\-]+$', o) else o
    for o in split_top(rest[paren + 1 : end])
  ]
  return Instruction(
    name, type_str, opcode, operands, rest[end + 1 :], is_root=bool(match.group(1))
  )


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
      instruction = parse_instruction(line)
      if instruction is not None:
        computations[current].append(instruction)
  if entry is None:
    raise ValueError('No ENTRY computation in the HLO text.')
  return computations, entry


def arrays(type_str: str) -> list[tuple[str, tuple[int, ...]]]:
  """The (dtype, dims) of every array in a (tuple) type."""
  return [
    (d, tuple(int(x) for x in dims.split(',') if x))
    for d, dims in _ARRAY.findall(type_str)
  ]


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
        reversed(range(len(shape)))
      )
      physical = [shape[d] for d in reversed(order)]  # major to minor
      sizes = [int(t) for t in tile.group(1).split(',')]
      for k, t in enumerate(reversed(sizes)):
        if k < len(physical):
          physical[-1 - k] = -(-physical[-1 - k] // t) * t
      shape = physical
    total += _DTYPE_BYTES[dtype] * math.prod(shape)
  return total


def elements(type_str: str) -> int:
  return sum(math.prod(s) for _, s in arrays(type_str))


class Computation:
  """A computation's instructions, by name for operand look-ups, and its root."""

  def __init__(self, instructions: list[Instruction]):
    self.instructions = instructions
    self.by_name = {i.name: i for i in instructions}
    self.root = next((i for i in instructions if i.is_root), None)

  def type_of(self, name: str) -> str:
    instruction = self.by_name.get(name)
    return instruction.type_str if instruction else ''
