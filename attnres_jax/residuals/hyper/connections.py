"""Hyper-Connections (HC, Zhu et al. 2024, arXiv 2409.19606) and manifold-constrained
Hyper-Connections (mHC, DeepSeek-AI 2025, arXiv 2512.24880) as residuals.

Both widen the residual stream into m parallel streams H [m, B, T, D] (the carry, with
a leading axis like the AttnRes depth buffer). Around every sublayer f (attention or
MLP, each with its own PreNorm inside f):

    read:   h   = sum_i a_i H_i                   (a: m read weights)
    write:  H'_j = sum_i R_ij H_i + b_j f(h)       (R: m x m mixing, b: m write weights)

The embedding starts every stream and the final norm reads their sum. Equations,
initialisation and every choice the papers leave open: `docs/comparators.md`.

HC (static and dynamic hyper-connections): a = A_m, R = A_r, b = B, each static plus,
when `hc_dynamic`, s * tanh(norm(H_i) W) from each stream's own RMS-normalised state.

mHC: from the RMS-normalised concatenation x = vec(H) / rms(vec(H)) of all streams,
pre = sigmoid(alpha_pre x phi_pre + b_pre), post = 2 sigmoid(alpha_post x phi_post +
b_post), res = SinkhornKnopp(alpha_res mat(x phi_res) + b_res); a = pre, b = post, and
the mixing is R = res^T (the paper writes x_{l+1} = res x_l).

Initialisation (both): the standard residual. Every stream holds the same state, the
read of sublayer k takes stream k mod m, mixing is the identity and every stream adds
f(h) (HC exactly; mHC up to sigmoid(-8) = 3e-4 and Sinkhorn's projection of a
near-identity), so the streams stay equal and each equals the standard residual
stream, and PreNorm and the final norm remove the factor m of the sum.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from attnres_jax.residuals.attnres import depth
from attnres_jax.nn import sharding
from attnres_jax.residuals import base
from attnres_jax.kernels import hyper_pallas
from attnres_jax.kernels import pallas_mesh
from attnres_jax.residuals.hyper import streams as hyper_streams
from attnres_jax.kernels import sinkhorn_pallas

STREAMS = sharding.DEPTH_BUFFER  # [m, B, T, D]: the streams shard like the depth buffer
STREAM_AXIS = STREAMS[0]  # the logical name of a stream axis in parameters (never split)
# Initial gate of the input-dependent part: HC's s_alpha, s_beta and mHC's alpha.
DYNAMIC_SCALE_INIT = 0.01
# mHC's static logits at initialisation: the selected stream / the diagonal get 0 or
# +8, the others -8 (sigmoid(-8) = 3.4e-4), so the start is close to HC's.
MHC_LOGIT = 8.0
# How the stream write is computed (`depth_kernel`): XLA (hyper_streams) or the Pallas
# kernels (hyper_pallas; interpret mode off the TPU).
WRITE_KERNELS = {'xla': hyper_streams.write, 'pallas': hyper_pallas.write}


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


def _constant(value):
  return lambda shape, dtype: jnp.full(shape, value, dtype)


class HyperConnectionParams(nnx.Module):
  """HC parameters for `rows` sublayers: static read offsets (A_m minus its initial
  one-hot e_{k mod m}, which depends on the sublayer index k and is added when read),
  mixing A_r (identity) and write weights B (ones); dynamic projections W (zero) and
  gates s_alpha, s_beta (0.01). No random numbers."""

  def __init__(self, cfg, rows: tuple[int, ...], row_axes: tuple[str, ...]):
    pdt = jnp.dtype(cfg.param_dtype)
    m, d = cfg.hc_streams, cfg.d_model
    eye = lambda shape, dtype: jnp.broadcast_to(jnp.eye(m, dtype=dtype), shape)
    self.static_read = base.param(jnp.zeros, (*rows, m), (*row_axes, STREAM_AXIS), pdt)
    self.static_mix = base.param(
      eye, (*rows, m, m), (*row_axes, STREAM_AXIS, STREAM_AXIS), pdt
    )
    self.static_write = base.param(jnp.ones, (*rows, m), (*row_axes, STREAM_AXIS), pdt)
    if cfg.hc_dynamic:
      self.read_proj = base.param(jnp.zeros, (*rows, d), (*row_axes, 'embed'), pdt)
      self.mix_proj = base.param(
        jnp.zeros, (*rows, d, m), (*row_axes, 'embed', STREAM_AXIS), pdt
      )
      self.write_proj = base.param(jnp.zeros, (*rows, d), (*row_axes, 'embed'), pdt)
      self.read_scale = base.param(_constant(DYNAMIC_SCALE_INIT), rows, row_axes, pdt)
      self.write_scale = base.param(_constant(DYNAMIC_SCALE_INIT), rows, row_axes, pdt)
    else:
      self.read_proj = self.mix_proj = self.write_proj = None
      self.read_scale = self.write_scale = None


class ManifoldHyperConnectionParams(nnx.Module):
  """mHC parameters for `rows` sublayers: biases b_pre (offset from the initial +-8
  logits selecting stream k mod m), b_post (0: H_post = 1), b_res (0 on the diagonal,
  -8 off it); dynamic projections phi [m, D, .] (zero) and gates alpha (0.01)."""

  def __init__(self, cfg, rows: tuple[int, ...], row_axes: tuple[str, ...]):
    pdt = jnp.dtype(cfg.param_dtype)
    m, d = cfg.hc_streams, cfg.d_model
    res_init = lambda shape, dtype: jnp.broadcast_to(
      MHC_LOGIT * (jnp.eye(m, dtype=dtype) - 1), shape
    )
    self.pre_bias = base.param(jnp.zeros, (*rows, m), (*row_axes, STREAM_AXIS), pdt)
    self.post_bias = base.param(jnp.zeros, (*rows, m), (*row_axes, STREAM_AXIS), pdt)
    self.res_bias = base.param(
      res_init, (*rows, m, m), (*row_axes, STREAM_AXIS, STREAM_AXIS), pdt
    )
    if cfg.hc_dynamic:
      proj = lambda k: base.param(
        jnp.zeros, (*rows, m, d, k), (*row_axes, STREAM_AXIS, 'embed', STREAM_AXIS), pdt
      )
      self.pre_proj, self.post_proj, self.res_proj = proj(m), proj(m), proj(m * m)
      self.pre_scale, self.post_scale, self.res_scale = (
        base.param(_constant(DYNAMIC_SCALE_INIT), rows, row_axes, pdt) for _ in range(3)
      )
    else:
      self.pre_proj = self.post_proj = self.res_proj = None
      self.pre_scale = self.post_scale = self.res_scale = None


def _row(param, which):
  return None if param is None else param[...][which].astype(jnp.float32)


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


class StreamCarry(NamedTuple):
  """Within a segment: the streams (or a `PendingWrite`) and the index of the
  segment's first layer (for the initial read one-hot)."""

  streams_MBTD: Any
  first_layer: jax.Array


