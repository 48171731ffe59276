"""The layer stack (attnres_jax/nn/stack.py) on a toy layer: the layer contract
(nn/layer_contract.py) is checked before anything is built, and the scanned stack
equals an unrolled Python loop over the layers, forward and gradients."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from attnres_jax.nn import stack
from attnres_jax.residuals.standard import StandardResidual

DIM, NUM_LAYERS = 8, 5
RESIDUAL = StandardResidual(None)  # no parameters: `layers.residual` is None


class ToyLayer(nnx.Module):
  """Two PreNorm sublayers, each tanh(norm(h) W): the stack's whole contract."""

  def __init__(self, dim: int, *, rngs: nnx.Rngs):
    init = nnx.initializers.normal(stddev=dim**-0.5)
    self.w = nnx.Param(init(rngs.params(), (2, dim, dim)))

  def sublayer_norm(self, which, h_BTD):
    del which
    return h_BTD * jax.lax.rsqrt(jnp.mean(h_BTD * h_BTD, axis=-1, keepdims=True) + 1e-6)

  def sublayer_body(self, which, normed_BTD, positions_BT):
    del positions_BT
    return jnp.tanh(normed_BTD @ self.w[which])


def _stack_config(**overrides):
  """What `run_layers` and the standard residual read of a config."""
  fields = dict(num_layers=NUM_LAYERS, remat='none', scan_layers=True, schedule_layers=2)
  return types.SimpleNamespace(**{**fields, **overrides})


def _run(layers, x_BTD, cfg):
  graphdef, state = nnx.split(layers)
  positions_BT = jnp.broadcast_to(jnp.arange(x_BTD.shape[1]), x_BTD.shape[:2])
  carry, _ = stack.run_layers(
    StandardResidual(cfg), graphdef, state, x_BTD, positions_BT, cfg=cfg
  )
  return carry


def _unrolled(layers, x_BTD):
  """h + f(h) for each sublayer of each layer, a plain Python loop."""
  graphdef, state = nnx.split(layers)
  h_BTD = x_BTD
  for k in range(NUM_LAYERS):
    layer = nnx.merge(graphdef, jax.tree.map(lambda x, k=k: x[k], state))
    for which in (0, 1):
      h_BTD = h_BTD + layer.sublayer_body(which, layer.sublayer_norm(which, h_BTD), None)
  return h_BTD


@pytest.fixture(scope='module')
def layers():
  return stack.make_layers(ToyLayer, NUM_LAYERS, nnx.Rngs(0), DIM, residual=RESIDUAL)


def test_make_layers_stacks_on_a_layers_axis(layers):
  assert layers.w.shape == (NUM_LAYERS, 2, DIM, DIM)
  # Each layer from its own split of the rngs: no two alike.
  assert not np.allclose(layers.w[0], layers.w[1])


@pytest.mark.parametrize('remat', ['none', 'layer', 'sublayer'])
@pytest.mark.parametrize('schedule_layers', [1, 2])
def test_scanned_equals_unrolled_loop(layers, remat, schedule_layers):
  """Segments of 2 over 5 layers leave a shorter last segment (after the scan)."""
  x_BTD = jax.random.normal(jax.random.key(1), (2, 3, DIM))
  cfg = _stack_config(remat=remat, schedule_layers=schedule_layers)
  expected = _unrolled(layers, x_BTD)
  scanned = jax.jit(lambda x: _run(layers, x, cfg))(x_BTD)
  looped = _run(layers, x_BTD, _stack_config(scan_layers=False))
  np.testing.assert_allclose(scanned, expected, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(looped, expected, rtol=1e-5, atol=1e-5)


def test_scanned_gradients_equal_unrolled_loop(layers):
  x_BTD = jax.random.normal(jax.random.key(2), (2, 3, DIM))
  graphdef, state = nnx.split(layers)
  cfg = _stack_config()

  def loss(state, run):
    return jnp.sum(jnp.sin(run(nnx.merge(graphdef, state), x_BTD)))

  scanned = jax.grad(loss)(state, lambda m, x: _run(m, x, cfg))
  looped = jax.grad(loss)(state, _unrolled)
  for a, b in zip(jax.tree.leaves(scanned), jax.tree.leaves(looped)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize('missing', stack.LAYER_METHODS)
def test_a_layer_without_a_contract_method_is_refused_before_it_is_built(missing):
  built = []

  class Incomplete(ToyLayer):
    def __init__(self, dim, *, rngs):
      built.append(True)
      super().__init__(dim, rngs=rngs)

  setattr(Incomplete, missing, None)
  with pytest.raises(TypeError, match=f"no method '{missing}'.*layer_contract.py"):
    stack.make_layers(Incomplete, NUM_LAYERS, nnx.Rngs(0), DIM, residual=RESIDUAL)
  assert not built  # refused before the constructor ran (no trace)


def test_a_layer_that_sets_the_residual_attribute_is_refused():
  class OwnResidual(ToyLayer):
    def __init__(self, dim, *, rngs):
      super().__init__(dim, rngs=rngs)
      self.residual = None

  with pytest.raises(TypeError, match='sets an attribute named residual'):
    stack.make_layers(OwnResidual, NUM_LAYERS, nnx.Rngs(0), DIM, residual=RESIDUAL)
