"""ReZero (Bachlechner et al. 2021, arXiv 2003.04887) over PreNorm sublayers:
h <- h + alpha * f(h), with one learned scalar alpha per sublayer initialised at 0, so
that every layer starts as the identity.

Also the template residual of docs/extending.md: parameters without random numbers,
weight decay spared by name, a carry that is the stream alone, FLOPs and I/O declared.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
from flax import nnx

from attnres_jax.nn import sharding
from attnres_jax.residuals import base


class ReZeroScales(nnx.Module):
  """A layer's alphas, one row per sublayer ([n]; stacked over layers [L, n])."""

  def __init__(self, cfg):
    self.alpha = base.param(
      jnp.zeros, (cfg.sublayers_per_layer,), ('sublayers',), jnp.dtype(cfg.param_dtype)
    )


@dataclasses.dataclass(frozen=True)
class ReZeroResidual(base.Residual):
  """The carry is the stream h [B, T, D]; one layer a segment."""

  cfg: Any
  # Decay would pull every alpha back to 0, i.e. the layers back to the identity.
  no_decay = frozenset({'alpha'})

  @property
  def label(self) -> str:
    return 'ReZero'

  def layer_params(self) -> nnx.Module:
    return ReZeroScales(self.cfg)

  def init(self, x_BTD):
    return x_BTD

  def read(self, inner, params, per_layer, layer_in_segment, which):
    return inner, None

  def write(self, inner, params, per_layer, layer_in_segment, which, out_BTD):
    alpha = params.alpha[...][which].astype(out_BTD.dtype)
    return sharding.constrain(inner + alpha * out_BTD, sharding.HIDDEN)

  def final(self, carry, params):
    return carry, None

  def forward_flops(self) -> float:
    # The multiply by alpha, per channel and sublayer (the add is the standard
    # residual's, which counts none).
    return float(self.cfg.d_model * self.num_sublayers)

  def io_per_sublayer(self) -> tuple[float, float]:
    return 2.0, 1.0  # as the standard residual's write: reads h and f(h), writes h'

  def carry_axes(self):
    return sharding.HIDDEN
