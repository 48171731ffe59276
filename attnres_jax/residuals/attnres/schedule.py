"""The block schedule's arithmetic for AttnRes, as functions of the config: block and
segment sizes, the config's checks, and what the reads cost (FLOPs, the slots a
sublayer reads and writes, the least extra traffic; `docs/method.md`).
"""

from __future__ import annotations

import math

import jax.numpy as jnp

from attnres_jax.residuals.attnres import depth
from attnres_jax.kernels import depth_pallas_kernels
from attnres_jax.residuals import base

READ_FLOPS_PER_SOURCE_AND_CHANNEL = 7  # key RMS 2d, logit 2d, weighted sum 2d, rest ~d
# Phase 1: chosen by the platform (kernels/pallas_mesh.py), jnp, or the Pallas kernel
DEPTH_KERNELS = ('auto', 'xla', 'pallas')


def block_size_of(cfg) -> int:
  """S in sublayers: 1 for Full, the configured size for Block."""
  return 1 if cfg.residual == 'full' else cfg.block_size


def depth_state_dtype_of(cfg):
  """The dtype of the depth buffer, the partial sums and Phase 1's outputs (the
  online-softmax statistics stay float32): `depth_dtype`, else the compute dtype.
  bfloat16 outputs under bfloat16 compute train to the same loss as float32 ones
  (docs/results.md, the depth state's storage)."""
  return jnp.dtype(cfg.depth_dtype or cfg.dtype)


def depth_read_sources(cfg) -> int:
  """Sources weighed by all reads of one token (the final read included)."""
  num_sublayers, size = cfg.sublayers_per_layer * cfg.num_layers, block_size_of(cfg)
  reads = [depth.num_valid_sources(l, size) for l in range(num_sublayers)]
  reads.append(depth.num_slots(num_sublayers, size))  # the final read
  if cfg.depth_window:
    reads = [min(n, cfg.depth_window + 1) for n in reads]
  return sum(reads)


def default_segment_layers(num_layers: int, block_size: int, per_layer: int = 2) -> int:
  """Layers per schedule segment when the config leaves it to us: the shortest that
  covers whole blocks (its `per_layer` * G sublayers a multiple of block_size, so that
  every segment has the same slot layout), and 2 layers for Full AttnRes.

  Measured (`bench/memory.py`, d256 T256 B8, 16 layers, step time / standard):
  Block S=2 1.12 / 1.27 / 1.37 with G = 1 / 2 / 4, Full 1.62 / 1.57 / 1.68. Longer
  segments read the completed blocks less often but merge more local slots per
  sublayer, unroll more layers in the scan body and keep more memory.
  """
  if block_size == 1:
    return min(2 if num_layers % 2 == 0 else 1, num_layers)
  return min(whole_block_layers(block_size, per_layer), num_layers)


def whole_block_layers(block_size: int, per_layer: int = 2) -> int:
  """The fewest layers of `per_layer` sublayers that cover whole blocks of
  `block_size` sublayers."""
  return block_size // math.gcd(block_size, per_layer)


def validate(cfg) -> None:
  """Refuses a config the AttnRes residual cannot run."""
  if cfg.residual == 'block' and (not base.is_int(cfg.block_size) or cfg.block_size < 1):
    base.invalid(
      f'block_size is the number of sublayers per AttnRes block and must be an '
      f'integer >= 1, got {cfg.block_size!r} (1 = Full AttnRes; >= '
      f'{cfg.sublayers_per_layer} * num_layers = one block).'
    )
  if cfg.depth_dtype not in ('', 'bfloat16', 'float32'):
    base.invalid(
      f"depth_dtype must be '' (the compute dtype), 'bfloat16' or 'float32', got "
      f'{cfg.depth_dtype!r}.'
    )
  if cfg.depth_kernel not in DEPTH_KERNELS:
    base.invalid(
      f'depth_kernel must be one of {DEPTH_KERNELS}, got {cfg.depth_kernel!r}.'
    )
  if cfg.depth_kernel == 'pallas' and cfg.ablations:
    base.invalid(
      "depth_kernel='pallas' computes Phase 1 of the two-phase read; the ablations "
      f"{cfg.ablations} read in one shot: set depth_kernel='auto' or 'xla'."
    )
  layers, per_layer = cfg.schedule_layers, cfg.sublayers_per_layer
  if (
    cfg.residual == 'block'
    and layers
    and layers < cfg.num_layers
    and (per_layer * layers) % cfg.block_size
  ):
    base.invalid(
      f'schedule_layers={layers} layers ({per_layer * layers} sublayers) does not '
      f'cover whole blocks of block_size={cfg.block_size} sublayers; use a multiple '
      f'of {whole_block_layers(cfg.block_size, per_layer)} layers, num_layers, or 0.'
    )
  if cfg.depth_kernel == 'pallas':
    refusal = kernel_refusal(cfg)
    if refusal:
      base.invalid(
        f"depth_kernel='pallas' {refusal}: use depth_kernel='xla' or shorter schedule "
        'segments (schedule_layers).'
      )


