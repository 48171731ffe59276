"""Inside the gated read's Pallas kernels (`hyper_gated_read.py`, and fused with the
write before it in `hyper_boundary.py`): one tile of tokens of every stream.

Dynamic HC's and mHC's read weights come from the streams themselves, through the
normalised projections n (`residuals/hyper/streams.normed_projection`): HC's a_i =
base_i + s tanh(n_i0) (each stream normalised on its own), mHC's a_i = sigmoid(base_i
+ s n_i) (the streams normalised together). Forward, a program computes the
projections, the gates and h = sum_i a_i H_i from one read of its tile; backward, the
read's, the projections' and the passed-through streams' cotangents from one more.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from attnres_jax.kernels.hyper_tiles import F32
from attnres_jax.kernels.hyper_tiles import NT
from attnres_jax.kernels.hyper_tiles import TN
from attnres_jax.kernels.hyper_tiles import column
from attnres_jax.kernels.hyper_tiles import tokens_major
from attnres_jax.kernels.hyper_tiles import tokens_minor


class Columns:
  """The columns of a [t, R] block of the normalised projections: HC (`per_stream`,
  K = m + 2 projections per stream) stream i's at i K .. i K + K - 1, its read gate
  first, then each stream's inverse RMS (R = m K + m); mHC (K = m^2 + 2m over all
  streams) the K projections, the m read gates first, then the inverse RMS of all the
  streams together (R = K + 1). A group is the columns one inverse RMS normalises.
  `gate` [2, R] holds s (row 0) and base_i (row 1) at the read columns, zero
  elsewhere."""

  def __init__(self, m, num_out, per_stream):
    self.m, self.num_out, self.per_stream = m, num_out, per_stream
    self.num_groups = m if per_stream else 1
    self.num_rows = m * num_out + m if per_stream else num_out + 1

  def read(self, i):
    return i * self.num_out if self.per_stream else i

  @property
  def read_columns(self):
    return (
      slice(0, self.m * self.num_out, self.num_out)
      if self.per_stream
      else slice(0, self.m)
    )

  def inv_rms(self, g):
    return self.m * self.num_out + g if self.per_stream else self.num_out

  def group_of(self, i):
    return i if self.per_stream else 0

  def groups(self, lane_tR):
    """Per group, where its projection columns are."""
    if not self.per_stream:
      return [lane_tR < self.num_out]
    k = self.num_out
    return [(lane_tR >= g * k) & (lane_tR < (g + 1) * k) for g in range(self.m)]

  def activation(self, normed_tR):
    """What the gate scales: HC tanh(n), mHC n itself."""
    return jnp.tanh(normed_tR) if self.per_stream else normed_tR


def _read_weights(gate, act_tR, per_stream):
  """The read weights at the read columns: HC base + s tanh(n), mHC sigmoid(base +
  s n), in the XLA path's order of operations."""
  z_tR = gate[1:2] + gate[0:1] * act_tR
  return z_tR if per_stream else jax.nn.sigmoid(z_tR)


# -- forward ---------------------------------------------------------------------------


def gated_read_values(phi_ref, gate, stored_tD, *, m, num_out, per_stream, eps):
  """(h float32 [t, D], the normalised projections and inverse RMS [t, R]) from the
  streams as stored ([t, D] each, the storage dtype: the dot's operands)."""
  cols = Columns(m, num_out, per_stream)
  dim = stored_tD[0].shape[-1]
  projected_tR, h_tD, squares_t1 = None, [], []
  for i in range(m):
    term_tR = jax.lax.dot_general(
      stored_tD[i], phi_ref[i], (((1,), (0,)), ((), ())), preferred_element_type=F32
    )
    projected_tR = term_tR if projected_tR is None else projected_tR + term_tR
    h_tD.append(stored_tD[i].astype(F32))
    squares_t1.append(jnp.sum(h_tD[i] * h_tD[i], axis=1, keepdims=True))
  if per_stream:
    inv_rms_t1 = [jax.lax.rsqrt(sq / dim + eps) for sq in squares_t1]
  else:
    total_t1 = functools.reduce(jnp.add, squares_t1)
    inv_rms_t1 = [jax.lax.rsqrt(total_t1 / (m * dim) + eps)]
  lane_tR = jax.lax.broadcasted_iota(jnp.int32, projected_tR.shape, 1)
  coef_tR = projected_tR
  for g, in_group in enumerate(cols.groups(lane_tR)):
    coef_tR = jnp.where(in_group, projected_tR * inv_rms_t1[g], coef_tR)
    coef_tR = jnp.where(lane_tR == cols.inv_rms(g), inv_rms_t1[g], coef_tR)
  read_tR = _read_weights(gate, cols.activation(coef_tR), per_stream)
  acc_tD = None
  for i in range(m):
    term_tD = column(read_tR, cols.read(i)) * h_tD[i]
    acc_tD = term_tD if acc_tD is None else acc_tD + term_tD
  return acc_tD, coef_tR


