"""AttnRes Phase 1 as a Pallas TPU kernel and its VJP (`model.depth_kernel='pallas'`).

Same contract as `depth.phase1`: Q queries (gains folded in) against the first
`num_valid` slots of the depth buffer [K, B, T, D], returning per query the max logit
and the sum of exponentials ([B, T], float32; the max stop-gradient) and the
unnormalised output [B, T, D] in `out_dtype`.

The kernels (depth_pallas_kernels.py) see tokens on the lanes: the buffer is read as
[K, B, D, T], the layout the TPU compiler itself picks for the depth buffer
(bf16[K, B, T, D]{2,3,1,0}), so the transposes around the kernels are layout
changes, not copies, where it keeps that choice. The grid runs over (batch row, tile
of T, slot): the first two 'parallel' (a megacore chip splits them), the slot axis
innermost and sequential, one slot [D, tile] a step. The slot's BlockSpec clamps its
index to num_valid - 1 (a scalar-prefetch operand, traced inside the layer scan), so
the steps past the valid slots re-use the block in VMEM: no DMA and no work. The
forward is an online softmax over the slot steps; the backward takes the forward's
max and treats each slot on its own.

HBM traffic from the BlockSpecs, per device: forward reads the num_valid slots once
(num_valid B T D elements) and writes the Q outputs (Q B T D) and 2 Q B T float32
statistics; backward reads the num_valid slots, the Q output cotangents and 2 Q B T
statistics once and writes the buffer's cotangent once (K B T D; zeros past
num_valid). The TPU compiler's own estimates (cost_analysis, its step time) take
each call's CostEstimate, which counts num_valid slots where num_valid is a Python int
and all K where it is traced (the layer scan's case); hlo_cost counts a custom call by
its operand and result shapes (all K). Neither shows the skipped DMAs: a hardware
effect.
VMEM holds one slot, not K: the tile is the largest multiple of 128 tokens dividing
T whose blocks, scratch and float32 temporaries fit TILE_VMEM_BYTES (`vmem_bytes`);
what a tile needs grows with Q and D only.

Off the TPU (CPU tests, the default CPU run) the same kernels run in Pallas interpret
mode; `jax.lax.platform_dependent` picks the version for the platform being lowered,
so a TPU compile from a CPU host gets the Mosaic kernel. Under the model's mesh the
kernels run per device in `jax.shard_map` (the buffer split over batch and length);
a buffer split over its width or its slots is refused.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import PartitionSpec as P

from attnres_jax import sharding
from attnres_jax.depth_pallas_kernels import backward_kernel
from attnres_jax.depth_pallas_kernels import forward_kernel

# What one program's tile may need (blocks double buffered, scratch, temporaries;
# the tile is the largest that fits, at least 128 tokens), and the headroom asked of
# Mosaic above that estimate.
TILE_VMEM_BYTES = 40 * 2**20
HEADROOM_VMEM_BYTES = 16 * 2**20
# The on-chip vector memory the kernels may assume a core has (v5p's 64 MiB; v5e and
# v6e have more): a config whose narrowest tile needs more is refused by validation.
VMEM_BYTES = 64 * 2**20
LANES = 128
SUBLANES = 8
_SQ = pl.squeezed


def vmem_bytes(tile, num_queries, dim, itemsize, out_itemsize):
  """On-chip memory of the larger of the two kernels at `tile` tokens, independent
  of the number of slots. Forward: one slot, the Q outputs and the statistics
  (double buffered), the Q float32 accumulators; backward: one slot and its
  cotangent, the Q output cotangents, three statistics, the queries and their
  cotangent (double buffered). Both: about 4 float32 [D, tile] temporaries."""
  rows = -(-num_queries // SUBLANES) * SUBLANES  # [Q, tile] pads to 8 sublanes
  slot, outs = dim * tile * itemsize, num_queries * dim * tile * out_itemsize
  stat, rms, folded = rows * tile * 4, SUBLANES * tile * 4, rows * dim * 4
  forward = 2 * (slot + outs + 2 * stat + rms + folded) + 4 * num_queries * dim * tile
  backward = 2 * (2 * slot + outs + 3 * stat + 2 * rms + 2 * folded)
  return max(forward, backward) + 4 * 4 * dim * tile


def least_vmem_bytes(num_queries, dim, itemsize, out_itemsize):
  """On-chip memory the kernels need at their narrowest tile (128 tokens)."""
  return vmem_bytes(LANES, num_queries, dim, itemsize, out_itemsize)


def choose_tile(length, num_queries, dim, itemsize, out_itemsize):
  """Tokens per program along T (the lane axis): the largest multiple of 128 dividing
  `length` that fits TILE_VMEM_BYTES (at least 128), or all of T when no multiple of
  128 divides it."""
  fits = [
    tile
    for tile in range(LANES, length + 1, LANES)
    if length % tile == 0
    and vmem_bytes(tile, num_queries, dim, itemsize, out_itemsize) <= TILE_VMEM_BYTES
  ]
  if fits:
    return max(fits)
  return LANES if length % LANES == 0 else length


def _on_platform(make, *args):
  """`make(interpret)(*args)`: Mosaic on TPU, interpret mode elsewhere."""
  return jax.lax.platform_dependent(
    *args, tpu=lambda *a: make(False)(*a), default=lambda *a: make(True)(*a)
  )


def _launch(kernel, args, in_kinds, outs, scratch, *, tile, vmem, cost):
  """The pallas_call of `kernel` over a grid of (batch row, tile of T, slot) on `args`
  (the scalar-prefetch num_valid, then operands whose BlockSpecs `in_kinds` name);
  `outs`: (kind, shape, dtype) per result; `scratch`: the leading dims of float32
  VMEM scratch (the tile appended); `vmem`: the tile's estimate (`vmem_bytes`);
  `cost`: the CostEstimate's (flops, transcendentals, HBM bytes)."""
  num_slots, batch, dim, length = args[2].shape
  num_queries = args[1].shape[0]
  # The slot a step reads: k, held at the last valid one past num_valid (no DMA).
  valid = lambda k, nv: jnp.maximum(jnp.minimum(k, nv[0] - 1), 0)
  lanes = lambda b, t, k, nv: (b, 0, t)
  slot_block, rms_block = (_SQ, _SQ, dim, tile), (_SQ, _SQ, 1, tile)
  specs = dict(
    folded=pl.BlockSpec((num_queries, dim), lambda b, t, k, nv: (0, 0)),
    buf=pl.BlockSpec(slot_block, lambda b, t, k, nv: (valid(k, nv), b, 0, t)),
    dbuf=pl.BlockSpec(slot_block, lambda b, t, k, nv: (k, b, 0, t)),
    rms=pl.BlockSpec(rms_block, lambda b, t, k, nv: (b, valid(k, nv), 0, t)),
    drms=pl.BlockSpec(rms_block, lambda b, t, k, nv: (b, k, 0, t)),
    stat=pl.BlockSpec((_SQ, num_queries, tile), lanes),
    out=pl.BlockSpec((_SQ, dim, tile), lanes),
    fold=pl.BlockSpec((_SQ, _SQ, num_queries, dim), lambda b, t, k, nv: (b, t, 0, 0)),
  )
  flops, transcendentals, io_bytes = (int(c) for c in cost)

  def make(interpret):
    return pl.pallas_call(
      kernel,
      out_shape=[jax.ShapeDtypeStruct(shape, dtype) for _, shape, dtype in outs],
      grid_spec=pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1,
        grid=(batch, length // tile, num_slots),
        in_specs=[specs[kind] for kind in in_kinds],
        out_specs=[specs[kind] for kind, _, _ in outs],
        scratch_shapes=[pltpu.VMEM(rows + (tile,), jnp.float32) for rows in scratch],
      ),
      compiler_params=pltpu.CompilerParams(
        dimension_semantics=('parallel', 'parallel', 'arbitrary'),
        vmem_limit_bytes=min(VMEM_BYTES, vmem + HEADROOM_VMEM_BYTES),
      ),
      cost_estimate=pl.CostEstimate(
        flops=flops, transcendentals=transcendentals, bytes_accessed=io_bytes
      ),
      interpret=interpret,
    )

  return _on_platform(make, *args)


