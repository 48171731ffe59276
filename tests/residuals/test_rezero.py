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


def test_alphas_scale_each_sublayer():
  rezero, standard = _model('rezero'), _model('standard')
  # The same sublayer weights (both models draw them from one seed).
  shared = nnx.state(standard.layers)
  for path, value in jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(shared)):
    keys = [k.key for k in path]
    got = nnx.to_pure_dict(nnx.state(rezero.layers))
    for key in keys:
      got = got[key]
    np.testing.assert_array_equal(got, value)
  # Alphas of 1: the standard residual, to float32 rounding.
  rezero.layers.residual.alpha[...] = jnp.ones((3, 2))
  np.testing.assert_allclose(rezero(TOKENS), standard(TOKENS), rtol=1e-6, atol=1e-6)
  # One sublayer's alpha alone moves the output, linearly in alpha.
  rezero.layers.residual.alpha[...] = jnp.zeros((3, 2))
  base = rezero(TOKENS)
  outputs = []
  for alpha in (1e-3, 2e-3):
    rezero.layers.residual.alpha[...] = jnp.zeros((3, 2)).at[1, 0].set(alpha)
    outputs.append(rezero(TOKENS) - base)
  assert np.max(np.abs(outputs[0])) > 1e-5
  np.testing.assert_allclose(outputs[1], 2 * outputs[0], rtol=1e-2, atol=1e-6)


def test_alphas_are_spared_weight_decay():
  cfg = tiny_model_config(residual='rezero')
  _, params = nnx.split(_model('rezero'))
  mask = optim.decay_mask(nnx.to_pure_dict(params), cfg)
  assert not mask['layers']['residual']['alpha']
  assert mask['layers']['attention']['query'] and mask['layers']['mlp']['up']
