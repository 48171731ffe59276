"""What the HC/mHC Pallas kernels (`hyper_pallas.py`) share: the tiling of the
streams into programs, the on-chip memory a tile takes, the per-token weights' turn
between tokens-minor and tokens-major inside a program, the `pallas_call` over
(batch row, tile of T) and the split of a launch over the model's mesh.

The kernels see the streams d-minor, as the TPU compiler lays them out for the XLA
version ([m, B, T, D]{3,2,1,0}): a program's block is a tile of tokens of every
stream, [m, t, D], the width on the lanes, so no relayout at the kernel's boundary.
The per-token weights travel tokens-minor, as the model computes them ([B, K, T]
float32); inside, a product with the identity on the (otherwise idle) MXU turns a
block to tokens-major so that each weight is a [t, 1] column that broadcasts over the
lanes (and the weights' cotangents back).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import PartitionSpec as P

from attnres_jax.kernels import pallas_mesh

F32 = jnp.float32
_SQ = pl.squeezed
# What one program's blocks (double buffered) and float32 temporaries may take, and
# the headroom asked of Mosaic above that estimate (v5p has 64 MiB a core).
TILE_VMEM_BYTES = 32 * 2**20
HEADROOM_VMEM_BYTES = 16 * 2**20
VMEM_BYTES = 64 * 2**20
LANES = 128  # tokens per tile step: the per-token weights hold the tokens on lanes

TN = (((0,), (0,)), ((), ()))  # a^T . b
NT = (((1,), (1,)), ((), ()))  # a . b^T
_HIGHEST = jax.lax.Precision.HIGHEST


# -- inside a program ------------------------------------------------------------------


def column(coef_tK, k):
  """Per-token weight k as a [t, 1] column (broadcasts over the lanes)."""
  return coef_tK[:, k : k + 1]


def _eye(n):
  rows = jax.lax.broadcasted_iota(jnp.int32, (n, n), 0)
  return (rows == jax.lax.broadcasted_iota(jnp.int32, (n, n), 1)).astype(F32)


def tokens_major(coef_Kt):
  """[K, t] (tokens on the lanes, as stored) -> [t, K]: a product with the identity
  on the MXU (exact at HIGHEST precision: each float32 value enters as bfloat16
  parts that sum back to it), where a vector transpose of a [K, t] block whose K is
  no multiple of 128 would need relayouts."""
  return jax.lax.dot_general(
    coef_Kt, _eye(coef_Kt.shape[0]), TN, precision=_HIGHEST, preferred_element_type=F32
  )


def tokens_minor(coef_tK):
  """[t, K] -> [K, t], the same way."""
  return jax.lax.dot_general(
    _eye(coef_tK.shape[1]), coef_tK, NT, precision=_HIGHEST, preferred_element_type=F32
  )


# -- the tiling ------------------------------------------------------------------------


def vmem_bytes(tile, m, dim, itemsize, footprint=None):
  """On-chip memory of a kernel at `tile` tokens. `footprint`: (its stream-sized
  [t, D] blocks in and out, the float32 [t, D] values it works on); by default the
  write's backward, the larger write kernel: 3m + 2 blocks (streams, f(h), the
  cotangents in; the streams' and f(h)'s cotangents out) and 2m + 2 values. Blocks
  are double buffered, plus the weights and their cotangents, counted as [t, K]
  padded to 128 lanes, as they are inside."""
  num_blocks, num_values = footprint or (3 * m + 2, 2 * m + 2)
  blocks = num_blocks * tile * dim * itemsize + 2 * tile * 128 * 4
  return 2 * blocks + num_values * tile * dim * 4


def choose_tile(length, m, dim, itemsize, footprint=None):
  """Tokens per program: the largest multiple of 128 dividing `length` whose kernels
  fit TILE_VMEM_BYTES (at least 128), or all of T when no multiple of 128 divides it."""
  fits = [
    t
    for t in range(LANES, length + 1, LANES)
    if length % t == 0 and vmem_bytes(t, m, dim, itemsize, footprint) <= TILE_VMEM_BYTES
  ]
  if fits:
    return max(fits)
  return LANES if length % LANES == 0 else length


# -- the launches ----------------------------------------------------------------------


def _block_spec(kind, shape, tile, m, dim):
  """The BlockSpec of one operand or result of `kind` (`launch`) at `tile` tokens."""
  if kind == 'coef':
    return pl.BlockSpec((_SQ, shape[1], tile), lambda b, t: (b, 0, t))
  if kind == 'streams':
    return pl.BlockSpec((m, _SQ, tile, dim), lambda b, t: (0, b, t, 0))
  if kind == 'one':
    return pl.BlockSpec((_SQ, tile, dim), lambda b, t: (b, t, 0))
  if kind == 'partial':  # one program's partial sums [B, T / tile, ...]
    rest = (0,) * (len(shape) - 2)
    return pl.BlockSpec((_SQ, _SQ, *shape[2:]), lambda b, t: (b, t, *rest))
  assert kind == 'whole', kind  # the same whole array for every program
  return pl.BlockSpec(shape, lambda b, t: (0,) * len(shape))


def launch(kernel, args, kinds, outs, m, cost, footprint=None, **kernel_options):
  """The pallas_call of `kernel` over (batch row, tile of T) on `args` whose blocks
  `kinds` name ('coef' [B, K, T], 'streams' [m, B, T, D], 'one' [B, T, D], 'whole':
  all of a small array in every program); `outs`: (kind, shape, dtype) per result;
  `cost`: (flops, HBM bytes); it and a result's shape may be functions of the tile
  (a 'partial' result's); `footprint`: `vmem_bytes`'. Mosaic on the TPU, interpret
  mode elsewhere."""
  streams = args[kinds.index('streams')]
  _, batch, length, dim = streams.shape
  tile = choose_tile(length, m, dim, streams.dtype.itemsize, footprint)
  vmem = vmem_bytes(tile, m, dim, streams.dtype.itemsize, footprint)
  if callable(cost):
    cost = cost(tile)
  spec = functools.partial(_block_spec, tile=tile, m=m, dim=dim)
  outs = [
    (kind, shape(tile) if callable(shape) else shape, dtype)
    for kind, shape, dtype in outs
  ]

  def make(interpret):
    return pl.pallas_call(
      functools.partial(kernel, m=m, **kernel_options),
      out_shape=[jax.ShapeDtypeStruct(shape, dtype) for _, shape, dtype in outs],
      grid=(batch, length // tile),
      in_specs=[spec(kind, arg.shape) for kind, arg in zip(kinds, args)],
      out_specs=[spec(kind, shape) for kind, shape, _ in outs],
      compiler_params=pltpu.CompilerParams(
        dimension_semantics=('parallel', 'parallel'),
        vmem_limit_bytes=min(VMEM_BYTES, vmem + HEADROOM_VMEM_BYTES),
      ),
      cost_estimate=pl.CostEstimate(
        flops=int(cost[0]), transcendentals=0, bytes_accessed=int(cost[1])
      ),
      interpret=interpret,
    )

  return jax.lax.platform_dependent(
    *args, tpu=lambda *a: make(False)(*a), default=lambda *a: make(True)(*a)
  )


def per_device(fn, shape, in_kinds, out_kinds):
  """`fn` per device under the active mesh, or `fn` as is on one device: the streams
  (of `shape`) split over batch and length as the sharding rules say, every operand
  and result (`in_kinds`, `out_kinds`: 'streams', 'one', 'coef', 'partial' or 'maps')
  alike; 'whole' operands are whole on every device."""
  split = pallas_mesh.batch_length_split(shape, 'the HC/mHC streams', 'streams')
  if split is None:
    return fn
  mesh, b, t = split
  spec = dict(
    streams=P(None, b, t, None),  # [m, B, T, D]
    one=P(b, t, None),  # [B, T, D]
    coef=P(b, None, t),  # [B, K, T]
    maps=P(b, None, None, t),  # [B, m, m, T] (sinkhorn_pallas)
    partial=P(b, t),  # [B, T / tile, ...]: per-program partial sums
    whole=P(),  # small, on every device
  ).get
  return jax.shard_map(
    fn,
    mesh=mesh,
    in_specs=tuple(map(spec, in_kinds)),
    out_specs=tuple(map(spec, out_kinds))
    if isinstance(out_kinds, tuple)
    else spec(out_kinds),
    check_vma=False,
  )