def gated_read_into(phi_ref, gate_ref, stored_tD, h_ref, coef_ref, **options):
  """`gated_read_values` of the streams as stored, into the results' blocks."""
  h_tD, coef_tR = gated_read_values(phi_ref, gate_ref[...], stored_tD, **options)
  h_ref[...] = h_tD.astype(h_ref.dtype)
  coef_ref[...] = tokens_minor(coef_tR)


# -- backward --------------------------------------------------------------------------


def _read_gate_cotangents(cols, lane_tR, read_tR, h_tD, dh_tD):
  """The read gates' pre-activation cotangents [t, R]: da_i = <H_i, dh> at the read
  columns; through mHC's sigmoid to its argument."""
  dz_tR = jnp.zeros(lane_tR.shape, F32)
  for i in range(cols.m):
    dot_t1 = jnp.sum(h_tD[i] * dh_tD, axis=1, keepdims=True)
    dz_tR = jnp.where(lane_tR == cols.read(i), dot_t1, dz_tR)
  if not cols.per_stream:
    dz_tR = dz_tR * read_tR * (1 - read_tR)
  return dz_tR


def _projection_cotangents(cols, groups, gate, coef_tR, dcoef_tR, act_tR, dz_tR, dim):
  """(the raw projections' cotangent [t, R] float32, per group the factor [t, 1] of
  its streams in their cotangent through the inverse RMS): the normalised
  projections' cotangent (through HC's tanh for the read gates), then the raw
  projections' (times the inverse RMS) and the inverse RMS' (sum dn P + its own)."""
  dact_tR = gate[0:1] * dz_tR
  if cols.per_stream:
    dact_tR = dact_tR * (1 - act_tR * act_tR)
  dnormed_tR = dcoef_tR + dact_tR
  inv_rms_t1 = [column(coef_tR, cols.inv_rms(g)) for g in range(cols.num_groups)]
  dprojected_tR = jnp.zeros(coef_tR.shape, F32)
  scale_t1 = []
  for g, in_group in enumerate(groups):
    dprojected_tR = jnp.where(in_group, dnormed_tR * inv_rms_t1[g], dprojected_tR)
    # P = n / r on the group's columns: d r = sum_k dn_k n_k / r (+ r's own).
    dn_p_tR = jnp.where(in_group, dnormed_tR * coef_tR, 0.0)
    d_inv_rms_t1 = jnp.sum(dn_p_tR, axis=1, keepdims=True) / inv_rms_t1[g]
    d_inv_rms_t1 = d_inv_rms_t1 + column(dcoef_tR, cols.inv_rms(g))
    # r = (s / n + eps)^(-1/2) over n features: dr/dH = -r^3 H / n.
    features = dim if cols.per_stream else cols.m * dim
    scale_t1.append(-d_inv_rms_t1 * inv_rms_t1[g] ** 3 / features)
  return dprojected_tR, scale_t1


