"""AttnRes Phase 1 as a Pallas TPU kernel and its VJP (`model.depth_kernel='pallas'`).

Same contract as `depth.phase1`: Q queries (gains folded in) against the first
`num_valid` slots of the depth buffer [K, B, T, D], returning per query the max logit
and the sum of exponentials ([B, T], float32; the max stop-gradient) and the
unnormalised output [B, T, D] in `out_dtype`.

The kernels. Tokens are on the lanes: the buffer is read as [K, B, D, T], the layout
the TPU compiler itself picks for the depth buffer (bf16[K, B, T, D]{2,3,1,0}), so
the transposes around the kernels are layout changes, not copies, where it keeps
that choice. The grid runs over (batch row, tile of T) ('parallel': a megacore chip
splits it); each program DMAs its [K, D, tile] block of the buffer into VMEM once
and, in float32, with a loop over slots (one slot's temporaries live at a time):

  forward:   dot_qk = f_q . v_k (the MXU, f_q = w_q * g_q), r_k = 1 / RMS(v_k) (or the
             carried r), l_qk = dot_qk r_k for the slots k < num_valid only (a
             scalar-prefetch operand), kept in VMEM scratch with their max m_q;
             then e_qk = exp(l_qk - m_q), s_q = sum_k e_qk, o_q = sum_k e_qk v_k
             (each of the Q outputs its own [B, D, T] result);
  backward:  the logits recomputed as above, then
             de_qk = <do_q, v_k> + ds_q,  dl_qk = e_qk de_qk,
             dv_k  = sum_q e_qk do_q + r_k sum_q dl_qk f_q - (r_k^3 / D) dr_k v_k
                     with dr_k = sum_q dl_qk dot_qk (the last term only when r is
                     recomputed; a carried r gets dr as its cotangent instead),
             df_q  = sum_{k, tokens} dl_qk r_k v_k (per-program partials, summed
             outside, then over the devices).

HBM traffic from the BlockSpecs, per device: forward reads the buffer once (K B T D
elements) and writes the Q outputs (Q B T D) and 2 Q B T float32 statistics;
backward reads the buffer and the Q output cotangents once and writes the buffer's
cotangent once (K B T D; zeros past num_valid). Slots past num_valid are still read
(the block holds all K) but not computed on.
VMEM: the tile is the largest multiple of 128 tokens dividing T whose double-buffered
blocks fit BLOCK_VMEM_BYTES; at 128 tokens, K = 33 slots of D = 1024 in bfloat16 need
about 35 MB of blocks (v5p has 64 MiB of VMEM).

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
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import PartitionSpec as P

from attnres_jax import sharding

# VMEM for one program's double-buffered blocks (the tile is the largest that fits,
# at least 128 tokens), and the headroom asked of Mosaic for the float32 temporaries.
BLOCK_VMEM_BYTES = 24 * 2**20
# The on-chip vector memory the kernels may assume a core has (v5p's 64 MiB; v5e and
# v6e have more): a config whose narrowest tile needs more is refused by validation.
VMEM_BYTES = 64 * 2**20
TEMP_VMEM_BYTES = 32 * 2**20
LANES = 128
_NT = (((1,), (1,)), ((), ()))  # a . b^T
_TN = (((0,), (0,)), ((), ()))  # a^T . b
_HIGHEST = jax.lax.Precision.HIGHEST
_SQ = pl.squeezed


def block_bytes(tile, num_slots, num_queries, dim, itemsize, out_itemsize):
  """VMEM of the backward's double-buffered blocks for `tile` tokens: the buffer in,
  its cotangent out, the Q output cotangents in."""
  return 2 * tile * dim * (2 * num_slots * itemsize + num_queries * out_itemsize)


def least_vmem_bytes(num_slots, num_queries, dim, itemsize, out_itemsize):
  """On-chip memory the backward needs at its narrowest tile (128 tokens): its
  blocks, the float32 scratch (logits, dots, inverse RMS of every slot) and about
  Q + 3 float32 [D, tile] temporaries (a slot, its cotangent, the outputs)."""
  blocks = block_bytes(LANES, num_slots, num_queries, dim, itemsize, out_itemsize)
  scratch = 4 * LANES * num_slots * (2 * num_queries + 1)
  return blocks + scratch + 4 * LANES * dim * (num_queries + 3)


def choose_tile(length, num_slots, num_queries, dim, itemsize, out_itemsize):
  """Tokens per program along T (the lane axis): the largest multiple of 128 dividing
  `length` whose blocks fit BLOCK_VMEM_BYTES (at least 128), or all of T when no
  multiple of 128 divides it."""
  fits = [
    tile
    for tile in range(LANES, length + 1, LANES)
    if length % tile == 0
    and block_bytes(tile, num_slots, num_queries, dim, itemsize, out_itemsize)
    <= BLOCK_VMEM_BYTES
  ]
  if fits:
    return max(fits)
  return LANES if length % LANES == 0 else length


def _logits_pass(
  nv, folded_QD, buf_ref, rms_ref, eps, logits_ref, dots_ref=None, r_ref=None
):
  """Writes the logits [Q, t] of each of the first `nv` slots (and its dots [Q, t]
  and inverse RMS [1, t] when asked) to VMEM scratch; returns their max over slots
  [Q, t]. Float32, tokens on lanes, channels on sublanes; a loop over the valid slots
  only (the others get weight zero: no work), one slot's temporaries live at a time."""
  num_slots, dim, tile = buf_ref.shape

  def slot(k, max_Qt):
    v_Dt = buf_ref[k].astype(jnp.float32)
    dots_Qt = jax.lax.dot(
      folded_QD, v_Dt, precision=_HIGHEST, preferred_element_type=jnp.float32
    )
    if rms_ref is None:
      r_1t = jax.lax.rsqrt(jnp.sum(v_Dt * v_Dt, axis=0, keepdims=True) / dim + eps)
    else:
      r_1t = rms_ref[k]
    logits_Qt = dots_Qt * r_1t
    logits_ref[k] = logits_Qt
    if dots_ref is not None:
      dots_ref[k], r_ref[k] = dots_Qt, r_1t
    return jnp.maximum(max_Qt, logits_Qt)

  init = jnp.full((folded_QD.shape[0], tile), -jnp.inf, jnp.float32)
  return jax.lax.fori_loop(0, nv, slot, init)