def kernel_refusal(cfg) -> str | None:
  """Why the Phase 1 kernel cannot run `cfg` (None: it can). It holds one depth slot
  of a tile of tokens in on-chip memory at a time, with the Q outputs of its segment
  (their float32 accumulators, or their cotangents): at its narrowest tile that must
  fit, or the TPU compiler fails late. The need grows with the segment's queries and
  the width, not with the slots."""
  size = block_size_of(cfg)
  per_layer = cfg.sublayers_per_layer
  layers = cfg.schedule_layers or default_segment_layers(cfg.num_layers, size, per_layer)
  queries = per_layer * min(layers, cfg.num_layers)
  itemsize = depth_state_dtype_of(cfg).itemsize  # the slots' and the outputs'
  need = depth_pallas_kernels.least_vmem_bytes(queries, cfg.d_model, itemsize, itemsize)
  if need <= depth_pallas_kernels.VMEM_BYTES:
    return None
  return (
    f'needs {need / 2**20:.1f} MiB of on-chip memory for the {queries} queries of a '
    f'schedule segment at width {cfg.d_model} at its narrowest tile of '
    f'{depth_pallas_kernels.LANES} tokens, more than the '
    f"{depth_pallas_kernels.VMEM_BYTES // 2**20} MiB it may assume (v5p's VMEM)"
  )


def forward_flops(cfg) -> float:
  """FLOPs of all depth reads of one token, forward."""
  d, num_sublayers = cfg.d_model, cfg.sublayers_per_layer * cfg.num_layers
  total = READ_FLOPS_PER_SOURCE_AND_CHANNEL * d * depth_read_sources(cfg)
  if cfg.residual == 'block':
    total += d * num_sublayers  # the partial sums
  if cfg.depth_query_input:
    total += 2.0 * d * d * (num_sublayers + 1)
  return float(total)


def io_per_sublayer(residual) -> tuple[float, float]:
  """Phase 1, once per schedule segment, reads the completed slots and writes each
  of the segment's n G sublayers a partial output o (d wide); Phase 2 reads o and the
  segment's valid local slots and writes h; the write reads f(h) (and the partial
  sum it adds to) and writes the slot; the final read reads every slot and writes
  h. One-shot reads read every valid slot and write h."""
  num_sublayers, size, per_segment, per_layer = (
    residual.num_sublayers,
    residual.block_size,
    residual.segment_layers,
    residual.sublayers_per_layer,
  )
  read = write = 0.0
  for l in range(num_sublayers):
    layer, which = divmod(l, per_layer)
    segment, layer_in_segment = divmod(layer, per_segment)
    _, num_local_valid = residual.local_index(layer_in_segment, which)
    first = residual.first_local_slot(segment)  # the completed slots
    if residual.two_phase:
      if layer_in_segment == 0 and which == 0:  # Phase 1 of the segment
        queries = per_layer * min(per_segment, residual.cfg.num_layers - layer)
        read, write = read + first, write + queries
      read, write = read + 1 + num_local_valid, write + 1  # Phase 2
    else:
      read, write = read + first + num_local_valid, write + 1
    adds = l % size != 0  # a partial sum: the slot is read, then written
    read, write = read + 1 + adds, write + 1
  read, write = read + residual.num_slots, write + 1  # the final read
  return read / num_sublayers, write / num_sublayers


def min_extra_per_sublayer(residual) -> float:
  """Block (S >= 2, N blocks): 6 + 2N/S; Full (segments of Q sublayers over L):
  2(L/Q + Q) + 4/Q - 1 (`docs/method.md`, the derivation)."""
  num_sublayers = residual.num_sublayers
  if residual.block_size >= 2:
    return (
      6.0
      + 2.0 * depth.num_blocks(num_sublayers, residual.block_size) / residual.block_size
    )
  q = residual.sublayers_per_layer * min(residual.segment_layers, residual.cfg.num_layers)
  return 2.0 * (num_sublayers / q + q) + 4.0 / q - 1.0
