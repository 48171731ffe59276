"""Dynamic HC's and mHC's read with its coefficients' projections as Pallas TPU
kernels and their VJP (`gated_read`): one read of the streams each way.

The XLA path reads the streams twice before the branch (the projections, then the
weighted sum) and, in the backward, three times more (the read's and the
projections' VJPs, then the sum of the streams' cotangents). The kernels
(`hyper_gated_read_kernels.py`) do the projections, the gates and h = sum_i a_i H_i
on one tile of tokens of every stream, and all of the backward on one read of the
streams and of dh. Also the layouts the model and the kernels exchange: the gate
(`read_gate`), the projection phi (`kernel_phi`) and the projections
(`normalised_projections`).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from attnres_jax.kernels import hyper_gated_read_kernels as kernels
from attnres_jax.kernels import hyper_tiles
from attnres_jax.kernels.hyper_tiles import F32
from attnres_jax.nn import sharding

# -- the layouts the model and the kernels exchange ------------------------------------


def read_gate(scale, base_M, num_out, per_stream):
  """The gate [2, R] of `gated_read` and `hyper_boundary.boundary`: the read
  weights' scale s (a scalar) and bases [m] at the read columns (`Columns`), zero
  elsewhere. HC: K = `num_out` projections per stream (`per_stream`); mHC: K over all
  streams."""
  cols = kernels.Columns(base_M.shape[0], num_out, per_stream)
  gate_2R = jnp.zeros((2, cols.num_rows), jnp.float32)
  values = jnp.stack([jnp.broadcast_to(scale, base_M.shape), base_M])
  return gate_2R.at[:, cols.read_columns].set(values)


def normalised_projections(coef_RBT, m, num_out, per_stream):
  """The normalised projections out of `gated_read`'s rows [R, B, T], laid out as
  `residuals/hyper/streams.normed_projection` gives them: HC [K, m, B, T], mHC
  [K, B, T]."""
  if per_stream:  # [m K, B, T] -> [K, m, B, T]
    normed = coef_RBT[: m * num_out].reshape(m, num_out, *coef_RBT.shape[1:])
    return jnp.swapaxes(normed, 0, 1)
  return coef_RBT[:num_out]


def kernel_phi(phi, m, dtype):
  """The projection as the kernels' [m, D, R] (`Columns`): HC's [D, K] copied into
  each stream's columns i K .. i K + K - 1, zero elsewhere; mHC's [m, D, K] as it
  is; zero in the inverse-RMS columns."""
  if phi.ndim == 3:  # mHC
    return jnp.pad(phi, ((0, 0), (0, 0), (0, 1))).astype(dtype)
  dim, num_out = phi.shape
  phi_MDR = jnp.einsum('ij,dk->idjk', jnp.eye(m, dtype=phi.dtype), phi)
  phi_MDR = phi_MDR.reshape(m, dim, m * num_out)
  return jnp.pad(phi_MDR, ((0, 0), (0, 0), (0, m))).astype(dtype)


def partial_shape(batch, length, m, num_rows, dim, per_stream):
  """phi's per-tile partial sums [B, T / t, P, R, D] as a function of the tile."""
  slices = 1 if per_stream else m
  return lambda tile: (batch, length // tile, slices, num_rows, dim)


def per_token_projection(phi):
  """(phi whole on every device, its number of projections K, whether per stream):
  HC's [D, K], mHC's [m, D, K]."""
  whole = sharding.constrain(phi, (None,) * phi.ndim)
  return whole, phi.shape[-1], phi.ndim == 2


def parameter_cotangents(dphi_partial, dread_BRT, coef_BRT, m, num_out, per_stream):
  """(phi's, the gate's [2, R]) from the backward kernel's per-tile partial sums
  [B, T / t, P, R, D] and the read gates' pre-activation cotangents [B, R, T]."""
  dphi_PRD = jnp.sum(dphi_partial, axis=(0, 1))
  if per_stream:
    # Row c belongs to stream c // K's copy of phi's column c % K: [D, K].
    dphi = jnp.sum(dphi_PRD[0, : m * num_out].reshape(m, num_out, -1), axis=0).T
  else:  # [m, D, K]
    dphi = jnp.swapaxes(dphi_PRD[:, :num_out], 1, 2)
  # gate: row 0 (s) gets sum dz act(n), row 1 (base) sum dz, at the read columns.
  act_BRT = jnp.tanh(coef_BRT) if per_stream else coef_BRT
  d_gate_2R = jnp.stack(
    [jnp.sum(dread_BRT * act_BRT, axis=(0, 2)), jnp.sum(dread_BRT, axis=(0, 2))]
  )
  return dphi, d_gate_2R


# -- the launches, per device -----------------------------------------------------------


def _forward_device(phi_MDR, gate_2R, streams_MBTD, **options):
  m, batch, length, dim = streams_MBTD.shape
  num_rows = phi_MDR.shape[-1]
  tokens, size = batch * length, streams_MBTD.dtype.itemsize
  cost = (
    tokens * m * dim * (2 * num_rows + 2 + 2),  # projections, squares, the read
    tokens * ((m + 1) * dim * size + num_rows * 4) + phi_MDR.size * size,
  )
  return hyper_tiles.launch(
    kernels.gated_read_kernel,
    (phi_MDR, gate_2R, streams_MBTD),
    ('whole', 'whole', 'streams'),
    [
      ('one', (batch, length, dim), streams_MBTD.dtype),
      ('coef', (batch, num_rows, length), F32),
    ],
    m,
    cost,
    **options,
  )


def _backward_device(
  phi_MDR, gate_2R, coef_BRT, dcoef_BRT, streams_MBTD, dh_BTD, dpassed_MBTD, **options
):
  m, batch, length, dim = streams_MBTD.shape
  num_rows = phi_MDR.shape[-1]
  tokens, size = batch * length, streams_MBTD.dtype.itemsize
  partial = partial_shape(batch, length, m, num_rows, dim, options['per_stream'])
  cost = lambda tile: (
    # da, the projections' two dots, the streams' cotangent sums
    tokens * m * dim * (2 + 4 * num_rows + 6),
    tokens * ((3 * m + 1) * dim * size + 3 * num_rows * 4)
    + phi_MDR.size * size
    + math.prod(partial(tile)[1:]) * batch * 4,
  )
  return hyper_tiles.launch(
    kernels.gated_read_backward_kernel,
    (phi_MDR, gate_2R, coef_BRT, dcoef_BRT, streams_MBTD, dh_BTD, dpassed_MBTD),
    ('whole', 'whole', 'coef', 'coef', 'streams', 'one', 'streams'),
    [
      ('streams', streams_MBTD.shape, streams_MBTD.dtype),
      ('coef', coef_BRT.shape, F32),
      ('partial', partial, F32),
    ],
    m,
    cost,
    **options,
  )


# -- the custom VJP ---------------------------------------------------------------------


def gated_read(phi, gate_2R, streams_MBTD, eps):
  """Dynamic HC's or mHC's read with its coefficients' projections, from one read of
  the streams: (h [B, T, D] in the streams' dtype, [R, B, T] float32: the normalised
  projections n and the inverse RMS (`Columns`), the streams passed through), where
  n equals `streams.normed_projection(phi, streams, eps, per_stream)` (HC: phi
  [D, K], per_stream; mHC: phi [m, D, K]) and h = sum_i a_i H_i with HC's
  a_i = gate[1, c] + gate[0, c] tanh(n_c), mHC's a_i = sigmoid(gate[1, c] +
  gate[0, c] n_c) at stream i's read column c. phi whole on every device (as
  there). T a multiple of 128 (`LANES`).
  The write reads the passed-through streams: its cotangent of them then reaches the
  backward kernel, which adds it to the read's and the projections' in the same
  pass (as separate cotangents, autodiff summed the three in another pass over
  3 m streams)."""
  phi, num_out, per_stream = per_token_projection(phi)
  return _gated_read(phi, gate_2R, streams_MBTD, eps, num_out, per_stream)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _gated_read(phi, gate_2R, streams_MBTD, eps, num_out, per_stream):
  return _gated_read_fwd(phi, gate_2R, streams_MBTD, eps, num_out, per_stream)[0]


def _gated_read_fwd(phi, gate_2R, streams_MBTD, eps, num_out, per_stream):
  options = dict(num_out=num_out, per_stream=per_stream)
  fn = hyper_tiles.per_device(
    functools.partial(_forward_device, eps=eps, **options),
    streams_MBTD.shape,
    ('whole', 'whole', 'streams'),
    ('one', 'coef'),
  )
  m = streams_MBTD.shape[0]
  h_BTD, coef_BRT = fn(kernel_phi(phi, m, streams_MBTD.dtype), gate_2R, streams_MBTD)
  out = (h_BTD, jnp.swapaxes(coef_BRT, 0, 1), streams_MBTD)
  return out, (phi, gate_2R, streams_MBTD, coef_BRT)


def _gated_read_bwd(eps, num_out, per_stream, saved, cotangents):
  del eps  # enters through the saved inverse RMS
  phi, gate_2R, streams_MBTD, coef_BRT = saved
  dh_BTD, dcoef_RBT, dpassed_MBTD = cotangents
  m, dtype = streams_MBTD.shape[0], streams_MBTD.dtype
  options = dict(num_out=num_out, per_stream=per_stream)
  fn = hyper_tiles.per_device(
    functools.partial(_backward_device, **options),
    streams_MBTD.shape,
    ('whole', 'whole', 'coef', 'coef', 'streams', 'one', 'streams'),
    ('streams', 'coef', 'partial'),
  )
  dstreams_MBTD, dread_BRT, dphi_partial = fn(
    kernel_phi(phi, m, dtype),
    gate_2R,
    coef_BRT,
    jnp.swapaxes(dcoef_RBT, 0, 1).astype(F32),
    streams_MBTD,
    dh_BTD.astype(dtype),
    dpassed_MBTD.astype(dtype),
  )
  dphi, d_gate_2R = parameter_cotangents(
    dphi_partial, dread_BRT, coef_BRT, m, num_out, per_stream
  )
  return dphi.astype(phi.dtype), d_gate_2R, dstreams_MBTD


_gated_read.defvjp(_gated_read_fwd, _gated_read_bwd)