def _forward_kernel(nv_ref, folded_ref, buf_ref, *refs, num_queries, eps, has_rms):
  rms_ref = refs[0] if has_rms else None
  refs = refs[1:] if has_rms else refs
  max_ref, sum_ref, out_refs, logits_ref = refs[0], refs[1], refs[2:-1], refs[-1]
  num_slots, dim, tile = buf_ref.shape
  nv = jnp.minimum(nv_ref[0], num_slots)
  max_Qt = _logits_pass(nv, folded_ref[...], buf_ref, rms_ref, eps, logits_ref)

  def slot(k, carry):
    sum_Qt, outs = carry
    e_Qt = jnp.exp(logits_ref[k] - max_Qt)
    v_Dt = buf_ref[k].astype(jnp.float32)
    return sum_Qt + e_Qt, tuple(o + e_Qt[q : q + 1, :] * v_Dt for q, o in enumerate(outs))

  zeros = jnp.zeros((dim, tile), jnp.float32)
  sum_Qt, outs = jax.lax.fori_loop(
    0, nv, slot, (jnp.zeros_like(max_Qt), (zeros,) * num_queries)
  )
  max_ref[...] = max_Qt
  sum_ref[...] = sum_Qt
  for out_ref, out_Dt in zip(out_refs, outs):
    out_ref[...] = out_Dt.astype(out_ref.dtype)


def _rows(rows, height):
  """[height, t] from `height` rows [1, t] (sublane selects; no concatenation)."""
  shape = (height, rows[0].shape[1])
  index = jax.lax.broadcasted_iota(jnp.int32, shape, 0)
  out = jnp.zeros(shape, jnp.float32)
  for i, row in enumerate(rows):
    out = jnp.where(index == i, row, out)
  return out


