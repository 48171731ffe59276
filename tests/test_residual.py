"""The residual interface is the stack's only contact with depth: a toy residual
written here, against the interface alone, runs through the stack."""

import dataclasses

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from flax import nnx

from attnres_jax import residual as residual_lib
from attnres_jax import stack

D, NUM_LAYERS = 8, 5


class Gates(nnx.Module):
  """One learned scalar per sublayer of a layer."""

  def __init__(self):
    self.gate = nnx.Param(jnp.ones(2))


@dataclasses.dataclass(frozen=True)
class GatedResidual(residual_lib.Residual):
  """h <- h + gate * f(h), in segments of 2 layers (5 layers: a shorter last one).

  The carry also counts the sublayers run; each segment hands its gates to its
  layers through `begin_segment`, as AttnRes hands over its Phase 1 statistics.
  """

  segment_layers: int = 2

  def layer_params(self, cfg):
    return Gates()

  def init(self, x_BTD):
    return x_BTD, jnp.int32(0)

  def begin_segment(self, carry, params, segment):
    return carry, params.gate[...]  # [G, 2]: the stack hands each layer its row

  def read(self, inner, params, per_layer, layer_in_segment, which):
    return inner[0], None

  def write(self, inner, params, per_layer, layer_in_segment, which, out_BTD):
    h_BTD, count = inner
    return h_BTD + per_layer[which] * out_BTD, count + 1

  def final(self, carry, params):
    return carry[0], None


class ToyLayer(nnx.Module):
  """A layer in the shape the stack expects: `sublayer(which, h, positions)` and the
  residual's parameters as `residual`."""

  def __init__(self, residual, rngs):
    self.weights = nnx.Param(jax.random.normal(rngs.params(), (2, D, D)) / D ** 0.5)
    self.residual = residual.layer_params(None)

  def sublayer(self, which, h_BTD, positions_BT):
    del positions_BT
    return jnp.tanh(h_BTD @ self.weights[...][which])


@pytest.mark.parametrize('scan_layers', [True, False])
@pytest.mark.parametrize('remat', ['none', 'layer'])
def test_a_residual_written_against_the_interface_runs_through_the_stack(scan_layers,
                                                                         remat):
  residual = GatedResidual()

  @nnx.vmap(in_axes=0, out_axes=0)
  def make_layers(rngs):
    return ToyLayer(residual, rngs)

  layers = make_layers(nnx.Rngs(0).split(NUM_LAYERS))
  gates = jnp.arange(2 * NUM_LAYERS, dtype=jnp.float32).reshape(NUM_LAYERS, 2) / 10
  layers.residual.gate[...] = gates
  cfg = ml_collections.ConfigDict(dict(num_layers=NUM_LAYERS, scan_layers=scan_layers,
                                       remat=remat))
  x = jax.random.normal(jax.random.key(1), (2, 3, D))
  positions = jnp.zeros((2, 3), jnp.int32)
  graphdef, state = nnx.split(layers)

  def run(state):
    (h, count), _ = stack.run_layers(residual, graphdef, state, x, positions, cfg=cfg)
    return h, count

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