@dataclasses.dataclass(frozen=True)
class HyperConnectionResidual(base.Residual):
  """HC (`cfg.residual == 'hc'`) or mHC ('mhc') over `cfg.hc_streams` streams.

  Carry between layers: the streams [m, B, T, D], or with `defers_write` a
  `PendingWrite`; within a segment, `StreamCarry`. A sublayer's coefficients are
  computed once, from the streams before it, and used by both its read and its write
  (`sublayer`).
  """

  cfg: Any

  # Decay would pull HC's identity mixing and the gates to zero; projections decay.
  no_decay = frozenset(
    'static_read static_mix static_write read_scale write_scale pre_bias post_bias '
    'res_bias pre_scale post_scale res_scale'.split()
  )
  figures = ('streams',)

  def validate(self) -> None:
    cfg = self.cfg
    if not base.is_int(cfg.hc_streams) or cfg.hc_streams < 1:
      base.invalid(
        f'hc_streams is the number of residual streams (expansion rate m) and must '
        f'be an integer >= 1, got {cfg.hc_streams!r}.'
      )
    if not isinstance(cfg.hc_dynamic, bool):
      base.invalid(f'hc_dynamic must be True or False, got {cfg.hc_dynamic!r}.')
    if self.manifold and (not base.is_int(cfg.sinkhorn_iters) or cfg.sinkhorn_iters < 1):
      base.invalid(f'sinkhorn_iters must be an integer >= 1, got {cfg.sinkhorn_iters!r}.')
    if cfg.depth_kernel not in pallas_mesh.KERNEL_SETTINGS:
      base.invalid(
        f'depth_kernel must be one of {pallas_mesh.KERNEL_SETTINGS} (for HC/mHC: how the '
        f'stream write and the projections are computed), got {cfg.depth_kernel!r}.'
      )
    if cfg.ablations:
      base.invalid(
        f'the depth-read ablations {cfg.ablations} apply to AttnRes, not to '
        f'residual={cfg.residual!r}.'
      )

  @property
  def label(self) -> str:
    name = 'mHC' if self.manifold else 'Hyper-Connections'
    return f'{name} (m={self.cfg.hc_streams})'

  def describe(self):
    return {'hc_streams': self.num_streams}

  @property
  def manifold(self) -> bool:
    return self.cfg.residual == 'mhc'

  @property
  def num_streams(self) -> int:
    return self.cfg.hc_streams

  def layer_params(self):
    module = ManifoldHyperConnectionParams if self.manifold else HyperConnectionParams
    return module(self.cfg, (2,), ('sublayers',))

  @property
  def kernel(self) -> str:  # 'xla' | 'pallas', 'auto' decided at trace time
    return pallas_mesh.choose_kernel(self.cfg.depth_kernel)

  @property
  def defers_write(self) -> bool:
    """Whether each write waits for the next sublayer's read (`PendingWrite`):
    dynamic HC or mHC with the Pallas kernels."""
    return self.cfg.hc_dynamic and self.kernel == 'pallas'

  def init(self, x_BTD):
    streams_MBTD = jnp.broadcast_to(x_BTD, (self.num_streams,) + x_BTD.shape)
    streams_MBTD = sharding.constrain(streams_MBTD, STREAMS)
    if not self.defers_write:
      return streams_MBTD
    # The identity write (R = I, b = 0): exactly the embedding's streams again.
    m, batch = self.num_streams, x_BTD.shape[:2]
    identity_MM = jnp.eye(m, dtype=jnp.float32)
    return PendingWrite(
      streams_MBTD,
      jnp.zeros_like(x_BTD),
      jnp.broadcast_to(identity_MM[..., None, None], (m, m, *batch)),
      jnp.zeros((m, *batch), jnp.float32),
    )

  def written(self, streams):
    """The streams, with a pending write done (the write kernel alone)."""
    if not isinstance(streams, PendingWrite):
      return streams
    new_MBTD = WRITE_KERNELS[self.kernel](
      streams.mix_MMBT, streams.write_MBT, streams.streams_MBTD, streams.out_BTD
    )
    return sharding.constrain(new_MBTD, STREAMS)

  def begin_segment(self, carry, params, segment):
    return StreamCarry(carry, jnp.asarray(segment * self.segment_layers, jnp.int32)), None

  def end_segment(self, carry, inner: StreamCarry, segment):
    return inner.streams_MBTD

  def selected(self, first_layer, layer_in_segment, which):
    """One-hot [m] of stream k mod m, k the model-wide sublayer index."""
    k = 2 * (first_layer + layer_in_segment) + which
    return jax.nn.one_hot(k % self.num_streams, self.num_streams, dtype=jnp.float32)

  def coefficients(
    self, inner: StreamCarry, params, layer_in_segment, which
  ) -> Coefficients:
    selected_M = self.selected(inner.first_layer, layer_in_segment, which)
    if self.manifold:
      return self._mhc_coefficients(inner.streams_MBTD, params, selected_M, which)
    return self._hc_coefficients(inner.streams_MBTD, params, selected_M, which)

  def _projections(self, streams, phi, scale, base_M, per_stream):
    """The dynamic coefficients' normalised projections of the streams (HC
    [K, m, B, T] with `per_stream`, mHC [K, B, T]; `hyper_streams.normed_projection`)
    and, where the Pallas kernels compute them with the read (T a multiple of 128:
    `hyper_pallas.gated_read`, or with a pending write `boundary`), h of the read
    gates `scale` and `base_M` (HC: base_i + scale tanh(n_i0), mHC: sigmoid(base_i +
    scale n_i)), else None; and the streams the write reads (passed through or
    written by a kernel), else None. `streams`: [m, B, T, D] or a `PendingWrite`."""
    pending = streams if isinstance(streams, PendingWrite) else None
    streams_MBTD = _stream_array(streams)
    m, batch = self.num_streams, streams_MBTD.shape[1:3]
    if self.kernel != 'pallas' or batch[1] % hyper_pallas.LANES:
      passed_MBTD = self.written(pending) if pending else None
      normed = hyper_streams.normed_projection(
        phi,
        streams_MBTD if passed_MBTD is None else passed_MBTD,
        self.cfg.norm_eps,
        per_stream=per_stream,
      )
      return normed, None, passed_MBTD
    # The read with its projections, one read of the streams each way (with the
    # pending write: in the same kernel).
    num_out = phi.shape[-1]
    gate_2R = hyper_pallas.read_gate(scale, base_M, num_out, per_stream)
    if pending:
      write = (pending.mix_MMBT, pending.write_MBT, streams_MBTD, pending.out_BTD)
      h_BTD, coef_RBT, passed_MBTD = hyper_pallas.boundary(
        *write, phi, gate_2R, self.cfg.norm_eps
      )
    else:
      h_BTD, coef_RBT, passed_MBTD = hyper_pallas.gated_read(
        phi, gate_2R, streams_MBTD, self.cfg.norm_eps
      )
    normed = hyper_pallas.normalised_projections(coef_RBT, m, num_out, per_stream)
    return normed, h_BTD, sharding.constrain(passed_MBTD, STREAMS)

  def _hc_coefficients(self, streams, params, selected_M, which):
    """`streams`: the streams [m, B, T, D] or a `PendingWrite` of them."""
    streams_MBTD = _stream_array(streams)
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
    m = self.num_streams
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
    normed, h_BTD, passed_MBTD = self._projections(
      streams, proj, s_alpha, read_M, per_stream=True
    )
    gates = jnp.tanh(normed)
    read_MBT += s_alpha * gates[0]
    mix_MMBT += s_alpha * jnp.swapaxes(gates[1 : m + 1], 0, 1)  # [from i, to n]
    write_MBT += s_beta * gates[m + 1]
    return Coefficients(read_MBT, mix_MMBT, write_MBT, h_BTD, passed_MBTD)

  def _mhc_coefficients(self, streams, params, selected_M, which):
    """mHC's maps, every one with the tokens on the minor axes ([m, B, T] and
    [m, m, B, T]): a per-token m x m matrix in the minor axes pads m to a tile.
    `streams`: the streams [m, B, T, D] or a `PendingWrite` of them."""
    streams_MBTD = _stream_array(streams)
    m = self.num_streams
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
      projected_KBT, h_BTD, passed_MBTD = self._projections(
        streams, phi, pre_scale, pre_M, per_stream=False
      )
      pre_KBT, post_KBT, res_KBT = jnp.split(projected_KBT, [m, 2 * m])
      pre_MBT = pre_MBT + pre_scale * pre_KBT
      post_MBT = post_MBT + _row(params.post_scale, which) * post_KBT
      res_MMBT = res_MMBT + _row(params.res_scale, which) * res_KBT.reshape(m, m, *batch)
    # Recomputed in the backward pass: only the logits are kept, not 20 iterations.
    if self.kernel == 'pallas':  # the iterations in VMEM (sinkhorn_pallas)
      h_res_MMBT = sinkhorn_pallas.sinkhorn(res_MMBT, self.cfg.sinkhorn_iters)
    else:
      h_res_MMBT = jax.checkpoint(sinkhorn, static_argnums=(1, 2))(
        res_MMBT, self.cfg.sinkhorn_iters, (0, 1)
      )
    return Coefficients(
      read_MBT=jax.nn.sigmoid(pre_MBT),
      mix_MMBT=jnp.swapaxes(h_res_MMBT, 0, 1),  # [from, to, B, T]
      write_MBT=2 * jax.nn.sigmoid(post_MBT),
      h_BTD=h_BTD,
      streams_MBTD=passed_MBTD,
    )

  def sublayer(
    self, inner: StreamCarry, params, per_layer, layer_in_segment, which, branch
  ):
    coeffs = self.coefficients(inner, params, layer_in_segment, which)
    streams_MBTD = coeffs.streams_MBTD
    if streams_MBTD is None:
      streams_MBTD = inner.streams_MBTD
    h_BTD = coeffs.h_BTD
    if h_BTD is None:
      # float32 inside the fusions, the streams' dtype in memory (`hyper_streams`).
      h_BTD = hyper_streams.read(coeffs.read_MBT, streams_MBTD)
    h_BTD = sharding.constrain(h_BTD, sharding.HIDDEN)
    out_BTD, saved = branch(h_BTD)
    if self.defers_write:  # done by the next sublayer's read (or `final`)
      new = PendingWrite(
        streams_MBTD,
        sharding.constrain(out_BTD, sharding.HIDDEN),
        coeffs.mix_MMBT,
        coeffs.write_MBT,
      )
    else:
      new = WRITE_KERNELS[self.kernel](
        coeffs.mix_MMBT, coeffs.write_MBT, streams_MBTD, out_BTD
      )
      new = sharding.constrain(new, STREAMS)
    inner = inner._replace(streams_MBTD=new)
    weights = dict(
      coeffs=coeffs, stream_rms_MBT=1.0 / depth.rms_inverse(streams_MBTD, 0.0)
    )
    return inner, base.Applied(h_BTD, out_BTD, weights, saved)

  def final(self, carry, params):
    """The sum of the streams (both papers); the final norm removes the factor m."""
    carry = self.written(carry)
    h_BTD = jnp.sum(carry.astype(jnp.float32), axis=0).astype(carry.dtype)
    return h_BTD, 1.0 / depth.rms_inverse(carry, 0.0)  # weights: each stream's RMS

  # -- analysis: per-stream statistics ---------------------------------------------

  def sublayer_statistics(self, weights, mean):
    """stream_rms [m] (RMS of each stream before the sublayer), read_weights [m] (a),
    mix_weights [m, m] ([i, j]: the weight of stream j in the new stream i; mHC's
    H_res, HC's A_r transposed), write_weights [m] (b)."""
    coeffs, means = weights['coeffs'], _leading_mean(mean)
    return {
      'stream_rms': means(weights['stream_rms_MBT']),
      'read_weights': means(coeffs.read_MBT),
      'mix_weights': means(coeffs.mix_MMBT).T,
      'write_weights': means(coeffs.write_MBT),
    }

  def final_statistics(self, weights, mean):
    return {'final_stream_rms': _leading_mean(mean)(weights)}

  # -- cost -------------------------------------------------------------------------

  def forward_flops(self) -> float:
    """Per sublayer: read 2 m d, mixing 2 m^2 d, write 2 m d; dynamic HC: per-stream
    RMS 3 m d, projections 2 m d (m + 2); dynamic mHC: RMS of the m d concatenation
    3 m d, projections 2 m d (m^2 + 2 m); mHC's Sinkhorn: ~8 m^2 per iteration plus
    3 m^2 (independent of d); plus (m - 1) d for the final sum of the streams."""
    m, d = self.num_streams, self.cfg.d_model
    per_sublayer = 2 * m * d + 2 * m * m * d + 2 * m * d
    if self.cfg.hc_dynamic:
      outputs = m * m + 2 * m if self.manifold else m + 2
      per_sublayer += 3 * m * d + 2 * m * d * outputs
    if self.manifold:
      per_sublayer += 8 * m * m * self.cfg.sinkhorn_iters + 3 * m * m
    return float(2 * self.cfg.num_layers * per_sublayer + (m - 1) * d)

  def io_per_sublayer(self) -> tuple[float, float]:
    """The read reads the m streams and writes h; the write reads the m streams and
    f(h) and writes m streams; the final read reads m and writes 1. With
    `defers_write` (`hyper_pallas.boundary`) a sublayer's read does the previous
    write on the same pass: m streams and f(h) in, m streams and h out; the last
    write is done alone before the final read."""
    m, num_sublayers = self.num_streams, 2 * self.cfg.num_layers
    if self.defers_write:
      return (
        ((m + 1) * num_sublayers + (m + 1) + m) / num_sublayers,
        ((m + 1) * num_sublayers + m + 1) / num_sublayers,
      )
    return (
      ((2 * m + 1) * num_sublayers + m) / num_sublayers,
      ((m + 1) * num_sublayers + 1) / num_sublayers,
    )

  # -- the pipeline: the streams cross stage boundaries whole ----------------------

  def carry_axes(self):
    if self.defers_write:  # the write's weights: [m, m, B, T] and [m, B, T]
      weights = (STREAM_AXIS, 'batch', 'length')
      return PendingWrite(STREAMS, sharding.HIDDEN, (STREAM_AXIS, *weights), weights)
    return STREAMS