def gated_read_backward_values(
  phi_ref,
  gate,
  coef_tR,
  dcoef_tR,
  stored_tD,
  dh_tD,
  dpassed_tD,
  *,
  m,
  num_out,
  per_stream,
):
  """(the streams' cotangents, float32 [t, D] each: the passed-through ones plus the
  read's and the projections'; the read gates' pre-activation cotangents [t, R] at
  the read columns; this tile's share of phi's, [P, R, D]: row c of slice p the sum
  over its tokens of column c's projection cotangent times stream p (HC, P = 1: the
  stream column c belongs to))."""
  cols = Columns(m, num_out, per_stream)
  dim = stored_tD[0].shape[-1]
  dtype = stored_tD[0].dtype
  lane_tR = jax.lax.broadcasted_iota(jnp.int32, coef_tR.shape, 1)
  groups = cols.groups(lane_tR)
  act_tR = cols.activation(coef_tR)
  read_tR = _read_weights(gate, act_tR, per_stream)
  h_tD = [x.astype(F32) for x in stored_tD]
  dz_tR = _read_gate_cotangents(cols, lane_tR, read_tR, h_tD, dh_tD)
  dprojected_tR, scale_t1 = _projection_cotangents(
    cols, groups, gate, coef_tR, dcoef_tR, act_tR, dz_tR, dim
  )
  dprojected_tR = dprojected_tR.astype(dtype)  # the dot's operands, as XLA's
  dphi_PRD, dstreams_tD = [], []
  for i in range(m):
    from_projection_tD = jax.lax.dot_general(
      dprojected_tR, phi_ref[i], NT, preferred_element_type=F32
    )
    dstreams_tD.append(
      dpassed_tD[i]
      + column(read_tR, cols.read(i)) * dh_tD
      + from_projection_tD
      + scale_t1[cols.group_of(i)] * h_tD[i]
    )
    mine_tR = (
      jnp.where(groups[i], dprojected_tR, jnp.zeros_like(dprojected_tR))
      if per_stream
      else dprojected_tR
    )
    term_RD = jax.lax.dot_general(mine_tR, stored_tD[i], TN, preferred_element_type=F32)
    if per_stream and dphi_PRD:
      dphi_PRD[0] = dphi_PRD[0] + term_RD
    else:
      dphi_PRD.append(term_RD)
  return dstreams_tD, dz_tR, jnp.stack(dphi_PRD)


def gated_read_backward_from(
  phi_ref, gate_ref, coef_ref, dcoef_ref, stored_tD, dh_ref, dpassed_tD, **options
):
  """`gated_read_backward_values` from the kernels' blocks (tokens-minor rows)."""
  return gated_read_backward_values(
    phi_ref,
    gate_ref[...],
    tokens_major(coef_ref[...]),
    tokens_major(dcoef_ref[...]),
    stored_tD,
    dh_ref[...].astype(F32),
    dpassed_tD,
    **options,
  )


# -- the kernels -----------------------------------------------------------------------


def gated_read_kernel(phi_ref, gate_ref, streams_ref, h_ref, coef_ref, **options):
  """phi [m, D, R] (`hyper_gated_read.kernel_phi`), gate [2, R], streams [m, t, D]
  -> h [t, D] and the normalised projections with the inverse RMS [R, t] (float32,
  tokens on the lanes)."""
  stored_tD = [streams_ref[i] for i in range(options['m'])]
  gated_read_into(phi_ref, gate_ref, stored_tD, h_ref, coef_ref, **options)


def gated_read_backward_kernel(
  phi_ref,
  gate_ref,
  coef_ref,
  dcoef_ref,
  streams_ref,
  dh_ref,
  dpassed_ref,
  dstreams_ref,
  dread_ref,
  dphi_ref,
  **options,
):
  """coef and its cotangent [R, t], the streams [m, t, D], dh [t, D] and the
  passed-through streams' cotangents [m, t, D] -> the streams' cotangents [m, t, D],
  the read gates' [R, t] and this tile's share of phi's [P, R, D]
  (`gated_read_backward_values`)."""
  m = options['m']
  dstreams_tD, dread_tR, dphi_PRD = gated_read_backward_from(
    phi_ref,
    gate_ref,
    coef_ref,
    dcoef_ref,
    [streams_ref[i] for i in range(m)],
    dh_ref,
    [dpassed_ref[i].astype(F32) for i in range(m)],
    **options,
  )
  for i in range(m):
    dstreams_ref[i] = dstreams_tD[i].astype(dstreams_ref.dtype)
  dread_ref[...] = tokens_minor(dread_tR)
  dphi_ref[...] = dphi_PRD
