"""ReZero (`residuals/rezero.py`): h <- h + alpha * f(h), alpha per sublayer from 0.

Its conformance check (training, evaluation, decoding, FLOPs, the pipeline) runs in
test_residual.py with the toy residual's; here, what the residual computes."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from attnres_jax.models import transformer as model_lib
from attnres_jax.training import optim
from conftest import tiny_model_config

TOKENS = jnp.asarray(np.random.default_rng(0).integers(0, 256, (2, 6)), jnp.int32)


def _model(residual):
  return model_lib.Transformer(tiny_model_config(residual=residual), rngs=nnx.Rngs(0))


def test_every_layer_starts_as_the_identity():
  model = _model('rezero')
  assert model.layers.residual.alpha.shape == (3, 2)  # [layers, sublayers]
  assert not np.any(model.layers.residual.alpha[...])
  assert model.final_residual is None
  # Zero alphas: the final norm reads the embedding itself.
  expected = model.head(model.embed(TOKENS))
  np.testing.assert_array_equal(model(TOKENS), expected)


def test_each_sublayer_is_scaled_by_its_alpha():
  model = _model('rezero')
  alphas = jax.random.uniform(jax.random.key(1), (3, 2), minval=-1.0, maxval=1.0)
  model.layers.residual.alpha[...] = alphas
  # By hand: the layers one at a time, h <- h + alpha * f(h).
  graphdef, layer_state = nnx.split(model.layers)
  positions = jnp.broadcast_to(jnp.arange(TOKENS.shape[1]), TOKENS.shape)
  h = model.embed(TOKENS)
  for k in range(3):
    layer = nnx.merge(graphdef, jax.tree.map(lambda x, k=k: x[k], layer_state))
    for which in (0, 1):
      h = h + alphas[k, which] * layer.sublayer(which, h, positions)
  # float32, 6 sublayers; the stack's scan fuses the same operations differently.
  np.testing.assert_allclose(model(TOKENS), model.head(h), rtol=1e-5, atol=1e-5)
  # Alphas of 1: the standard residual over the same sublayers (one seed draws both).
  standard = _model('standard')
  model.layers.residual.alpha[...] = jnp.ones((3, 2))
  np.testing.assert_allclose(model(TOKENS), standard(TOKENS), rtol=1e-5, atol=1e-5)


def test_alphas_are_spared_weight_decay():
  cfg = tiny_model_config(residual='rezero')
  _, params = nnx.split(_model('rezero'))
  mask = optim.decay_mask(nnx.to_pure_dict(params), cfg)
  assert not mask['layers']['residual']['alpha']
  assert mask['layers']['attention']['query'] and mask['layers']['mlp']['up']
