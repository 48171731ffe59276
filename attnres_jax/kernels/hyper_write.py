"""HC/mHC's stream write as a Pallas TPU kernel and its VJP, the same function as
`residuals/hyper/streams.write`:

    H'_j = sum_i R_ij H_i + b_j f(h)

  forward:   the m streams and f(h) in, the m new streams out (storage dtype), the
             float32 accumulation inside the kernel;
  backward:  the streams' cotangents dH_i = sum_j R_ij dH'_j, f(h)'s
             df(h) = sum_j b_j dH'_j and the m^2 + m per-token weight cotangents
             dR_ij = <H_i, dH'_j>, db_j = <f(h), dH'_j> in one pass over the tiles:
             each stream and cotangent read once, no float32 copy of either in memory.

The per-token weights travel as one [B, m^2 + m, T] float32 array (`coefficients`);
tiling and layout: `hyper_tiles.py`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from attnres_jax.kernels import hyper_tiles
from attnres_jax.kernels.hyper_tiles import F32
from attnres_jax.kernels.hyper_tiles import column

# -- the values of one tile, float32 [t, D] each ------------------------------------


def write_values(coef_tK, h_tD, out_tD, m):
  """The new streams (float32 [t, D] each) from the streams and f(h) (float32),
  the sums in the XLA version's order."""
  new_tD = []
  for j in range(m):
    acc_tD = column(coef_tK, j) * h_tD[0]
    for i in range(1, m):
      acc_tD = acc_tD + column(coef_tK, i * m + j) * h_tD[i]
    new_tD.append(acc_tD + column(coef_tK, m * m + j) * out_tD)
  return new_tD


def write_backward_values(coef_tK, h_tD, out_tD, dnew_tD, m):
  """(the streams' cotangents, f(h)'s, the weights' [t, K]), float32, from the
  streams, f(h) and the new streams' cotangents (float32)."""
  lane_tK = jax.lax.broadcasted_iota(jnp.int32, coef_tK.shape, 1)
  dcoef_tK = jnp.zeros(coef_tK.shape, F32)

  def put(dcoef_tK, k, x_tD, y_tD):
    dot_t1 = jnp.sum(x_tD * y_tD, axis=1, keepdims=True)
    return jnp.where(lane_tK == k, dot_t1, dcoef_tK)

  dout_tD = None
  for j in range(m):
    term = column(coef_tK, m * m + j) * dnew_tD[j]
    dout_tD = term if dout_tD is None else dout_tD + term
    dcoef_tK = put(dcoef_tK, m * m + j, dnew_tD[j], out_tD)
  dh_tD = []
  for i in range(m):
    acc_tD = None
    for j in range(m):
      term = column(coef_tK, i * m + j) * dnew_tD[j]
      acc_tD = term if acc_tD is None else acc_tD + term
      dcoef_tK = put(dcoef_tK, i * m + j, h_tD[i], dnew_tD[j])
    dh_tD.append(acc_tD)
  return dh_tD, dout_tD, dcoef_tK


# -- the kernels: one program = one tile of tokens of every stream ------------------


def forward_kernel(coef_ref, streams_ref, out_ref, new_ref, *, m):
  """coef [K, t] (K = m^2 + m rows, R_ij at i m + j, then b_j; tokens on the lanes),
  streams [m, t, D], f(h) [t, D] -> new streams [m, t, D]."""
  coef_tK = hyper_tiles.tokens_major(coef_ref[...])
  h_tD = [streams_ref[i].astype(F32) for i in range(m)]
  new_tD = write_values(coef_tK, h_tD, out_ref[...].astype(F32), m)
  for j in range(m):
    new_ref[j] = new_tD[j].astype(new_ref.dtype)


def backward_kernel(
  coef_ref, streams_ref, out_ref, dnew_ref, dstreams_ref, dout_ref, dcoef_ref, *, m
):
  """coef [K, t], streams [m, t, D], f(h) [t, D], the new streams' cotangents
  [m, t, D] -> the streams' cotangents [m, t, D], f(h)'s [t, D] and the weights'
  [K, t] (float32; per token a reduction over the lanes)."""
  coef_tK = hyper_tiles.tokens_major(coef_ref[...])
  h_tD = [streams_ref[i].astype(F32) for i in range(m)]
  dnew_tD = [dnew_ref[j].astype(F32) for j in range(m)]
  dh_tD, dout_tD, dcoef_tK = write_backward_values(
    coef_tK, h_tD, out_ref[...].astype(F32), dnew_tD, m
  )
  dout_ref[...] = dout_tD.astype(dout_ref.dtype)
  for i in range(m):
    dstreams_ref[i] = dh_tD[i].astype(dstreams_ref.dtype)
  dcoef_ref[...] = hyper_tiles.tokens_minor(dcoef_tK)