# The kernels see tokens on lanes: the buffer as [K, B, D, T], the statistics as
# [B, Q, T], the outputs as [B, D, T]. These are the layouts the TPU compiler picks
# for the XLA version of Phase 1 (the buffer bf16[K, B, T, D]{2,3,1,0}), so the
# transposes below are layout changes it can make free.
_lanes = lambda x: jnp.swapaxes(x, -1, -2)
_rms_lanes = lambda rms_KBT: (
  None if rms_KBT is None else jnp.swapaxes(rms_KBT, 0, 1)[:, :, None]
)


def _tile(buf_KBTD, num_queries, out_itemsize):
  """(tile, its VMEM estimate) for this buffer."""
  _, _, length, dim = buf_KBTD.shape
  sizes = (num_queries, dim, buf_KBTD.dtype.itemsize, out_itemsize)
  tile = choose_tile(length, *sizes)
  return tile, vmem_bytes(tile, *sizes)


def _forward_device(
  nv, folded_QD, buf_KBTD, rms_KBT, *, bound, eps, out_dtype, psum_axes=()
):
  """Per device: (max [B, Q, T], sum [B, Q, T], the Q outputs [B, T, D]). `bound`:
  how many slots at most are valid (the CostEstimate's slot count)."""
  del psum_axes
  _, batch, length, dim = buf_KBTD.shape
  num_queries, has_rms = folded_QD.shape[0], rms_KBT is not None
  osz, isz = jnp.dtype(out_dtype).itemsize, buf_KBTD.dtype.itemsize
  tile, vmem = _tile(buf_KBTD, num_queries, osz)
  stat = ('stat', (batch, num_queries, length), jnp.float32)
  out = ('out', (batch, dim, length), out_dtype)
  elements = batch * length * bound  # (token, valid slot) pairs
  max_BQT, sum_BQT, *outs = _launch(
    functools.partial(forward_kernel, num_queries=num_queries, eps=eps, has_rms=has_rms),
    (nv, folded_QD, _lanes(buf_KBTD)) + ((_rms_lanes(rms_KBT),) if has_rms else ()),
    ['folded', 'buf'] + ['rms'] * has_rms,
    [stat, stat] + [out] * num_queries,
    [(num_queries, dim)],
    tile=tile,
    vmem=vmem,
    cost=(
      elements * dim * (5 * num_queries + 3),
      elements * (2 * num_queries + 1),
      elements * (dim * isz + 4 * has_rms)
      + batch * length * num_queries * (dim * osz + 8),
    ),
  )
  return max_BQT, sum_BQT, tuple(_lanes(o) for o in outs)


