"""Summing a Phase 1 buffer cotangent into the carried one, in place (a Pallas TPU kernel).

The linear-memory backward (`residuals/attnres_backward.py`) adds, once per segment,
the depth buffer's cotangent from Phase 1's VJP into the cotangent it carries
through the segments ([K, B, T, D] each). With the Phase 1 kernel
(`depth_pallas`), that cotangent comes out with tokens on the lanes (the kernel's
layout, bf16[K, B, T, D]{2,3,1,0} on TPU); an XLA add then keeps that layout for
the sum, and every slice of the carry afterwards (the next segment's local slots)
relayouts the whole of it. `accumulate` reads the Phase 1 cotangent in its layout
and writes the sum with the width on the lanes (XLA's default for the carry), into
the carry's own buffer (`input_output_aliases`).

Only the first `num_valid` slots are read and written: Phase 1 reads the slots
before the segment, so its cotangent is zero past them, and the carry's later slots
keep their values through the alias. The grid runs over (batch row, tile of T, slot)
with the slot innermost; its block index stops at the last slot written, so the later
steps revisit the block just written (no copy in or out, no arithmetic).

It also zeroes the `num_zeroed` slots from `num_valid` on (the segment's own slots,
whose carried cotangent the backward took before the sum), so that no XLA update
of the carry comes between two of these calls.

HBM traffic per call (BlockSpecs): 3 (num_valid + num_zeroed) B T D elements (the
carry and the cotangent read, the sum written); an XLA add moves 3 K B T D.
Off the TPU the kernel runs in Pallas interpret mode; `jax.lax.platform_dependent`
picks Mosaic when a TPU program is lowered (as `depth_pallas` does).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import PartitionSpec as P

from attnres_jax import sharding

LANES = 128
# VMEM for the double-buffered blocks of one step (carry, cotangent, sum); float32
# temporaries of the sum come on top (VMEM_LIMIT_BYTES asked of Mosaic).
BLOCK_VMEM_BYTES = 8 * 2**20
VMEM_LIMIT_BYTES = 32 * 2**20
_SQ = pl.squeezed


def _kernel(nv_ref, acc_ref, d_ref, out_ref, *, num_zeroed):
  k = pl.program_id(2)

  @pl.when(k < nv_ref[0])
  def _():
    d_tD = d_ref[...].astype(jnp.float32).T  # tokens on the lanes -> width
    out_ref[...] = (acc_ref[...].astype(jnp.float32) + d_tD).astype(out_ref.dtype)

  if num_zeroed:

    @pl.when((k >= nv_ref[0]) & (k < nv_ref[0] + num_zeroed))
    def _():
      out_ref[...] = jnp.zeros(out_ref.shape, out_ref.dtype)


def choose_tile(length, dim, acc_itemsize, d_itemsize):
  """The largest of 512, 256, 128 tokens dividing `length` whose double-buffered
  blocks fit BLOCK_VMEM_BYTES (at least 128)."""
  per_token = 2 * dim * (2 * acc_itemsize + d_itemsize)
  fits = [t for t in (4 * LANES, 2 * LANES, LANES) if length % t == 0]
  return next((t for t in fits if t * per_token <= BLOCK_VMEM_BYTES), fits[-1])


def _device(nv, acc_KBTD, d_KBTD, *, expected_valid, num_zeroed):
  num_slots, batch, length, dim = acc_KBTD.shape
  tile = choose_tile(length, dim, acc_KBTD.dtype.itemsize, d_KBTD.dtype.itemsize)
  slot = lambda k, nv: jnp.minimum(k, jnp.minimum(nv[0] + num_zeroed, num_slots) - 1)
  rows = pl.BlockSpec((_SQ, _SQ, tile, dim), lambda b, t, k, nv: (slot(k, nv), b, t, 0))
  lanes = pl.BlockSpec((_SQ, _SQ, dim, tile), lambda b, t, k, nv: (slot(k, nv), b, 0, t))
  itemsizes = 2 * acc_KBTD.dtype.itemsize + d_KBTD.dtype.itemsize
  elements = round(acc_KBTD.size * (expected_valid + num_zeroed) / num_slots)

  def make(interpret):
    return pl.pallas_call(
      functools.partial(_kernel, num_zeroed=num_zeroed),
      out_shape=jax.ShapeDtypeStruct(acc_KBTD.shape, acc_KBTD.dtype),
      grid_spec=pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1,
        grid=(batch, length // tile, num_slots),
        in_specs=[rows, lanes],
        out_specs=rows,
      ),
      input_output_aliases={1: 0},  # operand 1: the carry (after num_valid)
      compiler_params=pltpu.CompilerParams(
        dimension_semantics=('parallel', 'parallel', 'arbitrary'),
        vmem_limit_bytes=VMEM_LIMIT_BYTES,
      ),
      cost_estimate=pl.CostEstimate(
        flops=elements, transcendentals=0, bytes_accessed=elements * itemsizes
      ),
      interpret=interpret,
    )

  d_KDBT = jnp.swapaxes(d_KBTD, -1, -2)  # the Phase 1 kernel's layout: free on TPU
  return jax.lax.platform_dependent(
    nv,
    acc_KBTD,
    d_KDBT,
    tpu=lambda *a: make(False)(*a),
    default=lambda *a: make(True)(*a),
  )


def _per_device(fn, shape):
  """`fn` per device under the active mesh (the buffer split as the sharding rules
  say; None where they split its slots, whose indices `num_valid` counts), or `fn`
  as is on one device."""
  active = sharding._ACTIVE.get()
  if active is None or active[0].size == 1:
    return fn, shape
  mesh, rules = active
  spec = sharding.logical_to_spec(sharding.DEPTH_BUFFER, rules, mesh=mesh, shape=shape)
  spec = tuple(spec) + (None,) * (4 - len(spec))
  if spec[0] is not None:
    return None, shape
  named = lambda axes: () if axes is None else (axes,) if isinstance(axes, str) else axes
  local = tuple(
    n // math.prod(mesh.shape[a] for a in named(axes)) for n, axes in zip(shape, spec)
  )
  buf = P(*spec)
  fn = jax.shard_map(
    fn, mesh=mesh, in_specs=(P(), buf, buf), out_specs=buf, check_vma=False
  )
  return fn, local


def accumulate(acc_KBTD, d_KBTD, num_valid=None, expected_valid=None, num_zeroed=0):
  """`acc + d` (in acc's dtype) for [K, B, T, D] depth buffer cotangents, where `d`
  (Phase 1's cotangent) is zero from slot `num_valid` on (None: all K; may be
  traced, at least 1): the sum written in place of `acc` (module docstring). Tokens
  or width per device not a multiple of 128, or the slots split over devices: an
  XLA add. `expected_valid`: the valid slots the kernel's cost estimate (for the
  compiler's step time) assumes, e.g. the mean over a loop's calls; default
  `num_valid` where static, else K. `num_zeroed`: that many slots from `num_valid`
  on are set to zero (static)."""
  num_slots = acc_KBTD.shape[0]
  if expected_valid is None:
    expected_valid = num_valid if isinstance(num_valid, int) else num_slots
  fn, (_, _, length, dim) = _per_device(
    functools.partial(_device, expected_valid=expected_valid, num_zeroed=num_zeroed),
    acc_KBTD.shape,
  )
  if fn is None or length % LANES or dim % LANES:
    out_KBTD = acc_KBTD + d_KBTD.astype(acc_KBTD.dtype)
    if not num_zeroed:
      return out_KBTD
    slot_K = jnp.arange(num_slots)
    zeroed_K = (slot_K >= num_valid) & (slot_K < num_valid + num_zeroed)
    return jnp.where(zeroed_K[:, None, None, None], 0, out_KBTD).astype(out_KBTD.dtype)
  nv = jnp.asarray(num_slots if num_valid is None else num_valid, jnp.int32)
  return fn(jnp.clip(nv, 1, num_slots).reshape(1), acc_KBTD, d_KBTD)