def _stream_array(streams):
  """The streams [m, B, T, D] a sublayer's coefficients see: a `PendingWrite`'s
  streams before its write (the shapes are the same)."""
  return streams.streams_MBTD if isinstance(streams, PendingWrite) else streams


def _leading_mean(mean):
  """`mean` over the trailing [B, T] axes of an array with leading axes."""

  def means(x_XBT):
    flat = x_XBT.reshape(-1, *x_XBT.shape[-2:])
    return jax.vmap(mean)(flat).reshape(x_XBT.shape[:-2])

  return means


def stream_statistics(model, tokens_BT, weights_BT=None) -> dict[str, jax.Array]:
  """The per-stream statistics of an HC/mHC model on a batch (`sublayer_statistics`,
  stacked [num_layers, 2, ...], and final_stream_rms [m]), token means weighted by
  `weights_BT` (e.g. 0 on padding; default uniform): the analysis pass's."""
  if not isinstance(model.residual, HyperConnectionResidual):
    raise ValueError(
      f'stream statistics need residual "hc" or "mhc", got {model.cfg.residual!r}.'
    )
  _, stats = model(tokens_BT, collect_stats=True, stats_weights_BT=weights_BT)
  keys = 'stream_rms read_weights mix_weights write_weights final_stream_rms'.split()
  return {k: stats[k] for k in keys}
