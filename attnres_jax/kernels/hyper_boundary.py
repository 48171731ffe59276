"""One sublayer's stream write and the next one's gated read, fused in one Pallas TPU
kernel each way (`boundary`).

Between two sublayers the streams are written (`hyper_write.write`) and at once read
back whole by the next sublayer's gated read (`hyper_gated_read.gated_read`). Fused, a
tile of the new streams is read with its projections while it is still on chip:
forward, the streams before the write and f(h) in, the new streams, the next h and
its projections out (2m + 2 stream-sized passes for the 3m + 2 of the two kernels
apart); backward, the new streams are recomputed from the same inputs instead of
read, and their cotangent goes from the gated read's backward to the write's on chip
(3m + 3 passes for 6m + 3).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from attnres_jax.kernels import hyper_gated_read
from attnres_jax.kernels import hyper_gated_read_kernels as read_kernels
from attnres_jax.kernels import hyper_tiles
from attnres_jax.kernels import hyper_write
from attnres_jax.kernels.hyper_tiles import F32

# -- the kernels -----------------------------------------------------------------------


def boundary_kernel(
  phi_ref, gate_ref, wcoef_ref, streams_ref, out_ref, new_ref, h_ref, coef_ref, **options
):
  """One sublayer's write and the next one's gated read: the write's weights
  [K_w, t], the streams before it [m, t, D] and f(h) [t, D] -> the new streams
  [m, t, D] (as stored), the next read's h [t, D] and its projections [R, t] (from
  the new streams as stored, exactly as the two kernels apart)."""
  m = options['m']
  wcoef_tK = hyper_tiles.tokens_major(wcoef_ref[...])
  h_tD = [streams_ref[i].astype(F32) for i in range(m)]
  new_tD = hyper_write.write_values(wcoef_tK, h_tD, out_ref[...].astype(F32), m)
  stored_tD = [x.astype(new_ref.dtype) for x in new_tD]
  for j in range(m):
    new_ref[j] = stored_tD[j]
  read_kernels.gated_read_into(phi_ref, gate_ref, stored_tD, h_ref, coef_ref, **options)


def boundary_backward_kernel(
  phi_ref,
  gate_ref,
  coef_ref,
  dcoef_ref,
  wcoef_ref,
  streams_ref,
  out_ref,
  dh_ref,
  dnew_ref,
  dstreams_ref,
  dout_ref,
  dwcoef_ref,
  dread_ref,
  dphi_ref,
  **options,
):
  """The backward of `boundary_kernel`: the new streams recomputed from the streams
  and f(h) (not read), the gated read's backward on them (with the new streams'
  cotangent as the passed-through one), its streams' cotangent rounded to the
  storage dtype as the two kernels apart store it, then the write's backward ->
  the streams' cotangents [m, t, D], f(h)'s [t, D], the write weights' [K_w, t], the
  read gates' [R, t] and this tile's share of phi's [P, R, D]."""
  m = options['m']
  dtype = streams_ref.dtype
  wcoef_tK = hyper_tiles.tokens_major(wcoef_ref[...])
  h_tD = [streams_ref[i].astype(F32) for i in range(m)]
  out_tD = out_ref[...].astype(F32)
  new_tD = hyper_write.write_values(wcoef_tK, h_tD, out_tD, m)
  stored_tD = [x.astype(dtype) for x in new_tD]
  dnew_tD, dread_tR, dphi_PRD = read_kernels.gated_read_backward_from(
    phi_ref,
    gate_ref,
    coef_ref,
    dcoef_ref,
    stored_tD,
    dh_ref,
    [dnew_ref[j].astype(F32) for j in range(m)],
    **options,
  )
  dnew_tD = [x.astype(dtype).astype(F32) for x in dnew_tD]
  dh_tD, dout_tD, dwcoef_tK = hyper_write.write_backward_values(
    wcoef_tK, h_tD, out_tD, dnew_tD, m
  )
  for i in range(m):
    dstreams_ref[i] = dh_tD[i].astype(dstreams_ref.dtype)
  dout_ref[...] = dout_tD.astype(dout_ref.dtype)
  dwcoef_ref[...] = hyper_tiles.tokens_minor(dwcoef_tK)
  dread_ref[...] = hyper_tiles.tokens_minor(dread_tR)
  dphi_ref[...] = dphi_PRD


# -- the launches, per device -----------------------------------------------------------


def _forward_device(phi_MDR, gate_2R, wcoef_BKT, streams_MBTD, out_BTD, **options):
  m, batch, length, dim = streams_MBTD.shape
  num_rows, num_weights = phi_MDR.shape[-1], wcoef_BKT.shape[1]
  tokens, size = batch * length, streams_MBTD.dtype.itemsize
  cost = (
    # the write's multiply-adds, the projections, the squares and the read
    tokens * dim * (2 * m * (m + 1) + m * (2 * num_rows + 4)),
    tokens * ((2 * m + 2) * dim * size + (num_weights + num_rows) * 4)
    + phi_MDR.size * size,
  )
  return hyper_tiles.launch(
    boundary_kernel,
    (phi_MDR, gate_2R, wcoef_BKT, streams_MBTD, out_BTD),
    ('whole', 'whole', 'coef', 'streams', 'one'),
    [
      ('streams', streams_MBTD.shape, streams_MBTD.dtype),
      ('one', out_BTD.shape, streams_MBTD.dtype),
      ('coef', (batch, num_rows, length), F32),
    ],
    m,
    cost,
    footprint=(2 * m + 2, 3 * m + 2),
    **options,
  )


