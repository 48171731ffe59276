"""One sublayer's stream weights of HC and mHC (`connections.py`), per token: the read
a, the mixing R and the write b, from the layer's parameters (`params.py`) and, when
dynamic, from the streams before the sublayer. Also mHC's Sinkhorn-Knopp and the
stream write that a sublayer's coefficients feed.

`pallas` (the residual's `uses_pallas`) picks the Pallas kernels
(`kernels/hyper_pallas.py`, `kernels/sinkhorn_pallas.py`; interpret mode off the TPU)
over the XLA steps (`streams.py`), the same values either way.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from attnres_jax.kernels import hyper_pallas
from attnres_jax.kernels import sinkhorn_pallas
from attnres_jax.nn import sharding
from attnres_jax.residuals.hyper import streams as hyper_streams
from attnres_jax.residuals.hyper.params import MHC_LOGIT
from attnres_jax.residuals.hyper.streams import STREAMS


def sinkhorn(logits, iters: int, axes: tuple[int, int] = (-2, -1)):
  """Sinkhorn-Knopp: exp(logits) scaled to a doubly stochastic matrix over `axes`
  (row index, column index; default the last two), in float32 and in the log domain so
  that extreme logits neither overflow nor underflow. Each iteration normalises the
  columns, then the rows (the paper's M <- T_r(T_c(M))): the rows of the result sum to
  one up to rounding, the columns to within the iteration's convergence. The model
  calls it on [m, m, B, T] (axes (0, 1)): the tokens stay on the minor (lane) axes."""
  rows, columns = axes
  log_m = logits.astype(jnp.float32)

  def iteration(_, log_m):
    log_m = log_m - jax.nn.logsumexp(log_m, axis=rows, keepdims=True)
    return log_m - jax.nn.logsumexp(log_m, axis=columns, keepdims=True)

  matrix = jnp.exp(jax.lax.fori_loop(0, iters, iteration, log_m))
  # The last row normalisation once more, in the linear domain (exactly a no-op in
  # real arithmetic): in the log domain an entry's relative rounding error is that of
  # its log, ~2^-24 times the logits' magnitude, 1e-5 already for logits of 100.
  return matrix / jnp.sum(matrix, axis=columns, keepdims=True)


@dataclasses.dataclass(frozen=True)
class Coefficients:
  """One sublayer's stream weights, per token: read a [m, B, T], mixing R [m, m, B, T]
  (R[i, j]: from stream i to stream j), write b [m, B, T]. float32. `h_BTD`: the
  read's result where it was computed with the weights (`hyper_pallas.gated_read`,
  `boundary`), else None; `streams_MBTD` then the streams the kernel passed through
  or wrote, which the write reads (its backward sums their cotangents), else None
  (the write reads the carry's)."""

  read_MBT: jax.Array
  mix_MMBT: jax.Array
  write_MBT: jax.Array
  h_BTD: jax.Array | None = None
  streams_MBTD: jax.Array | None = None


class PendingWrite(NamedTuple):
  """Streams whose last write is not done yet: the streams before it, f(h) and its
  weights. Dynamic HC/mHC with the Pallas kernels carries them from sublayer to
  sublayer: the next sublayer's gated read does the write in the same kernel
  (`hyper_pallas.boundary`: the new streams are read while still on chip, and their
  cotangent goes from the read's backward to the write's on chip); `written` does it
  alone (`final`, or where T fills no lane tile)."""

  streams_MBTD: jax.Array
  out_BTD: jax.Array
  mix_MMBT: jax.Array
  write_MBT: jax.Array


def stream_array(streams):
  """The streams [m, B, T, D] a sublayer's coefficients see: a `PendingWrite`'s
  streams before its write (the shapes are the same)."""
  return streams.streams_MBTD if isinstance(streams, PendingWrite) else streams


def write(mix_MMBT, write_MBT, streams_MBTD, out_BTD, *, pallas: bool):
  """The new streams [m, B, T, D] (`streams.write`; with `pallas` the kernel)."""
  kernel = hyper_pallas.write if pallas else hyper_streams.write
  new_MBTD = kernel(mix_MMBT, write_MBT, streams_MBTD, out_BTD)
  return sharding.constrain(new_MBTD, STREAMS)


def written(streams, *, pallas: bool):
  """The streams, with a pending write done (the write kernel alone)."""
  if not isinstance(streams, PendingWrite):
    return streams
  return write(
    streams.mix_MMBT,
    streams.write_MBT,
    streams.streams_MBTD,
    streams.out_BTD,
    pallas=pallas,
  )


def _row(param, which):
  return None if param is None else param[...][which].astype(jnp.float32)


def projections(streams, phi, scale, base_M, *, per_stream, eps, pallas):
  """The dynamic coefficients' normalised projections of the streams (HC
  [K, m, B, T] with `per_stream`, mHC [K, B, T]; `streams.normed_projection`)
  and, where the Pallas kernels compute them with the read (T a multiple of 128:
  `hyper_pallas.gated_read`, or with a pending write `boundary`), h of the read
  gates `scale` and `base_M` (HC: base_i + scale tanh(n_i0), mHC: sigmoid(base_i +
  scale n_i)), else None; and the streams the write reads (passed through or
  written by a kernel), else None. `streams`: [m, B, T, D] or a `PendingWrite`."""
  pending = streams if isinstance(streams, PendingWrite) else None
  streams_MBTD = stream_array(streams)
  m, batch = streams_MBTD.shape[0], streams_MBTD.shape[1:3]
  if not pallas or batch[1] % hyper_pallas.LANES:
    passed_MBTD = written(pending, pallas=pallas) if pending else None
    normed = hyper_streams.normed_projection(
      phi,
      streams_MBTD if passed_MBTD is None else passed_MBTD,
      eps,
      per_stream=per_stream,
    )
    return normed, None, passed_MBTD
  # The read with its projections, one read of the streams each way (with the
  # pending write: in the same kernel).
  num_out = phi.shape[-1]
  gate_2R = hyper_pallas.read_gate(scale, base_M, num_out, per_stream)
  if pending:
    pending_write = (pending.mix_MMBT, pending.write_MBT, streams_MBTD, pending.out_BTD)
    h_BTD, coef_RBT, passed_MBTD = hyper_pallas.boundary(
      *pending_write, phi, gate_2R, eps
    )
  else:
    h_BTD, coef_RBT, passed_MBTD = hyper_pallas.gated_read(
      phi, gate_2R, streams_MBTD, eps
    )
  normed = hyper_pallas.normalised_projections(coef_RBT, m, num_out, per_stream)
  return normed, h_BTD, sharding.constrain(passed_MBTD, STREAMS)


def hc_coefficients(streams, params, selected_M, which, *, eps, pallas):
  """HC's: static A_m, A_r, B plus, when dynamic, s tanh(norm(H_i) W) from each
  stream's own normalised state. `streams`: the streams [m, B, T, D] or a
  `PendingWrite` of them."""
  streams_MBTD = stream_array(streams)
  read_M = selected_M + _row(params.static_read, which)
  mix_MM = _row(params.static_mix, which)
  write_M = _row(params.static_write, which)
  batch = streams_MBTD.shape[1:3]
  read_MBT = jnp.broadcast_to(read_M[:, None, None], read_M.shape + batch)
  mix_MMBT = jnp.broadcast_to(mix_MM[..., None, None], mix_MM.shape + batch)
  write_MBT = jnp.broadcast_to(write_M[:, None, None], write_M.shape + batch)
  if params.read_proj is None:  # static (never pending: `defers_write`)
    return Coefficients(read_MBT, mix_MMBT, write_MBT)
  # dynamic: from each stream's own normalised state
  m = streams_MBTD.shape[0]
  s_alpha, s_beta = _row(params.read_scale, which), _row(params.write_scale, which)
  # W_m, W_r and W_beta as one [D, m + 2] projection; gates [m + 2, m, B, T].
  proj = jnp.concatenate(
    [
      _row(params.read_proj, which)[:, None],
      _row(params.mix_proj, which),
      _row(params.write_proj, which)[:, None],
    ],
    axis=-1,
  )
  normed, h_BTD, passed_MBTD = projections(
    streams, proj, s_alpha, read_M, per_stream=True, eps=eps, pallas=pallas
  )
  gates = jnp.tanh(normed)
  read_MBT += s_alpha * gates[0]
  mix_MMBT += s_alpha * jnp.swapaxes(gates[1 : m + 1], 0, 1)  # [from i, to n]
  write_MBT += s_beta * gates[m + 1]
  return Coefficients(read_MBT, mix_MMBT, write_MBT, h_BTD, passed_MBTD)


def mhc_coefficients(streams, params, selected_M, which, *, eps, iters, pallas):
  """mHC's maps, every one with the tokens on the minor axes ([m, B, T] and
  [m, m, B, T]): a per-token m x m matrix in the minor axes pads m to a tile.
  `streams`: the streams [m, B, T, D] or a `PendingWrite` of them; `iters`:
  Sinkhorn's iterations."""
  streams_MBTD = stream_array(streams)
  m = streams_MBTD.shape[0]
  batch = streams_MBTD.shape[1:3]
  per_token = lambda x: jnp.broadcast_to(x[..., None, None], x.shape + batch)
  pre_M = MHC_LOGIT * (2 * selected_M - 1) + _row(params.pre_bias, which)
  pre_MBT = per_token(pre_M)
  post_MBT = per_token(_row(params.post_bias, which))
  res_MMBT = per_token(_row(params.res_bias, which))  # [i, j]: to i from j
  h_BTD = passed_MBTD = None
  if params.pre_proj is not None:  # dynamic: from all streams, flattened and normed
    # RMSNorm(vec(H)) over the m * D features of a token (no gain: phi absorbs
    # it); one dot for the three projections, its outputs leading: [2m + m^2, B, T].
    phi = jnp.concatenate(
      [_row(p, which) for p in (params.pre_proj, params.post_proj, params.res_proj)],
      axis=-1,
    )
    pre_scale = _row(params.pre_scale, which)
    projected_KBT, h_BTD, passed_MBTD = projections(
      streams, phi, pre_scale, pre_M, per_stream=False, eps=eps, pallas=pallas
    )
    pre_KBT, post_KBT, res_KBT = jnp.split(projected_KBT, [m, 2 * m])
    pre_MBT = pre_MBT + pre_scale * pre_KBT
    post_MBT = post_MBT + _row(params.post_scale, which) * post_KBT
    res_MMBT = res_MMBT + _row(params.res_scale, which) * res_KBT.reshape(m, m, *batch)
  # Recomputed in the backward pass: only the logits are kept, not 20 iterations.
  if pallas:  # the iterations in VMEM (sinkhorn_pallas)
    h_res_MMBT = sinkhorn_pallas.sinkhorn(res_MMBT, iters)
  else:
    h_res_MMBT = jax.checkpoint(sinkhorn, static_argnums=(1, 2))(res_MMBT, iters, (0, 1))
  return Coefficients(
    read_MBT=jax.nn.sigmoid(pre_MBT),
    mix_MMBT=jnp.swapaxes(h_res_MMBT, 0, 1),  # [from, to, B, T]
    write_MBT=2 * jax.nn.sigmoid(post_MBT),
    h_BTD=h_BTD,
    streams_MBTD=passed_MBTD,
  )
