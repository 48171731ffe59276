"""The analytic cost of a splash attention kernel (`kernels/splash_attention.py`) in a
compiled TPU program, which the kernel does not state: the pinned JAX's splash kernels
carry no CostEstimate, and the compiler then charges them next to nothing (measured,
v5p, B=4 T=4096 16 heads of 128, forward and backward: the whole program 0.59 ms
against 2.7 ms of the kernels' FLOPs alone at peak).

Read from the custom call: its kernel (the instruction's name: forward, dq or dkv),
q's shape [..., T, head dim] (its first floating-point operand; T padded, per device)
and the block the kernels module picks for T (`splash_attention.block_for`). Of the
n x n blocks of T x T the causal kernels visit the n (n + 1) / 2 on or below the
diagonal, each in full:

  flops            matmuls x 2 x heads x T x T x head dim x (n + 1) / (2 n), matmuls
                   per kernel `splash_attention.KERNEL_MATMULS` (forward 2, dq 3,
                   dkv 4: the backward reruns the scores in both of its kernels)
  transcendentals  one exp per visited score
  bytes            its floating-point operands read once and its outputs of q's
                   rank written once (the softmax statistics as the kernel stores
                   them, broadcast over lanes); the key and value blocks a kernel
                   reads again for each query block are not counted (a floor)
"""

from __future__ import annotations

import math
import re

from attnres_jax.compile_report import hlo_text
from attnres_jax.kernels import splash_attention

_OPERANDS = re.compile(r'operand_layout_constraints=\{(.*?)\}, \w+=')
_FLOAT_BYTES = {'bf16': 2, 'f16': 2, 'f32': 4}


def kernel_of(instruction: hlo_text.Instruction) -> str | None:
  """'fwd', 'dq' or 'dkv' for a splash kernel's custom call, else None."""
  name = instruction.name.lstrip('%')
  if not name.startswith(splash_attention.KERNEL_PREFIX):
    return None
  phase = name[len(splash_attention.KERNEL_PREFIX) :].split('_')[0]
  return phase if phase in splash_attention.KERNEL_MATMULS else None


def _float_arrays(types: str):
  return [
    (dtype, shape)
    for dtype, shape in hlo_text.arrays(types)
    if dtype in _FLOAT_BYTES and shape
  ]


def estimate(instruction: hlo_text.Instruction) -> dict[str, float] | None:
  """{'flops', 'transcendentals', 'bytes_accessed'} of a splash kernel (the module
  docstring), None for any other instruction or one whose operands do not show."""
  phase = kernel_of(instruction)
  operands = _OPERANDS.search(instruction.attrs)
  if phase is None or operands is None:
    return None
  inputs = _float_arrays(operands.group(1))
  if not inputs:
    return None
  q_shape = inputs[0][1]
  seq_len, head_dim = q_shape[-2:]
  heads = math.prod(q_shape[:-2])
  blocks = seq_len // splash_attention.block_for(seq_len)
  visited = heads * seq_len * seq_len * (blocks + 1) / (2 * blocks)
  outputs = [a for a in _float_arrays(instruction.type_str) if len(a[1]) == len(q_shape)]
  size = lambda arrays: sum(math.prod(s) * _FLOAT_BYTES[d] for d, s in arrays)
  return {
    'flops': 2.0 * splash_attention.KERNEL_MATMULS[phase] * visited * head_dim,
    'transcendentals': visited,
    'bytes_accessed': float(size(inputs) + size(outputs)),
  }
