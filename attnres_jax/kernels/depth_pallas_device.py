"""The Pallas calls of AttnRes Phase 1 (`depth_pallas.py`) on one device: the grid,
the BlockSpecs and the cost each call states.

The kernels (depth_pallas_kernels.py) see tokens on the lanes: the buffer is read as
[K, B, D, T], the layout the TPU compiler itself picks for the depth buffer
(bf16[K, B, T, D]{2,3,1,0}), so the transposes around the kernels are layout
changes, not copies, where it keeps that choice. The grid runs over (batch row, tile
of T, slot): the first two 'parallel' (a megacore chip splits them), the slot axis
innermost and sequential, one slot [D, tile] a step. The slot's BlockSpec clamps its
index to num_valid - 1 (a scalar-prefetch operand, traced inside the layer scan), so
the steps past the valid slots re-use the block in VMEM: no DMA and no work.

HBM traffic from the BlockSpecs, per device: forward reads the num_valid slots once
(num_valid B T D elements) and writes the Q outputs (Q B T D) and 2 Q B T float32
statistics; backward reads the num_valid slots, the Q output cotangents and 2 Q B T
statistics once and writes the buffer's cotangent once (K B T D; zeros past
num_valid; tokens on the lanes, or with `width_minor` width), or with a carried
cotangent adds into it in place (reads num_valid slots of the carry and B T D more
for slot 0, writes num_valid + num_zeroed slots). Each call's CostEstimate (what the
TPU compiler's cost_analysis and step time take, and the report's own counters,
hlo_cost and hlo_hbm) says that: `bound` slots a call (`depth_pallas.phase1` sets
it). VMEM holds one slot, not K: the tile is the largest multiple of 128 tokens
dividing T whose blocks, scratch and float32 temporaries fit TILE_VMEM_BYTES
(`vmem_bytes`); what a tile needs grows with Q and D only.

Off the TPU the same kernels run in Pallas interpret mode; `jax.lax.platform_dependent`
picks the version for the platform being lowered, so a TPU compile from a CPU host
gets the Mosaic kernel.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from attnres_jax.kernels.depth_pallas_kernels import backward_cost
from attnres_jax.kernels.depth_pallas_kernels import HEADROOM_VMEM_BYTES
from attnres_jax.kernels.depth_pallas_kernels import LANES
from attnres_jax.kernels.depth_pallas_kernels import VMEM_BYTES
from attnres_jax.kernels.depth_pallas_kernels import backward_kernel
from attnres_jax.kernels.depth_pallas_kernels import choose_tile
from attnres_jax.kernels.depth_pallas_kernels import forward_cost
from attnres_jax.kernels.depth_pallas_kernels import forward_kernel
from attnres_jax.kernels.depth_pallas_kernels import vmem_bytes

_SQ = pl.squeezed


def _on_platform(make, *args):
  """`make(interpret)(*args)`: Mosaic on TPU, interpret mode elsewhere."""
  return jax.lax.platform_dependent(
    *args, tpu=lambda *a: make(False)(*a), default=lambda *a: make(True)(*a)
  )


def _launch(kernel, args, in_kinds, outs, scratch, *, tile, vmem, cost, num_zeroed=0):
  """The pallas_call of `kernel` over a grid of (batch row, tile of T, slot) on `args`
  (the scalar-prefetch num_valid, then operands whose BlockSpecs `in_kinds` name);
  `outs`: (kind, shape, dtype) per result; `scratch`: the leading dims of float32
  VMEM scratch (the tile appended); `vmem`: the tile's estimate (`vmem_bytes`);
  `cost`: the CostEstimate's (flops, transcendentals, HBM bytes). A 'carry' operand
  (a carried cotangent, width on the lanes) is the first result's buffer too: the
  kernel writes its slots before num_valid + `num_zeroed` in place; a 'first'
  operand [B, T, D] is added to its slot 0."""
  num_slots, batch, dim, length = args[2].shape
  num_queries = args[1].shape[0]
  # The slot a step reads: k, held at the last valid one past num_valid (no DMA).
  valid = lambda k, nv: jnp.maximum(jnp.minimum(k, nv[0] - 1), 0)
  # The carried slot a step writes: k, held at the last one written (no copy out).
  last = lambda nv: jnp.minimum(nv[0] + num_zeroed, num_slots) - 1
  written = lambda k, nv: jnp.maximum(jnp.minimum(k, last(nv)), 0)
  lanes = lambda b, t, k, nv: (b, 0, t)
  slot_block, rms_block = (_SQ, _SQ, dim, tile), (_SQ, _SQ, 1, tile)
  specs = dict(
    folded=pl.BlockSpec((num_queries, dim), lambda b, t, k, nv: (0, 0)),
    buf=pl.BlockSpec(slot_block, lambda b, t, k, nv: (valid(k, nv), b, 0, t)),
    dbuf=pl.BlockSpec(slot_block, lambda b, t, k, nv: (k, b, 0, t)),
    carry=pl.BlockSpec(
      (_SQ, _SQ, tile, dim), lambda b, t, k, nv: (valid(k, nv), b, t, 0)
    ),
    dcarry=pl.BlockSpec(
      (_SQ, _SQ, tile, dim), lambda b, t, k, nv: (written(k, nv), b, t, 0)
    ),
    dslot=pl.BlockSpec((_SQ, _SQ, tile, dim), lambda b, t, k, nv: (k, b, t, 0)),
    first=pl.BlockSpec((_SQ, tile, dim), lambda b, t, k, nv: (b, t, 0)),
    rms=pl.BlockSpec(rms_block, lambda b, t, k, nv: (b, valid(k, nv), 0, t)),
    drms=pl.BlockSpec(rms_block, lambda b, t, k, nv: (b, k, 0, t)),
    stat=pl.BlockSpec((_SQ, num_queries, tile), lanes),
    out=pl.BlockSpec((_SQ, dim, tile), lanes),
    fold=pl.BlockSpec((_SQ, _SQ, num_queries, dim), lambda b, t, k, nv: (b, t, 0, 0)),
  )
  # Operand indices count the scalar-prefetch num_valid.
  aliases = {1 + in_kinds.index('carry'): 0} if 'carry' in in_kinds else {}
  flops, transcendentals, io_bytes = (int(round(c)) for c in cost)

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
      input_output_aliases=aliases,
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


def forward_device(
  nv, folded_QD, buf_KBTD, rms_KBT, *, bound, eps, out_dtype, psum_axes=()
):
  """Per device: (max [B, Q, T], sum [B, Q, T], the Q outputs [B, T, D]). `bound`:
  how many slots the kernel reads per call (the CostEstimate's slot count)."""
  del psum_axes
  _, batch, length, dim = buf_KBTD.shape
  num_queries, has_rms = folded_QD.shape[0], rms_KBT is not None
  osz, isz = jnp.dtype(out_dtype).itemsize, buf_KBTD.dtype.itemsize
  tile, vmem = _tile(buf_KBTD, num_queries, osz)
  stat = ('stat', (batch, num_queries, length), jnp.float32)
  out = ('out', (batch, dim, length), out_dtype)
  max_BQT, sum_BQT, *outs = _launch(
    functools.partial(forward_kernel, num_queries=num_queries, eps=eps, has_rms=has_rms),
    (nv, folded_QD, _lanes(buf_KBTD)) + ((_rms_lanes(rms_KBT),) if has_rms else ()),
    ['folded', 'buf'] + ['rms'] * has_rms,
    [stat, stat] + [out] * num_queries,
    [(num_queries, dim)],
    tile=tile,
    vmem=vmem,
    cost=forward_cost(batch * length, bound, num_queries, dim, isz, osz, has_rms),
  )
  return max_BQT, sum_BQT, tuple(_lanes(o) for o in outs)


def _add_into(d_carry_KBTD, dbuf_KBTD, d_first_BTD, nv, num_zeroed):
  """XLA's `cotangent_into`: the carry plus the buffer's cotangent (zero from
  num_valid on) and `d_first_BTD` at slot 0, the `num_zeroed` slots from num_valid
  on set to zero."""
  slot_K = jnp.arange(d_carry_KBTD.shape[0])
  zeroed_K = (slot_K >= nv[0]) & (slot_K < nv[0] + num_zeroed)
  out_KBTD = d_carry_KBTD.astype(jnp.float32) + dbuf_KBTD.astype(jnp.float32)
  if d_first_BTD is not None:
    out_KBTD = out_KBTD.at[0].add(d_first_BTD.astype(jnp.float32))
  out_KBTD = jnp.where(zeroed_K[:, None, None, None], 0, out_KBTD)
  return out_KBTD.astype(d_carry_KBTD.dtype)


def backward_device(
  nv,
  folded_QD,
  buf_KBTD,
  rms_KBT,
  max_BQT,
  dsum_BQT,
  douts,
  d_carry_KBTD,
  d_first_BTD,
  *,
  bound,
  eps,
  num_zeroed,
  width_minor,
  psum_axes=(),
):
  """Per device: (d buffer [K, B, T, D], or with `d_carry_KBTD` that carry plus it
  and `d_first_BTD` at slot 0 (`cotangent_into`), d inverse RMS [K, B, T] or None,
  d folded [Q, D] summed over the devices). The carry goes through the kernel where
  the width and the tile are whole lanes (its block is [tile, D]), through an XLA
  add elsewhere. `width_minor` (no carry): d buffer written by the kernel width-minor
  ([tile, D] blocks) where the lanes allow."""
  num_slots, batch, length, dim = buf_KBTD.shape
  num_queries, has_rms = folded_QD.shape[0], rms_KBT is not None
  osz, isz = douts[0].dtype.itemsize, buf_KBTD.dtype.itemsize
  tile, vmem = _tile(buf_KBTD, num_queries, osz)
  whole_lanes = dim % LANES == 0 and tile % LANES == 0  # [tile, D] blocks fit
  into = (d_carry_KBTD is not None or width_minor) and whole_lanes
  reads_carry = into and d_carry_KBTD is not None  # else the XLA add below, or none
  if reads_carry:
    dbuf = ('dcarry', d_carry_KBTD.shape, d_carry_KBTD.dtype)
    first_size = 0 if d_first_BTD is None else d_first_BTD.dtype.itemsize
    sizes = (isz, osz, d_carry_KBTD.dtype.itemsize, num_zeroed, first_size)
  elif into:  # every slot's cotangent written once, width on the lanes
    dbuf = ('dslot', buf_KBTD.shape, buf_KBTD.dtype)
    sizes = (isz, osz, None, 0, 0)
  else:
    dbuf = ('dbuf', (num_slots, batch, dim, length), buf_KBTD.dtype)
    sizes = (isz, osz, None, 0, 0)
  outs = _launch(
    functools.partial(
      backward_kernel,
      num_queries=num_queries,
      eps=eps,
      has_rms=has_rms,
      into=into,
      num_zeroed=num_zeroed,
      has_first=into and d_first_BTD is not None,
      has_carry=reads_carry,
    ),
    (nv, folded_QD, _lanes(buf_KBTD))
    + ((_rms_lanes(rms_KBT),) if has_rms else ())
    + (max_BQT, dsum_BQT, *(_lanes(d) for d in douts))
    + ((d_carry_KBTD,) if reads_carry else ())
    + ((d_first_BTD,) if into and d_first_BTD is not None else ()),
    ['folded', 'buf']
    + ['rms'] * has_rms
    + ['stat'] * 2
    + ['out'] * num_queries
    + ['carry'] * reads_carry
    + ['first'] * (into and d_first_BTD is not None),
    [dbuf]
    + [('drms', (batch, num_slots, 1, length), jnp.float32)] * has_rms
    + [('fold', (batch, length // tile, num_queries, dim), jnp.float32)],
    [],
    tile=tile,
    vmem=vmem,
    cost=backward_cost(
      batch * length,
      batch * (length // tile),
      bound,
      num_slots,
      num_queries,
      dim,
      sizes,
      has_rms,
    ),
    num_zeroed=num_zeroed,
  )
  dfold_QD = jnp.sum(outs[-1], axis=(0, 1))
  if psum_axes:
    dfold_QD = jax.lax.psum(dfold_QD, psum_axes)
  drms_KBT = jnp.swapaxes(outs[1][:, :, 0], 0, 1) if has_rms else None
  dbuf_KBTD = outs[0] if into else _lanes(outs[0])
  if d_carry_KBTD is not None and not into:
    dbuf_KBTD = _add_into(d_carry_KBTD, dbuf_KBTD, d_first_BTD, nv, num_zeroed)
  return dbuf_KBTD, drms_KBT, dfold_QD
