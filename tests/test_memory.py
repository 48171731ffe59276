"""The linear-memory backward pass equals plain autodiff; its memory is linear in depth."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import attnres_jax as ar
from attnres_jax import depth

TINY = dict(d_model=32, num_heads=2, mlp_dim=64, num_layers=3)


def random_model(residual, block_size, **overrides):
  cfg = ar.model_config(**{**TINY, 'residual': residual, 'block_size': block_size,
                           **overrides})
  model = ar.Transformer(cfg, rngs=nnx.Rngs(0))
  keys = jax.random.split(jax.random.key(1), 2)
  model.layers.depth_query[...] = jax.random.normal(keys[0], (3, 2, 32))
  model.layers.depth_gain[...] = 1 + 0.3 * jax.random.normal(keys[1], (3, 2, 32))
  return model


def gradients(model, **cfg_changes):
  for name, value in cfg_changes.items():
    setattr(model.cfg, name, value)
  x = jax.random.randint(jax.random.key(2), (2, 12), 0, 256)
  graphdef, state = nnx.split(model)

  @jax.jit
  def grad_fn(state):
    return jax.grad(lambda s: jnp.mean(nnx.merge(graphdef, s)(x) ** 2))(state)

  return grad_fn(state)


def assert_grads_close(actual, expected):
  # The two backward passes sum the same float32 terms in different orders (and the
  # depth read's VJP is written by hand): differences of a few ulps of the largest
  # gradient entry of each parameter.
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(actual),
                          jax.tree.leaves(expected)):
    scale = float(jnp.abs(b).max()) + 1e-30
    np.testing.assert_allclose(a / scale, b / scale, atol=5e-5, err_msg=str(path))


@pytest.mark.parametrize('residual,block_size,remat', [
    ('full', 1, 'none'), ('block', 2, 'none'), ('block', 3, 'none'),
    ('block', 4, 'none'), ('block', 6, 'none'),  # S = L: a single block
    ('block', 3, 'sublayer'), ('block', 3, 'layer'), ('full', 1, 'layer')])
def test_linear_memory_backward_equals_plain_autodiff(residual, block_size, remat):
  model = random_model(residual, block_size)
  plain = gradients(model, linear_memory_backward=False, remat='none')
  linear = gradients(model, linear_memory_backward=True, remat=remat)
  assert_grads_close(linear, plain)


def test_bfloat16_linear_memory_backward_is_close_to_plain():
  model = random_model('block', 2, dtype='bfloat16')
  plain = gradients(model, linear_memory_backward=False)
  linear = gradients(model, linear_memory_backward=True)
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(linear),
                          jax.tree.leaves(plain)):
    scale = float(jnp.abs(b).max()) + 1e-30
    # bfloat16 activations (8 mantissa bits): both passes round intermediate
    # cotangents differently, up to a few bf16 ulps (2^-8) of the largest entry.
    np.testing.assert_allclose(a / scale, b / scale, atol=3e-2, err_msg=str(path))


@pytest.mark.parametrize('with_partial', [False, True])
def test_read_backward_by_hand_equals_autodiff(with_partial):
  keys = jax.random.split(jax.random.key(3), 6)
  scales = jnp.geomspace(1e-3, 1e3, 5)[:, None, None, None]
  buffer = scales * jax.random.normal(keys[0], (5, 2, 3, 16))
  partial = 10 * jax.random.normal(keys[1], (2, 3, 16)) if with_partial else None
  query = jax.random.normal(keys[2], (16,))
  gain = 1 + 0.3 * jax.random.normal(keys[3], (16,))
  d_h = jax.random.normal(keys[4], (2, 3, 16))
  kwargs = dict(eps=1e-6, num_valid=3, partial_BTD=partial, partial_valid=True)

  def read(buffer, partial, query, gain):
    return depth.read_parts(buffer, query, gain, **{**kwargs, 'partial_BTD': partial})[0]

  _, vjp = jax.vjp(read, buffer, partial, query, gain)
  expected = vjp(d_h)
  _, statistics = depth.read_parts(buffer, query, gain, **kwargs)
  actual = depth.read_parts_backward(buffer, query, gain, statistics, d_h, partial)
  for a, b in zip(actual, expected):
    if b is None:
      assert a is None
      continue
    # float32; sources span 1e-3..1e3, so compare relative to each tensor's largest.
    np.testing.assert_allclose(a, b, atol=1e-5 * float(jnp.abs(b).max()), rtol=1e-5)
  np.testing.assert_array_equal(actual[0][3:], 0.0)  # unread slots get no gradient


def compiled_temp_bytes(residual, block_size, num_layers, linear):
  cfg = ar.model_config(d_model=32, num_heads=2, mlp_dim=64, num_layers=num_layers,
                        residual=residual, block_size=block_size,
                        linear_memory_backward=linear)
  model = ar.Transformer(cfg, rngs=nnx.Rngs(0))
  graphdef, state = nnx.split(model)
  x = jnp.zeros((4, 64), jnp.int32)
  grad_fn = jax.jit(jax.grad(lambda s: jnp.mean(nnx.merge(graphdef, s)(x))))
  return grad_fn.lower(state).compile().memory_analysis().temp_size_in_bytes


def test_full_attnres_memory_grows_linearly_in_depth():
  """Doubling the depth at most doubles the extra memory over the standard model
  with the custom backward pass, while plain autodiff grows quadratically."""
  standard = {layers: compiled_temp_bytes('standard', 1, layers, False)
              for layers in (8, 16)}
  extra = {(linear, layers): compiled_temp_bytes('full', 1, layers, linear)
           - standard[layers] for linear in (True, False) for layers in (8, 16)}
  # Linear: extra(2L) / extra(L) ~ 2. Quadratic: ~ 4 at large L.
  assert extra[True, 16] / extra[True, 8] < 2.3, extra
  assert extra[False, 16] / extra[False, 8] > 3.0, extra
  assert extra[True, 16] < 0.5 * extra[False, 16], extra
