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

Here the residual (the carry, the sublayer's read and write, the analysis and cost);
beside it `params.py` (the parameters and their initialisation), `coefficients.py` (a
sublayer's per-token weights, mHC's Sinkhorn), `streams.py` (the stream-sized read,
write and projections with hand-written VJPs) and their Pallas kernels
(`kernels/hyper_pallas.py`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from attnres_jax.kernels import pallas_mesh
from attnres_jax.nn import sharding
from attnres_jax.residuals import base
from attnres_jax.residuals.attnres import depth
from attnres_jax.residuals.hyper import coefficients as coefs
from attnres_jax.residuals.hyper import streams as hyper_streams
from attnres_jax.residuals.hyper.coefficients import Coefficients
from attnres_jax.residuals.hyper.coefficients import PendingWrite
from attnres_jax.residuals.hyper.params import HyperConnectionParams
from attnres_jax.residuals.hyper.params import ManifoldHyperConnectionParams
from attnres_jax.residuals.hyper.streams import STREAM_AXIS
from attnres_jax.residuals.hyper.streams import STREAMS

# How the streams' steps are computed (`depth_kernel`): XLA (`streams.py`) or the
# Pallas kernels (`kernels/hyper_pallas.py`; interpret mode off the TPU); 'auto' picks
# the kernels where the step is compiled for TPU devices (`pallas_mesh.choose_kernel`).
DEPTH_KERNELS = pallas_mesh.KERNEL_SETTINGS


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
    if cfg.depth_kernel not in DEPTH_KERNELS:
      base.invalid(
        f'depth_kernel must be one of {DEPTH_KERNELS} (for HC/mHC: how the '
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
    return module(self.cfg, (self.sublayers_per_layer,), ('sublayers',))

  @property
  def kernel(self) -> str:
    """'xla' or 'pallas': `depth_kernel`, with 'auto' decided at trace time."""
    return pallas_mesh.choose_kernel(self.cfg.depth_kernel)

  @property
  def uses_pallas(self) -> bool:
    """Whether the Pallas kernels compute the streams' steps (`depth_kernel`): the
    one place that reads it, through `kernel`."""
    return self.kernel == 'pallas'

  @property
  def defers_write(self) -> bool:
    """Whether each write waits for the next sublayer's read (`PendingWrite`):
    dynamic HC or mHC with the Pallas kernels."""
    return self.cfg.hc_dynamic and self.uses_pallas

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
    return coefs.written(streams, pallas=self.uses_pallas)

  def begin_segment(self, carry, params, segment):
    return StreamCarry(carry, jnp.asarray(segment * self.segment_layers, jnp.int32)), None

  def end_segment(self, carry, inner: StreamCarry, segment):
    return inner.streams_MBTD

  def selected(self, first_layer, layer_in_segment, which):
    """One-hot [m] of stream k mod m, k the model-wide sublayer index."""
    k = self.sublayers_per_layer * (first_layer + layer_in_segment) + which
    return jax.nn.one_hot(k % self.num_streams, self.num_streams, dtype=jnp.float32)

  def coefficients(
    self, inner: StreamCarry, params, layer_in_segment, which
  ) -> Coefficients:
    selected_M = self.selected(inner.first_layer, layer_in_segment, which)
    options = dict(eps=self.cfg.norm_eps, pallas=self.uses_pallas)
    if self.manifold:
      return coefs.mhc_coefficients(
        inner.streams_MBTD,
        params,
        selected_M,
        which,
        iters=self.cfg.sinkhorn_iters,
        **options,
      )
    return coefs.hc_coefficients(inner.streams_MBTD, params, selected_M, which, **options)

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
      new = coefs.write(
        coeffs.mix_MMBT,
        coeffs.write_MBT,
        streams_MBTD,
        out_BTD,
        pallas=self.uses_pallas,
      )
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
    return float(self.num_sublayers * per_sublayer + (m - 1) * d)

  def io_per_sublayer(self) -> tuple[float, float]:
    """The read reads the m streams and writes h; the write reads the m streams and
    f(h) and writes m streams; the final read reads m and writes 1. With
    `defers_write` (`hyper_pallas.boundary`) a sublayer's read does the previous
    write on the same pass: m streams and f(h) in, m streams and h out; the last
    write is done alone before the final read."""
    m, num_sublayers = self.num_streams, self.num_sublayers
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