def _backward_kernel(nv_ref, folded_ref, buf_ref, *refs, num_queries, eps, has_rms):
  rms_ref = refs[0] if has_rms else None
  refs = refs[1:] if has_rms else refs
  dsum_ref, dout_refs = refs[0], refs[1 : 1 + num_queries]
  dbuf_ref, *rest = refs[1 + num_queries :]
  drms_ref = rest.pop(0) if has_rms else None
  dfold_ref, logits_ref, dots_ref, r_ref = rest
  num_slots, dim, _ = buf_ref.shape
  folded_QD = folded_ref[...]
  nv = jnp.minimum(nv_ref[0], num_slots)
  max_Qt = _logits_pass(nv, folded_QD, buf_ref, rms_ref, eps, logits_ref, dots_ref, r_ref)
  dsum_Qt = dsum_ref[...]

  def slot(k, dfold_QD):
    v_Dt = buf_ref[k].astype(jnp.float32)
    dots_Qt, r_1t = dots_ref[k], r_ref[k]
    e_Qt = jnp.exp(logits_ref[k] - max_Qt)
    de_rows = [
      jnp.sum(ref[...].astype(jnp.float32) * v_Dt, axis=0, keepdims=True)
      for ref in dout_refs
    ]
    dl_Qt = e_Qt * (dsum_Qt + _rows(de_rows, num_queries))
    dlr_Qt = dl_Qt * r_1t
    dv_Dt = jax.lax.dot_general(
      folded_QD, dlr_Qt, _TN, precision=_HIGHEST, preferred_element_type=jnp.float32
    )
    for q, ref in enumerate(dout_refs):
      dv_Dt = dv_Dt + e_Qt[q : q + 1, :] * ref[...].astype(jnp.float32)
    dr_1t = jnp.sum(dl_Qt * dots_Qt, axis=0, keepdims=True)
    if has_rms:
      drms_ref[k] = dr_1t
    else:
      dv_Dt = dv_Dt - (r_1t * r_1t * r_1t * dr_1t / dim) * v_Dt
    dbuf_ref[k] = dv_Dt.astype(dbuf_ref.dtype)
    return dfold_QD + jax.lax.dot_general(
      dlr_Qt, v_Dt, _NT, precision=_HIGHEST, preferred_element_type=jnp.float32
    )

  dfold_ref[...] = jax.lax.fori_loop(0, nv, slot, jnp.zeros(folded_QD.shape, jnp.float32))

  def invalid_slot(k, carry):  # weight zero: no gradient
    dbuf_ref[k] = jnp.zeros(dbuf_ref.shape[1:], dbuf_ref.dtype)
    if has_rms:
      drms_ref[k] = jnp.zeros(drms_ref.shape[1:], jnp.float32)
    return carry

  jax.lax.fori_loop(nv, num_slots, invalid_slot, 0)


def _on_platform(make, *args):
  """`make(interpret)(*args)`: Mosaic on TPU, interpret mode elsewhere."""
  return jax.lax.platform_dependent(
    *args, tpu=lambda *a: make(False)(*a), default=lambda *a: make(True)(*a)
  )


