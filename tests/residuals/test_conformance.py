"""The conformance check (`attnres_jax.testing.check_residual`, docs/extending.md) for
every residual registered when this module is collected: the library's (and any that a
test module collected before it registers). The parts that run in this process for all;
the pipeline, a 2-device child process each, for one AttnRes mode here and for the toy
residual and ReZero in test_residual.py, which checks those two whole. And the check
fails, naming the fault, on residuals that are wrong in one way each."""

import dataclasses

import jax.numpy as jnp
import pytest
from flax import nnx

from attnres_jax import config as config_lib
from attnres_jax import residuals
from attnres_jax import testing
from attnres_jax.models import transformer as model_lib
from attnres_jax.residuals import base, rezero
from attnres_jax.testing import conformance

PIPELINED = ('block',)
CHECKED_WHOLE_ELSEWHERE = ('gated', 'rezero')  # test_residual.py


@pytest.mark.parametrize(
  'name', [n for n in residuals.names() if n not in CHECKED_WHOLE_ELSEWHERE]
)
def test_every_registered_residual_passes_the_conformance_check(name):
  parts = [p for p in testing.PARTS if p != 'pipeline' or name in PIPELINED]
  report = testing.check_residual(name, parts=parts)
  assert set(report) == {'residual', *parts}
  if name in PIPELINED:
    assert 'refused' not in report['pipeline']


# -- the check fails where a residual is wrong ----------------------------------------


@dataclasses.dataclass(frozen=True)
class ZeroFlops(rezero.ReZeroResidual):
  def forward_flops(self):
    return 0.0  # its multiplies, uncounted


@dataclasses.dataclass(frozen=True)
class FlatCarryAxes(rezero.ReZeroResidual):
  def carry_axes(self):
    return ('batch', 'embed')  # the carry is [B, T, D]


class ScalesAndAnUnused(rezero.ReZeroScales):
  def __init__(self, cfg):
    super().__init__(cfg)
    self.unused = base.param(jnp.ones, (2,), ('sublayers',), jnp.float32)


@dataclasses.dataclass(frozen=True)
class UnusedParameter(rezero.ReZeroResidual):
  def layer_params(self):
    return ScalesAndAnUnused(self.cfg)


@dataclasses.dataclass(frozen=True)
class ReadsLaterTokens(rezero.ReZeroResidual):
  """Adds the mean over the sequence: each position sees later ones, which a cached
  step does not have."""

  def write(self, inner, params, per_layer, layer_in_segment, which, out_BTD):
    return inner + out_BTD + jnp.mean(inner, axis=1, keepdims=True)


@pytest.mark.parametrize(
  'residual,parts,message',
  [
    (ZeroFlops, ['declarations'], r'forward_flops\(\) = 0.0 per token, XLA counts 128'),
    (FlatCarryAxes, ['declarations'], 'carry_axes'),
    (UnusedParameter, ['train'], r"does not reach \['layers/residual/unused'\]"),
  ],
  ids=['flops', 'carry_axes', 'unused_parameter'],
)
def test_the_check_names_what_a_wrong_residual_gets_wrong(residual, parts, message):
  with pytest.raises(testing.ConformanceError, match=message):
    testing.check_residual(residual, parts=parts)


def test_the_check_finds_a_cache_that_differs_from_the_full_pass():
  name = testing.residual_name(ReadsLaterTokens)
  assert name == 'test_conformance:ReadsLaterTokens'  # registered as a plug-in
  cfg = config_lib.model_config(**testing.MODEL, residual=name)
  model = model_lib.Transformer(cfg, rngs=nnx.Rngs(0))
  with pytest.raises(testing.ConformanceError, match='cached decoding differs'):
    conformance.check_decoding(model)
