"""The standard (PreNorm) residual: h_{l+1} = h_l + f_l(h_l)."""

from __future__ import annotations

import dataclasses
from typing import Any

from attnres_jax.nn import sharding
from attnres_jax.residuals import base


@dataclasses.dataclass(frozen=True)
class StandardResidual(base.Residual):
  """The stream is the whole state (the carry is h [B, T, D]); one layer a segment,
  or `schedule_layers` (the same computation, the scan's body holding that many
  layers: a control for how a program's loop structure alone moves the compile-only
  estimate, beside AttnRes, whose segments hold whole blocks)."""

  cfg: Any

  @property
  def segment_layers(self) -> int:
    return self.cfg.schedule_layers or 1

  @property
  def label(self) -> str:
    return 'Standard residual'

  def init(self, x_BTD):
    return x_BTD

  def read(self, inner, params, per_layer, layer_in_segment, which):
    return inner, None

  def write(self, inner, params, per_layer, layer_in_segment, which, out_BTD):
    return sharding.constrain(inner + out_BTD, sharding.HIDDEN)

  def final(self, carry, params):
    return carry, None

  def io_per_sublayer(self) -> tuple[float, float]:
    return 2.0, 1.0  # the write reads h and f(h), writes h'

  def carry_axes(self):
    return sharding.HIDDEN