# -- the launches, per device -----------------------------------------------------------


def _forward_device(coef_BKT, streams_MBTD, out_BTD):
  m, batch, length, dim = streams_MBTD.shape
  tokens, size = batch * length, streams_MBTD.dtype.itemsize
  cost = (
    tokens * dim * 2 * m * (m + 1),  # m + 1 multiply-adds per output element
    tokens * (dim * (2 * m + 1) * size + coef_BKT.shape[1] * 4),
  )
  (new_MBTD,) = hyper_tiles.launch(
    forward_kernel,
    (coef_BKT, streams_MBTD, out_BTD),
    ('coef', 'streams', 'one'),
    [('streams', streams_MBTD.shape, streams_MBTD.dtype)],
    m,
    cost,
  )
  return new_MBTD


def _backward_device(coef_BKT, streams_MBTD, out_BTD, dnew_MBTD):
  m, batch, length, dim = streams_MBTD.shape
  tokens, size = batch * length, streams_MBTD.dtype.itemsize
  num_coef = coef_BKT.shape[1]
  cost = (
    # the m + 1 cotangents' multiply-adds and the m^2 + m dots, per element
    tokens * dim * 2 * (m * (m + 1) + num_coef),
    tokens * (dim * (3 * m + 2) * size + 2 * num_coef * 4),
  )
  return hyper_tiles.launch(
    backward_kernel,
    (coef_BKT, streams_MBTD, out_BTD, dnew_MBTD),
    ('coef', 'streams', 'one', 'streams'),
    [
      ('streams', streams_MBTD.shape, streams_MBTD.dtype),
      ('one', out_BTD.shape, out_BTD.dtype),
      ('coef', coef_BKT.shape, F32),
    ],
    m,
    cost,
  )


# -- the custom VJP ---------------------------------------------------------------------


def coefficients(mix_MMBT, write_MBT):
  """[B, m^2 + m, T] float32 (tokens minor, as the model computes them): R_ij at
  row i m + j, then b_j."""
  m = write_MBT.shape[0]
  flat_KBT = jnp.concatenate([mix_MMBT.reshape(m * m, *write_MBT.shape[1:]), write_MBT])
  return jnp.swapaxes(flat_KBT.astype(F32), 0, 1)


@jax.custom_vjp
def write(mix_MMBT, write_MBT, streams_MBTD, out_BTD):
  """`residuals/hyper/streams.write` by the Pallas kernels: the new streams
  [m, B, T, D] in the streams' dtype; mix[i, j]: from stream i to stream j. The
  per-token weights are float32 (as `Coefficients` holds them), and so are their
  cotangents."""
  return _write_fwd(mix_MMBT, write_MBT, streams_MBTD, out_BTD)[0]


def _write_fwd(mix_MMBT, write_MBT, streams_MBTD, out_BTD):
  coef_BKT = coefficients(mix_MMBT, write_MBT)
  fn = hyper_tiles.per_device(
    _forward_device, streams_MBTD.shape, ('coef', 'streams', 'one'), 'streams'
  )
  new_MBTD = fn(coef_BKT, streams_MBTD, out_BTD)
  return new_MBTD, (coef_BKT, streams_MBTD, out_BTD)


def _write_bwd(saved, dnew_MBTD):
  coef_BKT, streams_MBTD, out_BTD = saved
  m = streams_MBTD.shape[0]
  fn = hyper_tiles.per_device(
    _backward_device,
    streams_MBTD.shape,
    ('coef', 'streams', 'one', 'streams'),
    ('streams', 'one', 'coef'),
  )
  dstreams_MBTD, dout_BTD, dcoef_BKT = fn(
    coef_BKT, streams_MBTD, out_BTD, dnew_MBTD.astype(streams_MBTD.dtype)
  )
  dcoef_KBT = jnp.swapaxes(dcoef_BKT, 0, 1)
  d_mix = dcoef_KBT[: m * m].reshape(m, m, *dcoef_KBT.shape[1:])
  return d_mix, dcoef_KBT[m * m :], dstreams_MBTD, dout_BTD


write.defvjp(_write_fwd, _write_bwd)
