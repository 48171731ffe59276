"""Two-phase Block AttnRes (paper, Algorithm 1) equals the one-shot read."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import attnres_jax as ar
from attnres_jax import depth

TINY = dict(d_model=32, num_heads=2, mlp_dim=64, num_layers=3)
NUM_SUBLAYERS = 2 * TINY['num_layers']
BLOCK_SIZES = [1, 2, 3, 4, NUM_SUBLAYERS]


def spread_sources(key, count, shape, low=1e-3, high=1e3):
  """Sources whose magnitudes span `high / low` (1e6 by default)."""
  keys = jax.random.split(key, count)
  scales = np.geomspace(low, high, count)
  return jnp.stack([s * jax.random.normal(k, shape) for k, s in zip(keys, scales)])


@pytest.mark.parametrize('block_size', BLOCK_SIZES)
@pytest.mark.parametrize('dtype', [jnp.float32, jnp.bfloat16])
def test_phases_equal_the_one_shot_read(block_size, dtype):
  """Every sublayer of a block: phase 1 on the completed blocks, phase 2 on the
  partial sum, against one read over [completed blocks, partial sum]."""
  keys = jax.random.split(jax.random.key(block_size), 4)
  completed = 3  # b_0 .. b_2
  buffer = spread_sources(keys[0], 5, (2, 3, 16)).astype(dtype)
  queries = jax.random.normal(keys[1], (block_size, 16))
  gains = 1 + 0.3 * jax.random.normal(keys[2], (block_size, 16))
  phase1 = depth.block_phase1(buffer, queries, gains, eps=1e-6, num_valid=completed)
  partial = jnp.zeros((2, 3, 16), dtype)
  outputs = spread_sources(keys[3], block_size, (2, 3, 16), 1e-2, 1e4).astype(dtype)
  for i in range(block_size):
    mine = jax.tree.map(lambda x: x[i], phase1)
    h = depth.block_phase2(mine, partial, queries[i], gains[i], eps=1e-6,
                           partial_valid=i > 0)
    sources = buffer[:completed]
    if i > 0:
      sources = jnp.concatenate([sources, partial[None]])
    h_ref, _ = depth.attn_res_read(sources, queries[i], gains[i], eps=1e-6)
    assert h.dtype == dtype
    # Both are float32 internally; only the order of summation differs (a few ulps of
    # the largest source), plus the final cast for bfloat16 (2^-8 relative).
    tolerance = 2 ** -8 if dtype == jnp.bfloat16 else 1e-6
    np.testing.assert_allclose(np.asarray(h, np.float32), np.asarray(h_ref, np.float32),
                               atol=tolerance * float(jnp.abs(sources).max()),
                               rtol=tolerance)
    partial = partial + outputs[i]


def model(block_size, depth_read, spread=True, **overrides):
  cfg = ar.model_config(**{**TINY, 'residual': 'block', 'block_size': block_size,
                           'depth_read': depth_read, **overrides})
  m = ar.Transformer(cfg, rngs=nnx.Rngs(0))
  keys = jax.random.split(jax.random.key(1), 3)
  m.layers.depth_query[...] = jax.random.normal(keys[0], m.layers.depth_query[...].shape)
  m.layers.depth_gain[...] = 1 + 0.3 * jax.random.normal(keys[1],
                                                         m.layers.depth_gain[...].shape)
  # Embeddings 1e3 times larger than usual: sources 1e6 apart in magnitude across
  # depth once the sublayers (outputs O(1)) are added.
  if spread:
    m.embedding[...] = m.embedding[...] * 1e3
  return m


@pytest.mark.parametrize('block_size,linear_memory_backward',
                         [(s, True) for s in BLOCK_SIZES] + [(3, False)])
def test_two_phase_training_forward_and_gradients(block_size, linear_memory_backward):
  x = jax.random.randint(jax.random.key(2), (2, 10), 0, 256)

  def logits_and_grads(depth_read, spread):
    m = model(block_size, depth_read, spread,
              linear_memory_backward=linear_memory_backward)
    graphdef, state = nnx.split(m)
    loss = lambda s: jnp.mean(nnx.merge(graphdef, s)(x) ** 2)
    return jax.jit(lambda s: (nnx.merge(graphdef, s)(x), jax.grad(loss)(s)))(state)

  # Forward with sources 1e6 apart: float32, summation order only (see above), through
  # 6 sublayers and the head; the large (tied) logits are compared to their scale.
  logits, _ = logits_and_grads('two_phase', spread=True)
  logits_ref, _ = logits_and_grads('one_shot', spread=True)
  np.testing.assert_allclose(logits, logits_ref, rtol=2e-5,
                             atol=1e-6 * float(jnp.abs(logits_ref).max()))
  # Gradients at the usual scale (with 1e3 embeddings, mean(logits^2) is so badly
  # conditioned that float32 rounding of the forward pass shows up at 1e-3).
  _, grads = logits_and_grads('two_phase', spread=False)
  _, grads_ref = logits_and_grads('one_shot', spread=False)
  for (path, g), g_ref in zip(jax.tree_util.tree_leaves_with_path(grads),
                              jax.tree.leaves(grads_ref)):
    scale = float(jnp.abs(g_ref).max()) + 1e-30
    np.testing.assert_allclose(g / scale, g_ref / scale, atol=5e-5, err_msg=str(path))


def test_two_phase_bfloat16_model_matches_one_shot():
  x = jax.random.randint(jax.random.key(3), (2, 10), 0, 256)
  logits = model(3, 'two_phase', dtype='bfloat16')(x)
  logits_ref = model(3, 'one_shot', dtype='bfloat16')(x)
  # Same bf16 sublayer arithmetic; the reads differ only inside float32 and are cast
  # to bf16 (2^-8 relative) before each sublayer, which can flip one rounding.
  np.testing.assert_allclose(logits, logits_ref, atol=0.05 * float(jnp.abs(logits_ref).max()))


@pytest.mark.parametrize('block_size', [1, 3, NUM_SUBLAYERS])
def test_cached_two_phase_decoding_equals_recomputation(block_size):
  m = model(block_size, 'two_phase')
  x = jax.random.randint(jax.random.key(4), (2, 12), 0, 256)
  full = m(x)
  cache = m.init_cache(2, 12)
  prompt = 5
  decode = nnx.jit(lambda m, tokens, cache, index: m.decode(tokens, cache, index))
  logits, cache = decode(m, x[:, :prompt], cache, 0)
  scale = float(jnp.abs(full).max())  # large tied logits (see model()); float32
  np.testing.assert_allclose(logits, full[:, :prompt], rtol=2e-5, atol=1e-6 * scale)
  step = nnx.jit(lambda m, tokens, cache, index: m.decode(tokens, cache, index))
  for t in range(prompt, 12):
    logits, cache = step(m, x[:, t:t + 1], cache, jnp.int32(t))
    # Position t from the cache equals position t of the full forward pass.
    np.testing.assert_allclose(logits[:, 0], full[:, t], rtol=2e-5, atol=1e-6 * scale)
