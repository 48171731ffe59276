"""AttnRes Phase 1 as a Pallas TPU kernel and its VJP (`model.depth_kernel='pallas'`).

Same contract as `depth.phase1`: Q queries (gains folded in) against the first
`num_valid` slots of the depth buffer [K, B, T, D], returning per query the max logit
and the sum of exponentials ([B, T], float32; the max stop-gradient) and the
unnormalised output [B, T, D] in `out_dtype`.

The kernels. The buffer is seen as [K, N, D] (N = B T tokens of this device) and the
grid runs over token tiles of `tile` tokens (independent: 'parallel', so the two
TensorCores of a megacore chip split them). Each program DMAs its [K, tile, D] block
of the buffer into VMEM once and, slot by slot in float32,

  forward:   dot_qk = v_k . f_q (the MXU, f_q = w_q * g_q), r_k = 1 / RMS(v_k) (or the
             carried r), l_qk = dot_qk r_k (-inf for k >= num_valid, a scalar-prefetch
             operand), m_q = max_k l_qk, e_qk = exp(l_qk - m_q), s_q = sum_k e_qk,
             o_q = sum_k e_qk v_k (each of the Q outputs its own [N, D] result);
  backward:  the logits recomputed as above, then
             de_qk = <do_q, v_k> + ds_q,  dl_qk = e_qk de_qk,
             dv_k  = sum_q e_qk do_q + r_k sum_q dl_qk f_q - (r_k^3 / D) dr_k v_k
                     with dr_k = sum_q dl_qk dot_qk (the last term only when r is
                     recomputed; a carried r gets dr as its cotangent instead),
             df_q  = sum_{k, tokens} dl_qk r_k v_k (per-tile partials, summed outside).

HBM traffic from the BlockSpecs, per device: forward reads the buffer once (K N D
elements) and writes Q N D outputs plus 2 Q N float32 statistics; backward reads the
buffer and the Q output cotangents once and writes the buffer's cotangent once (K N
D). Invalid slots (k >= num_valid) are still read (the block holds all K).

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

# VMEM for one program's double-buffered blocks (the tile is the largest that fits),
# and the scoped VMEM limit asked of Mosaic (room for the float32 temporaries).
BLOCK_VMEM_BYTES = 12 * 2**20
VMEM_LIMIT_BYTES = 48 * 2**20
MAX_TILE = 512
_NT = (((1,), (1,)), ((), ()))  # a . b^T
_TN = (((0,), (0,)), ((), ()))  # a^T . b
_HIGHEST = jax.lax.Precision.HIGHEST


def choose_tile(num_tokens, num_slots, num_queries, dim, itemsize, out_itemsize):
  """Tokens per program: the largest divisor of `num_tokens` (a multiple of 16, or all
  of them) whose double-buffered backward blocks (buffer in, its cotangent out, the Q
  output cotangents in) fit BLOCK_VMEM_BYTES."""
  per_token = 2 * dim * (2 * num_slots * itemsize + num_queries * out_itemsize)
  limit = max(16, min(MAX_TILE, BLOCK_VMEM_BYTES // per_token))
  if num_tokens <= limit:
    return num_tokens
  for tile in range(limit - limit % 16, 0, -16):
    if num_tokens % tile == 0:
      return tile
  return num_tokens  # no multiple of 16 divides it: one block (tiny shapes only)


def _logits(nv, folded_QD, buf_ref, rms_ref, num_slots, dim, eps):
  """Per slot: (values [t, D], dots [t, Q], inverse RMS [t, 1], masked logits [t, Q])
  float32, and the running max [t, Q]."""
  slots, max_tQ = [], None
  for k in range(num_slots):
    v_tD = buf_ref[k].astype(jnp.float32)
    dots_tQ = jax.lax.dot_general(
      v_tD, folded_QD, _NT, precision=_HIGHEST, preferred_element_type=jnp.float32
    )
    if rms_ref is None:
      r_t1 = jax.lax.rsqrt(jnp.sum(v_tD * v_tD, axis=1, keepdims=True) / dim + eps)
    else:
      r_t1 = rms_ref[:, k : k + 1]
    logits_tQ = jnp.where(k < nv, dots_tQ * r_t1, -jnp.inf)
    max_tQ = logits_tQ if max_tQ is None else jnp.maximum(max_tQ, logits_tQ)
    slots.append((dots_tQ, r_t1, logits_tQ))
  return slots, max_tQ


def _forward_kernel(nv_ref, folded_ref, buf_ref, *refs, num_queries, eps, has_rms):
  rms_ref = refs[0] if has_rms else None
  max_ref, sum_ref, *out_refs = refs[1:] if has_rms else refs
  num_slots, _, dim = buf_ref.shape
  slots, max_tQ = _logits(
    nv_ref[0], folded_ref[...], buf_ref, rms_ref, num_slots, dim, eps
  )
  exps = [jnp.exp(logits_tQ - max_tQ) for _, _, logits_tQ in slots]
  max_ref[...] = max_tQ
  sum_ref[...] = functools.reduce(jnp.add, exps)
  for q in range(num_queries):
    out_tD = None
    for k in range(num_slots):
      term = exps[k][:, q : q + 1] * buf_ref[k].astype(jnp.float32)
      out_tD = term if out_tD is None else out_tD + term
    out_refs[q][...] = out_tD.astype(out_refs[q].dtype)


def _columns(cols, width):
  """[t, width] from `width` columns [t, 1] (lane selects; no concatenation)."""
  lane = jax.lax.broadcasted_iota(jnp.int32, (cols[0].shape[0], width), 1)
  out = jnp.zeros((cols[0].shape[0], width), jnp.float32)
  for i, col in enumerate(cols):
    out = jnp.where(lane == i, col, out)
  return out


def _backward_kernel(nv_ref, folded_ref, buf_ref, *refs, num_queries, eps, has_rms):
  rms_ref = refs[0] if has_rms else None
  refs = refs[1:] if has_rms else refs
  dsum_ref, dout_refs = refs[0], refs[1 : 1 + num_queries]
  dbuf_ref, *rest = refs[1 + num_queries :]
  drms_ref, dfold_ref = rest if has_rms else (None, rest[0])
  num_slots, _, dim = buf_ref.shape
  folded_QD = folded_ref[...]
  slots, max_tQ = _logits(nv_ref[0], folded_QD, buf_ref, rms_ref, num_slots, dim, eps)
  dsum_tQ = dsum_ref[...]
  dfold_QD = jnp.zeros(folded_QD.shape, jnp.float32)
  drms_cols = []
  for k, (dots_tQ, r_t1, logits_tQ) in enumerate(slots):
    v_tD = buf_ref[k].astype(jnp.float32)
    e_tQ = jnp.exp(logits_tQ - max_tQ)
    douts = [ref[...].astype(jnp.float32) for ref in dout_refs]
    de_cols = [jnp.sum(d_tD * v_tD, axis=1, keepdims=True) for d_tD in douts]
    dl_tQ = e_tQ * (dsum_tQ + _columns(de_cols, num_queries))
    dlr_tQ = dl_tQ * r_t1
    dv_tD = jax.lax.dot(
      dlr_tQ, folded_QD, precision=_HIGHEST, preferred_element_type=jnp.float32
    )
    for q, d_tD in enumerate(douts):
      dv_tD = dv_tD + e_tQ[:, q : q + 1] * d_tD
    dfold_QD = dfold_QD + jax.lax.dot_general(
      dlr_tQ, v_tD, _TN, precision=_HIGHEST, preferred_element_type=jnp.float32
    )
    dr_t1 = jnp.sum(dl_tQ * dots_tQ, axis=1, keepdims=True)
    if has_rms:
      drms_cols.append(dr_t1)
    else:
      dv_tD = dv_tD - (r_t1 * r_t1 * r_t1 * dr_t1 / dim) * v_tD
    dbuf_ref[k] = dv_tD.astype(dbuf_ref.dtype)
  if has_rms:
    drms_ref[...] = _columns(drms_cols, num_slots)
  dfold_ref[0] = dfold_QD


def _call(kernel, interpret, *, grid, in_specs, out_specs, out_shape, cost):
  spec = pltpu.PrefetchScalarGridSpec(
    num_scalar_prefetch=1, grid=grid, in_specs=in_specs, out_specs=out_specs
  )
  return pl.pallas_call(
    kernel,
    out_shape=out_shape,
    grid_spec=spec,
    compiler_params=pltpu.CompilerParams(
      dimension_semantics=('parallel',), vmem_limit_bytes=VMEM_LIMIT_BYTES
    ),
    cost_estimate=cost,
    interpret=interpret,
  )


def _on_platform(make, *args):
  """`make(interpret)(*args)`: Mosaic on TPU, interpret mode elsewhere."""
  return jax.lax.platform_dependent(
    *args, tpu=lambda *a: make(False)(*a), default=lambda *a: make(True)(*a)
  )


def _forward_local(nv, folded_QD, buf_KND, rms_NK, *, eps, out_dtype):
  """Per device: (max [N, Q], sum [N, Q], Q outputs [N, D])."""
  num_slots, num_tokens, dim = buf_KND.shape
  num_queries = folded_QD.shape[0]
  isz, osz = buf_KND.dtype.itemsize, jnp.dtype(out_dtype).itemsize
  tile = choose_tile(num_tokens, num_slots, num_queries, dim, isz, osz)
  has_rms = rms_NK is not None
  row = lambda i, nv: (i, 0)
  in_specs = [
    pl.BlockSpec((num_queries, dim), lambda i, nv: (0, 0)),
    pl.BlockSpec((num_slots, tile, dim), lambda i, nv: (0, i, 0)),
  ] + ([pl.BlockSpec((tile, num_slots), row)] if has_rms else [])
  stat = jax.ShapeDtypeStruct((num_tokens, num_queries), jnp.float32)
  out = jax.ShapeDtypeStruct((num_tokens, dim), out_dtype)
  tokens = num_tokens * num_slots
  cost = pl.CostEstimate(
    flops=tokens * dim * (4 * num_queries + 3),
    transcendentals=tokens * (num_queries + 1),
    bytes_accessed=tokens * dim * isz
    + num_tokens * (num_queries * (dim * osz + 8) + 4 * num_slots * has_rms),
  )
  kernel = functools.partial(
    _forward_kernel, num_queries=num_queries, eps=eps, has_rms=has_rms
  )
  make = lambda interpret: _call(
    kernel,
    interpret,
    grid=(num_tokens // tile,),
    in_specs=in_specs,
    out_specs=[pl.BlockSpec((tile, num_queries), row)] * 2
    + [pl.BlockSpec((tile, dim), row)] * num_queries,
    out_shape=[stat, stat] + [out] * num_queries,
    cost=cost,
  )
  args = (nv, folded_QD, buf_KND) + ((rms_NK,) if has_rms else ())
  return _on_platform(make, *args)


def _backward_local(nv, folded_QD, buf_KND, rms_NK, dsum_NQ, douts, *, eps):
  """Per device: (d buffer [K, N, D], d inverse RMS [N, K] or None, d folded [Q, D])."""
  num_slots, num_tokens, dim = buf_KND.shape
  num_queries = folded_QD.shape[0]
  isz, osz = buf_KND.dtype.itemsize, douts[0].dtype.itemsize
  tile = choose_tile(num_tokens, num_slots, num_queries, dim, isz, osz)
  num_tiles, has_rms = num_tokens // tile, rms_NK is not None
  row = lambda i, nv: (i, 0)
  slab = pl.BlockSpec((num_slots, tile, dim), lambda i, nv: (0, i, 0))
  in_specs = (
    [pl.BlockSpec((num_queries, dim), lambda i, nv: (0, 0)), slab]
    + ([pl.BlockSpec((tile, num_slots), row)] if has_rms else [])
    + [pl.BlockSpec((tile, num_queries), row)]
    + [pl.BlockSpec((tile, dim), row)] * num_queries
  )
  out_specs = (
    [slab]
    + ([pl.BlockSpec((tile, num_slots), row)] if has_rms else [])
    + [pl.BlockSpec((1, num_queries, dim), lambda i, nv: (i, 0, 0))]
  )
  out_shape = (
    [jax.ShapeDtypeStruct(buf_KND.shape, buf_KND.dtype)]
    + ([jax.ShapeDtypeStruct((num_tokens, num_slots), jnp.float32)] if has_rms else [])
    + [jax.ShapeDtypeStruct((num_tiles, num_queries, dim), jnp.float32)]
  )
  tokens = num_tokens * num_slots
  cost = pl.CostEstimate(
    flops=tokens * dim * (12 * num_queries + 6),
    transcendentals=tokens * (num_queries + 1),
    bytes_accessed=2 * tokens * dim * isz
    + num_tokens * (num_queries * (dim * osz + 4) + 8 * num_slots * has_rms),
  )
  kernel = functools.partial(
    _backward_kernel, num_queries=num_queries, eps=eps, has_rms=has_rms
  )
  make = lambda interpret: _call(
    kernel,
    interpret,
    grid=(num_tiles,),
    in_specs=in_specs,
    out_specs=out_specs,
    out_shape=out_shape,
    cost=cost,
  )
  args = (nv, folded_QD, buf_KND) + ((rms_NK,) if has_rms else ()) + (dsum_NQ, *douts)
  outs = _on_platform(make, *args)
  drms_NK = outs[1] if has_rms else None
  return outs[0], drms_NK, jnp.sum(outs[-1], axis=0)


# -- the device split and the custom VJP ----------------------------------------------


def _device_specs(shape):
  """(mesh, buffer spec [K, B, T, D]) under the active sharding rules on several
  devices, else None. Refuses a buffer split over its slots or its width."""
  active = sharding._ACTIVE.get()
  if active is None or active[0].size == 1:
    return None
  mesh, rules = active
  spec = tuple(
    sharding.logical_to_spec(sharding.DEPTH_BUFFER, rules, mesh=mesh, shape=shape)
  )
  spec += (None,) * (4 - len(spec))
  if spec[0] is not None or spec[3] is not None:
    raise ValueError(
      f"depth_kernel='pallas' needs the depth buffer split over batch and length "
      f'only; the sharding rules split it as {P(*spec)} (slots, batch, length, '
      f"width) on mesh {dict(mesh.shape)}: map 'depth' and 'hidden' to no mesh axis "
      f"or use depth_kernel='xla'."
    )
  return mesh, spec


def _sharded(fn, shape, in_specs, out_specs):
  """`fn` per device under the active mesh (specs built from the buffer's batch and
  length split), or as is on one device."""
  found = _device_specs(shape)
  if found is None:
    return fn
  mesh, (_, b, t, _) = found
  spec = lambda kind: {
    'buf': P(None, b, t, None),
    'stat': P(None, b, t),
    'out': P(b, t, None),
    'rep': P(),
    None: None,
  }[kind]
  tokens_axes = tuple(
    a for axes in (b, t) if axes for a in ((axes,) if isinstance(axes, str) else axes)
  )

  def per_device(*args):
    return fn(*args, psum_axes=tokens_axes)

  return jax.shard_map(
    per_device,
    mesh=mesh,
    in_specs=jax.tree.map(spec, in_specs),
    out_specs=jax.tree.map(spec, out_specs),
    check_vma=False,
  )


def _forward_device(nv, folded_QD, buf_KBTD, rms_KBT, *, eps, out_dtype, psum_axes=()):
  del psum_axes
  num_slots, batch, length, dim = buf_KBTD.shape
  rms_NK = None if rms_KBT is None else rms_KBT.reshape(num_slots, -1).T
  max_NQ, sum_NQ, *outs = _forward_local(
    nv,
    folded_QD,
    buf_KBTD.reshape(num_slots, batch * length, dim),
    rms_NK,
    eps=eps,
    out_dtype=out_dtype,
  )
  stat = lambda x_NQ: x_NQ.T.reshape(-1, batch, length)
  return stat(max_NQ), stat(sum_NQ), tuple(o.reshape(batch, length, dim) for o in outs)


def _backward_device(
  nv, folded_QD, buf_KBTD, rms_KBT, dsum_QBT, douts, *, eps, psum_axes=()
):
  num_slots, batch, length, dim = buf_KBTD.shape
  rms_NK = None if rms_KBT is None else rms_KBT.reshape(num_slots, -1).T
  dbuf_KND, drms_NK, dfold_QD = _backward_local(
    nv,
    folded_QD,
    buf_KBTD.reshape(num_slots, batch * length, dim),
    rms_NK,
    dsum_QBT.reshape(dsum_QBT.shape[0], -1).T,
    [d.reshape(batch * length, dim) for d in douts],
    eps=eps,
  )
  if psum_axes:
    dfold_QD = jax.lax.psum(dfold_QD, psum_axes)
  drms_KBT = None if drms_NK is None else drms_NK.T.reshape(num_slots, batch, length)
  return dbuf_KND.reshape(buf_KBTD.shape), drms_KBT, dfold_QD


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _phase1(buf_KBTD, folded_QD, nv, rms_KBT, eps, out_dtype):
  return _phase1_fwd(buf_KBTD, folded_QD, nv, rms_KBT, eps, out_dtype)[0]


def _phase1_fwd(buf_KBTD, folded_QD, nv, rms_KBT, eps, out_dtype):
  num_queries = folded_QD.shape[0]
  fn = _sharded(
    functools.partial(_forward_device, eps=eps, out_dtype=out_dtype),
    buf_KBTD.shape,
    ('rep', 'rep', 'buf', None if rms_KBT is None else 'stat'),
    ('stat', 'stat', ('out',) * num_queries),
  )
  out = fn(nv, folded_QD, buf_KBTD, rms_KBT)
  return out, (buf_KBTD, folded_QD, nv, rms_KBT)


def _phase1_bwd(eps, out_dtype, residuals, cotangents):
  del out_dtype
  buf_KBTD, folded_QD, nv, rms_KBT = residuals
  _, dsum_QBT, douts = cotangents  # the max is stop-gradient
  fn = _sharded(
    functools.partial(_backward_device, eps=eps),
    buf_KBTD.shape,
    (
      'rep',
      'rep',
      'buf',
      None if rms_KBT is None else 'stat',
      'stat',
      ('out',) * len(douts),
    ),
    ('buf', None if rms_KBT is None else 'stat', 'rep'),
  )
  dbuf_KBTD, drms_KBT, dfold_QD = fn(
    nv, folded_QD, buf_KBTD, rms_KBT, dsum_QBT, tuple(douts)
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
  max_QBT, sum_QBT, outs = _phase1(
    buffer_KBTD, folded_QD, nv, inv_rms_KBT, float(eps), jnp.dtype(out_dtype)
  )
  max_QBT = jax.lax.stop_gradient(max_QBT)
  return tuple((max_QBT[q], sum_QBT[q], out) for q, out in enumerate(outs))
