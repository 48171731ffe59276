"""A residual is one class and one registry line: a toy residual written here, against
the interface alone, and registered here, runs through the stack, trains through
`Transformer` and the library's train step, evaluates, analyses, decodes, counts its
FLOPs and runs under the pipeline, with no edit to the library.

The whole library runs by the conformance check (`attnres_jax.testing.check_residual`,
docs/extending.md), for the toy, ReZero and every registered residual; its pipeline
part runs in a child process with 2 simulated devices (as test_pipeline.py's).
"""

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from flax import nnx

from attnres_jax import config as config_lib
from attnres_jax import residuals
from attnres_jax import testing
from attnres_jax.nn import sharding
from attnres_jax.nn import stack

D, NUM_LAYERS = 8, 5


class Gates(nnx.Module):
  """One learned scalar per sublayer of a layer (rows: [2])."""

  def __init__(self):
    self.gate = nnx.Param(jnp.ones(2), out_sharding=('sublayers',), eager_sharding=False)


class GatedCarry(NamedTuple):
  h_BTD: jax.Array
  count: jax.Array  # sublayers run so far


@dataclasses.dataclass(frozen=True)
class GatedResidual(residuals.Residual):
  """h <- h + gate * f(h), in segments of 2 layers (5 layers: a shorter last one).

  The carry also counts the sublayers run; each segment hands its gates to its
  layers through `begin_segment`, as AttnRes hands over its Phase 1 statistics.
  """

  cfg: Any
  segment_layers: int = 2
  no_decay = frozenset({'gate'})

  def layer_params(self):
    return Gates()

  def init(self, x_BTD):
    return GatedCarry(x_BTD, jnp.zeros((), jnp.int32))

  def begin_segment(self, carry, params, segment):
    return carry, params.gate[...]  # [G, 2]: the stack hands each layer its row

  def read(self, inner, params, per_layer, layer_in_segment, which):
    return inner.h_BTD, None

  def write(self, inner, params, per_layer, layer_in_segment, which, out_BTD):
    h_BTD = inner.h_BTD + per_layer[which].astype(out_BTD.dtype) * out_BTD
    return GatedCarry(h_BTD, inner.count + 1)

  def final(self, carry, params):
    return carry.h_BTD, None

  def forward_flops(self):
    return 2.0 * self.cfg.d_model * 2 * self.cfg.num_layers  # a multiply-add per channel

  def io_per_sublayer(self):
    return 2.0, 1.0

  def carry_axes(self):
    return GatedCarry(sharding.HIDDEN, ())


residuals.register('gated', GatedResidual)  # the one registry line

MODEL = dict(
  vocab_size=64, d_model=16, num_layers=4, num_heads=2, mlp_dim=32, residual='gated'
)


# -- the interface alone, through the stack -------------------------------------------


class ToyLayer(nnx.Module):
  """A layer in the shape the stack expects (`nn/layer_contract.py`): `sublayer_norm`,
  `sublayer_body` and the residual's parameters as `residual`."""

  def __init__(self, residual, rngs):
    self.weights = nnx.Param(jax.random.normal(rngs.params(), (2, D, D)) / D**0.5)
    self.residual = residual.layer_params()

  def sublayer_norm(self, which, h_BTD):
    return h_BTD  # no PreNorm

  def sublayer_body(self, which, normed_BTD, positions_BT):
    del positions_BT
    return jnp.tanh(normed_BTD @ self.weights[...][which])


@pytest.mark.parametrize('scan_layers', [True, False])
@pytest.mark.parametrize('remat', ['none', 'layer'])
def test_a_residual_written_against_the_interface_runs_through_the_stack(
  scan_layers, remat
):
  cfg = ml_collections.ConfigDict(
    dict(num_layers=NUM_LAYERS, scan_layers=scan_layers, remat=remat)
  )
  residual = GatedResidual(cfg)

  @nnx.vmap(in_axes=0, out_axes=0)
  def make_layers(rngs):
    return ToyLayer(residual, rngs)

  layers = make_layers(nnx.Rngs(0).split(NUM_LAYERS))
  gates = jnp.arange(2 * NUM_LAYERS, dtype=jnp.float32).reshape(NUM_LAYERS, 2) / 10
  layers.residual.gate[...] = gates
  x = jax.random.normal(jax.random.key(1), (2, 3, D))
  positions = jnp.zeros((2, 3), jnp.int32)
  graphdef, state = nnx.split(layers)

  def run(state):
    carry, _ = stack.run_layers(residual, graphdef, state, x, positions, cfg=cfg)
    return carry.h_BTD, carry.count

  h, count = jax.jit(run)(state)
  expected = x
  weights = layers.weights[...]
  for k in range(NUM_LAYERS):
    for which in (0, 1):
      expected = expected + gates[k, which] * jnp.tanh(expected @ weights[k, which])
  assert int(count) == 2 * NUM_LAYERS
  np.testing.assert_allclose(h, expected, rtol=1e-5, atol=1e-5)  # float32, 10 steps
  # Gradients flow to the residual's own parameters through the stack.
  grads = jax.grad(lambda s: jnp.sum(run(s)[0]))(state)
  assert grads['residual']['gate'][...].shape == (NUM_LAYERS, 2)
  assert bool(jnp.all(grads['residual']['gate'][...] != 0))


# -- registered: the whole library, by the conformance check ---------------------------


def test_a_registered_residual_runs_through_the_library():
  """Training through `Transformer` and the library's train step, evaluation with the
  analysis statistics, decoding, FLOPs and a 2-stage pipeline equal to one device
  (`attnres_jax.testing.check_residual`; the pipeline in a 2-device child process)."""
  with pytest.raises(ValueError, match="'gated'"):  # the error lists the new mode
    config_lib.model_config(**{**MODEL, 'residual': 'gate'})
  assert testing.MODEL == {k: v for k, v in MODEL.items() if k != 'residual'}
  report = testing.check_residual(GatedResidual)
  assert report['residual'] == 'gated'  # found under its registered name
  # Its gates are spared weight decay (declared), and the loss reaches them.
  assert report['train']['spared_decay'] == ['gate']
  assert report['train']['residual_params'] == ['layers/residual/gate']
  # FLOPs: the residual's declared arithmetic is the depth-read term.
  assert report['declarations']['forward_flops'] == 2.0 * 16 * 8
  assert report['declarations']['io_per_sublayer'] == (2.0, 1.0)
  assert 'refused' not in report['pipeline']


def test_rezero_passes_the_conformance_check():
  report = testing.check_residual('rezero')
  assert report['train']['spared_decay'] == ['alpha']
  assert report['declarations']['forward_flops'] == 16 * 2 * 4  # d per sublayer
  assert 'refused' not in report['pipeline']