def _backward_device(
  nv, folded_QD, buf_KBTD, rms_KBT, max_BQT, dsum_BQT, douts, *, bound, eps, psum_axes=()
):
  """Per device: (d buffer [K, B, T, D], d inverse RMS [K, B, T] or None, d folded
  [Q, D] summed over the devices)."""
  num_slots, batch, length, dim = buf_KBTD.shape
  num_queries, has_rms = folded_QD.shape[0], rms_KBT is not None
  osz, isz = douts[0].dtype.itemsize, buf_KBTD.dtype.itemsize
  tile, vmem = _tile(buf_KBTD, num_queries, osz)
  elements = batch * length * bound
  outs = _launch(
    functools.partial(backward_kernel, num_queries=num_queries, eps=eps, has_rms=has_rms),
    (nv, folded_QD, _lanes(buf_KBTD))
    + ((_rms_lanes(rms_KBT),) if has_rms else ())
    + (max_BQT, dsum_BQT, *(_lanes(d) for d in douts)),
    ['folded', 'buf'] + ['rms'] * has_rms + ['stat'] * 2 + ['out'] * num_queries,
    [('dbuf', (num_slots, batch, dim, length), buf_KBTD.dtype)]
    + [('drms', (batch, num_slots, 1, length), jnp.float32)] * has_rms
    + [('fold', (batch, length // tile, num_queries, dim), jnp.float32)],
    [],
    tile=tile,
    vmem=vmem,
    cost=(
      elements * dim * (12 * num_queries + 6),
      elements * num_queries,
      (elements + batch * length * num_slots) * (dim * isz + 4 * has_rms)
      + batch * length * num_queries * (dim * osz + 8),
    ),
  )
  dfold_QD = jnp.sum(outs[-1], axis=(0, 1))
  if psum_axes:
    dfold_QD = jax.lax.psum(dfold_QD, psum_axes)
  drms_KBT = jnp.swapaxes(outs[1][:, :, 0], 0, 1) if has_rms else None
  return _lanes(outs[0]), drms_KBT, dfold_QD


# -- the device split and the custom VJP ----------------------------------------------


def _sharded(fn, shape, in_specs, out_specs):
  """`fn` per device under the active mesh, the buffer [K, B, T, D] split as the
  sharding rules say over batch and length (a split over slots or width is refused),
  or `fn` as is on one device."""
  active = sharding._ACTIVE.get()
  if active is None or active[0].size == 1:
    return fn
  mesh, rules = active
  spec = tuple(
    sharding.logical_to_spec(sharding.DEPTH_BUFFER, rules, mesh=mesh, shape=shape)
  )
  k, b, t, d = spec + (None,) * (4 - len(spec))
  if k is not None or d is not None:
    raise ValueError(
      f"depth_kernel='pallas' needs the depth buffer split over batch and length "
      f'only; the sharding rules split it as {P(k, b, t, d)} (slots, batch, length, '
      f"width) on mesh {dict(mesh.shape)}: map 'depth' and 'hidden' to no mesh axis "
      f"or use depth_kernel='xla'."
    )
  spec = dict(
    buf=P(None, b, t, None),  # [K, B, T, D]
    rms=P(None, b, t),  # [K, B, T]
    stat=P(b, None, t),  # [B, Q, T]
    out=P(b, t, None),  # [B, T, D]
    rep=P(),
  ).get
  named = lambda axes: () if not axes else (axes,) if isinstance(axes, str) else axes
  return jax.shard_map(
    functools.partial(fn, psum_axes=named(b) + named(t)),
    mesh=mesh,
    in_specs=jax.tree.map(spec, in_specs),
    out_specs=jax.tree.map(spec, out_specs),
    check_vma=False,
  )


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _phase1(buf_KBTD, folded_QD, nv, rms_KBT, bound, eps, out_dtype):
  return _phase1_fwd(buf_KBTD, folded_QD, nv, rms_KBT, bound, eps, out_dtype)[0]


def _phase1_fwd(buf_KBTD, folded_QD, nv, rms_KBT, bound, eps, out_dtype):
  rms = None if rms_KBT is None else 'rms'
  fn = _sharded(
    functools.partial(_forward_device, bound=bound, eps=eps, out_dtype=out_dtype),
    buf_KBTD.shape,
    ('rep', 'rep', 'buf', rms),
    ('stat', 'stat', ('out',) * folded_QD.shape[0]),
  )
  out = fn(nv, folded_QD, buf_KBTD, rms_KBT)
  return out, (buf_KBTD, folded_QD, nv, rms_KBT, out[0])


def _phase1_bwd(bound, eps, out_dtype, residuals, cotangents):
  del out_dtype
  buf_KBTD, folded_QD, nv, rms_KBT, max_BQT = residuals
  _, dsum_BQT, douts = cotangents  # the max is stop-gradient
  rms = None if rms_KBT is None else 'rms'
  fn = _sharded(
    functools.partial(_backward_device, bound=bound, eps=eps),
    buf_KBTD.shape,
    ('rep', 'rep', 'buf', rms, 'stat', 'stat', ('out',) * len(douts)),
    ('buf', rms, 'rep'),
  )
  dbuf_KBTD, drms_KBT, dfold_QD = fn(
    nv, folded_QD, buf_KBTD, rms_KBT, max_BQT, dsum_BQT, tuple(douts)
  )
  return dbuf_KBTD, dfold_QD, None, drms_KBT


_phase1.defvjp(_phase1_fwd, _phase1_bwd)


def phase1(
  buffer_KBTD,
  queries_QD,
  gains_QD,
  *,
  eps,
  num_valid,
  inv_rms_KBT=None,
  out_dtype=jnp.float32,
):
  """`depth.phase1` computed by the Pallas kernels (module docstring): a tuple over
  the Q queries of (max [B, T], sum of exponentials [B, T], output [B, T, D])."""
  num_slots = buffer_KBTD.shape[0]
  if num_valid is None:
    num_valid = num_slots
  # A Python int bounds the slots read (the CostEstimate); a traced one, all K.
  static = isinstance(num_valid, (int, np.integer))
  bound = min(int(num_valid), num_slots) if static else num_slots
  nv = jnp.clip(jnp.asarray(num_valid, jnp.int32), 0, num_slots).reshape(1)
  folded_QD = queries_QD.astype(jnp.float32) * gains_QD.astype(jnp.float32)
  max_BQT, sum_BQT, outs = _phase1(
    buffer_KBTD, folded_QD, nv, inv_rms_KBT, bound, float(eps), jnp.dtype(out_dtype)
  )
  max_BQT = jax.lax.stop_gradient(max_BQT)
  return tuple((max_BQT[:, q], sum_BQT[:, q], out) for q, out in enumerate(outs))