def _launch(kernel, args, in_kinds, outs, scratch, *, out_itemsize, flops, io_bytes):
  """The pallas_call of `kernel` over a grid of (batch row, tile of T) on `args` (the
  scalar-prefetch num_valid, then operands whose BlockSpecs `in_kinds` name); `outs`:
  (kind, shape, dtype) per result; `scratch`: the leading dims of float32 VMEM scratch
  (the tile appended). Cost: `flops` and the BlockSpecs' HBM bytes `io_bytes`."""
  num_slots, batch, dim, length = args[2].shape
  num_queries = args[1].shape[0]
  isz = args[2].dtype.itemsize
  tile = choose_tile(length, num_slots, num_queries, dim, isz, out_itemsize)
  lanes = lambda b, t, nv: (b, 0, t)
  specs = dict(
    folded=pl.BlockSpec((num_queries, dim), lambda b, t, nv: (0, 0)),
    buf=pl.BlockSpec((num_slots, _SQ, dim, tile), lambda b, t, nv: (0, b, 0, t)),
    rms=pl.BlockSpec((_SQ, num_slots, 1, tile), lambda b, t, nv: (b, 0, 0, t)),
    stat=pl.BlockSpec((_SQ, num_queries, tile), lanes),
    out=pl.BlockSpec((_SQ, dim, tile), lanes),
    fold=pl.BlockSpec((_SQ, _SQ, num_queries, dim), lambda b, t, nv: (b, t, 0, 0)),
  )
  grid = (batch, length // tile)
  elements = batch * length * num_slots

  def make(interpret):
    return pl.pallas_call(
      kernel,
      out_shape=[jax.ShapeDtypeStruct(shape, dtype) for _, shape, dtype in outs],
      grid_spec=pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1,
        grid=grid,
        in_specs=[specs[kind] for kind in in_kinds],
        out_specs=[specs[kind] for kind, _, _ in outs],
        scratch_shapes=[pltpu.VMEM(rows + (tile,), jnp.float32) for rows in scratch],
      ),
      compiler_params=pltpu.CompilerParams(
        dimension_semantics=('parallel', 'parallel'),
        vmem_limit_bytes=TEMP_VMEM_BYTES
        + block_bytes(tile, num_slots, num_queries, dim, isz, out_itemsize),
      ),
      cost_estimate=pl.CostEstimate(
        flops=elements * dim * flops,
        transcendentals=elements * (num_queries + 1),
        bytes_accessed=io_bytes,
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


def _forward_device(nv, folded_QD, buf_KBTD, rms_KBT, *, eps, out_dtype, psum_axes=()):
  """Per device: (max [B, Q, T], sum [B, Q, T], the Q outputs [B, T, D])."""
  del psum_axes
  num_slots, batch, length, dim = buf_KBTD.shape
  num_queries, has_rms = folded_QD.shape[0], rms_KBT is not None
  osz = jnp.dtype(out_dtype).itemsize
  stat = ('stat', (batch, num_queries, length), jnp.float32)
  out = ('out', (batch, dim, length), out_dtype)
  max_BQT, sum_BQT, *outs = _launch(
    functools.partial(_forward_kernel, num_queries=num_queries, eps=eps, has_rms=has_rms),
    (nv, folded_QD, _lanes(buf_KBTD)) + ((_rms_lanes(rms_KBT),) if has_rms else ()),
    ['folded', 'buf'] + ['rms'] * has_rms,
    [stat, stat] + [out] * num_queries,
    [(num_slots, num_queries)],
    out_itemsize=osz,
    flops=4 * num_queries + 3,
    io_bytes=buf_KBTD.size * buf_KBTD.dtype.itemsize
    + batch * length * (num_queries * (dim * osz + 8) + 4 * num_slots * has_rms),
  )
  return max_BQT, sum_BQT, tuple(_lanes(o) for o in outs)


def _backward_device(
  nv, folded_QD, buf_KBTD, rms_KBT, dsum_BQT, douts, *, eps, psum_axes=()
):
  """Per device: (d buffer [K, B, T, D], d inverse RMS [K, B, T] or None, d folded
  [Q, D] summed over the devices)."""
  num_slots, batch, length, dim = buf_KBTD.shape
  num_queries, has_rms = folded_QD.shape[0], rms_KBT is not None
  osz = douts[0].dtype.itemsize
  tile = choose_tile(length, num_slots, num_queries, dim, buf_KBTD.dtype.itemsize, osz)
  outs = _launch(
    functools.partial(
      _backward_kernel, num_queries=num_queries, eps=eps, has_rms=has_rms
    ),
    (nv, folded_QD, _lanes(buf_KBTD))
    + ((_rms_lanes(rms_KBT),) if has_rms else ())
    + (dsum_BQT, *(_lanes(d) for d in douts)),
    ['folded', 'buf'] + ['rms'] * has_rms + ['stat'] + ['out'] * num_queries,
    [('buf', (num_slots, batch, dim, length), buf_KBTD.dtype)]
    + [('rms', (batch, num_slots, 1, length), jnp.float32)] * has_rms
    + [('fold', (batch, length // tile, num_queries, dim), jnp.float32)],
    [(num_slots, num_queries)] * 2 + [(num_slots, 1)],
    out_itemsize=osz,
    flops=12 * num_queries + 6,
    io_bytes=2 * buf_KBTD.size * buf_KBTD.dtype.itemsize
    + batch * length * (num_queries * (dim * osz + 4) + 8 * num_slots * has_rms),
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


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _phase1(buf_KBTD, folded_QD, nv, rms_KBT, eps, out_dtype):
  return _phase1_fwd(buf_KBTD, folded_QD, nv, rms_KBT, eps, out_dtype)[0]


def _phase1_fwd(buf_KBTD, folded_QD, nv, rms_KBT, eps, out_dtype):
  rms = None if rms_KBT is None else 'rms'
  fn = _sharded(
    functools.partial(_forward_device, eps=eps, out_dtype=out_dtype),
    buf_KBTD.shape,
    ('rep', 'rep', 'buf', rms),
    ('stat', 'stat', ('out',) * folded_QD.shape[0]),
  )
  out = fn(nv, folded_QD, buf_KBTD, rms_KBT)
  return out, (buf_KBTD, folded_QD, nv, rms_KBT)


def _phase1_bwd(eps, out_dtype, residuals, cotangents):
  del out_dtype
  buf_KBTD, folded_QD, nv, rms_KBT = residuals
  _, dsum_BQT, douts = cotangents  # the max is stop-gradient
  rms = None if rms_KBT is None else 'rms'
  fn = _sharded(
    functools.partial(_backward_device, eps=eps),
    buf_KBTD.shape,
    ('rep', 'rep', 'buf', rms, 'stat', ('out',) * len(douts)),
    ('buf', rms, 'rep'),
  )
  dbuf_KBTD, drms_KBT, dfold_QD = fn(
    nv, folded_QD, buf_KBTD, rms_KBT, dsum_BQT, tuple(douts)
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
  nv = jnp.asarray(num_slots if num_valid is None else num_valid, jnp.int32).reshape(1)
  folded_QD = queries_QD.astype(jnp.float32) * gains_QD.astype(jnp.float32)
  max_BQT, sum_BQT, outs = _phase1(
    buffer_KBTD, folded_QD, nv, inv_rms_KBT, float(eps), jnp.dtype(out_dtype)
  )
  max_BQT = jax.lax.stop_gradient(max_BQT)
  return tuple((max_BQT[:, q], sum_BQT[:, q], out) for q, out in enumerate(outs))
