"""The parameters of HC and mHC (`connections.py`), for the rows of sublayers that one
layer holds. No random numbers: both start as the standard residual (the identity
mixing, the read of stream k mod m, every stream adding f(h)); equations and
initialisation in `docs/comparators.md`."""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from attnres_jax.residuals import base
from attnres_jax.residuals.hyper.streams import STREAM_AXIS

# Initial gate of the input-dependent part: HC's s_alpha, s_beta and mHC's alpha.
DYNAMIC_SCALE_INIT = 0.01
# mHC's static logits at initialisation: the selected stream / the diagonal get 0 or
# +8, the others -8 (sigmoid(-8) = 3.4e-4), so the start is close to HC's.
MHC_LOGIT = 8.0


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