def _backward_device(*args, **options):
  """args: phi [m, D, R], gate, the read's rows and their cotangent, the write's
  weights, the streams, f(h), dh and the new streams' cotangent."""
  phi_MDR, _, coef_BRT, _, wcoef_BKT, streams_MBTD, out_BTD, _, _ = args
  m, batch, length, dim = streams_MBTD.shape
  num_rows, num_weights = phi_MDR.shape[-1], wcoef_BKT.shape[1]
  tokens, size = batch * length, streams_MBTD.dtype.itemsize
  partial = hyper_gated_read.partial_shape(
    batch, length, m, num_rows, dim, options['per_stream']
  )
  cost = lambda tile: (
    # the write recomputed and its backward, the gated read's backward
    tokens * dim * (4 * m * (m + 1) + 2 * num_weights + m * (4 * num_rows + 8)),
    tokens * ((3 * m + 3) * dim * size + (2 * num_weights + 3 * num_rows) * 4)
    + phi_MDR.size * size
    + math.prod(partial(tile)[1:]) * batch * 4,
  )
  return hyper_tiles.launch(
    boundary_backward_kernel,
    args,
    ('whole', 'whole', 'coef', 'coef', 'coef', 'streams', 'one', 'one', 'streams'),
    [
      ('streams', streams_MBTD.shape, streams_MBTD.dtype),
      ('one', out_BTD.shape, out_BTD.dtype),
      ('coef', wcoef_BKT.shape, F32),
      ('coef', coef_BRT.shape, F32),
      ('partial', partial, F32),
    ],
    m,
    cost,
    footprint=(3 * m + 3, 5 * m + 3),
    **options,
  )


# -- the custom VJP ---------------------------------------------------------------------


def boundary(mix_MMBT, write_MBT, streams_MBTD, out_BTD, phi, gate_2R, eps):
  """`write(mix, write, streams, f(h))` and then `gated_read(phi, gate, new streams,
  eps)` in one kernel each way: (h [B, T, D] of the next read, its projections
  [R, B, T], the new streams [m, B, T, D]), the same values as the two apart. T a
  multiple of 128."""
  phi, num_out, per_stream = hyper_gated_read.per_token_projection(phi)
  wcoef_BKT = hyper_write.coefficients(mix_MMBT, write_MBT)
  return _boundary(
    wcoef_BKT, streams_MBTD, out_BTD, phi, gate_2R, eps, num_out, per_stream
  )


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def _boundary(wcoef_BKT, streams_MBTD, out_BTD, phi, gate_2R, eps, num_out, per_stream):
  args = (wcoef_BKT, streams_MBTD, out_BTD, phi, gate_2R)
  return _boundary_fwd(*args, eps, num_out, per_stream)[0]


def _boundary_fwd(
  wcoef_BKT, streams_MBTD, out_BTD, phi, gate_2R, eps, num_out, per_stream
):
  m = streams_MBTD.shape[0]
  fn = hyper_tiles.per_device(
    functools.partial(_forward_device, num_out=num_out, per_stream=per_stream, eps=eps),
    streams_MBTD.shape,
    ('whole', 'whole', 'coef', 'streams', 'one'),
    ('streams', 'one', 'coef'),
  )
  out_BTD = out_BTD.astype(streams_MBTD.dtype)
  phi_MDR = hyper_gated_read.kernel_phi(phi, m, streams_MBTD.dtype)
  new_MBTD, h_BTD, coef_BRT = fn(phi_MDR, gate_2R, wcoef_BKT, streams_MBTD, out_BTD)
  saved = (wcoef_BKT, streams_MBTD, out_BTD, phi, gate_2R, coef_BRT)
  return (h_BTD, jnp.swapaxes(coef_BRT, 0, 1), new_MBTD), saved


def _boundary_bwd(eps, num_out, per_stream, saved, cotangents):
  del eps  # enters through the saved inverse RMS
  wcoef_BKT, streams_MBTD, out_BTD, phi, gate_2R, coef_BRT = saved
  dh_BTD, dcoef_RBT, dnew_MBTD = cotangents
  m, dtype = streams_MBTD.shape[0], streams_MBTD.dtype
  fn = hyper_tiles.per_device(
    functools.partial(_backward_device, num_out=num_out, per_stream=per_stream),
    streams_MBTD.shape,
    ('whole', 'whole', 'coef', 'coef', 'coef', 'streams', 'one', 'one', 'streams'),
    ('streams', 'one', 'coef', 'coef', 'partial'),
  )
  dstreams_MBTD, dout_BTD, dwcoef_BKT, dread_BRT, dphi_partial = fn(
    hyper_gated_read.kernel_phi(phi, m, dtype),
    gate_2R,
    coef_BRT,
    jnp.swapaxes(dcoef_RBT, 0, 1).astype(F32),
    wcoef_BKT,
    streams_MBTD,
    out_BTD,
    dh_BTD.astype(dtype),
    dnew_MBTD.astype(dtype),
  )
  dphi, d_gate_2R = hyper_gated_read.parameter_cotangents(
    dphi_partial, dread_BRT, coef_BRT, m, num_out, per_stream
  )
  return dwcoef_BKT, dstreams_MBTD, dout_BTD, dphi.astype(phi.dtype), d_gate_2R


_boundary.defvjp(_boundary_fwd, _boundary_bwd)
