"""The paper's ablations of the depth read compute what they claim."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import attnres_jax as ar
from attnres_jax.residuals.attnres import depth
from attnres_jax.residuals.attnres import reads as residual

D = 16


def sources(seed=0, count=6):
  keys = jax.random.split(jax.random.key(seed), count)
  return jnp.stack(
    [(i + 1) * jax.random.normal(k, (2, 3, D)) for i, k in enumerate(keys)]
  )


def config(**variant):
  variant = {'residual': 'full', **variant}  # the ablations read in one shot
  return ar.model_config(d_model=D, num_heads=2, mlp_dim=32, num_layers=2, **variant)


QUERY = jax.random.normal(jax.random.key(7), (D,))
GAIN = 1 + 0.3 * jax.random.normal(jax.random.key(8), (D,))


def test_defaults_are_the_paper_read():
  buffer = sources()
  h, w = depth.attn_res_read_variant(buffer, QUERY, GAIN, eps=1e-6, num_valid=4)
  h_ref, w_ref = depth.attn_res_read(buffer, QUERY, GAIN, eps=1e-6, num_valid=4)
  np.testing.assert_allclose(h, h_ref, rtol=1e-5, atol=1e-5)  # float32 reassociation
  np.testing.assert_allclose(w, w_ref, rtol=1e-5, atol=1e-7)


def test_kept_inverse_rms_is_the_recomputed_one():
  buffer = sources()
  inv_rms = depth.rms_inverse(buffer, 1e-6)
  for variant in (dict(), dict(normalizer='sigmoid'), dict(window=2)):
    with_kept = depth.attn_res_read_variant(
      buffer, QUERY, GAIN, eps=1e-6, num_valid=5, inv_rms_KBT=inv_rms, **variant
    )
    recomputed = depth.attn_res_read_variant(
      buffer, QUERY, GAIN, eps=1e-6, num_valid=5, **variant
    )
    np.testing.assert_allclose(with_kept[0], recomputed[0], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize('residual,block_size', [('full', 1), ('block', 3)])
def test_variant_path_is_the_paper_model_when_it_changes_nothing(residual, block_size):
  # A window wider than the depth keeps every source: the variant machinery (generic
  # read, inverse RMS from the carry) must then compute the paper's model.
  paper = config(residual=residual, block_size=block_size)
  wide = config(residual=residual, block_size=block_size, depth_window=64)
  x = jax.random.randint(jax.random.key(4), (2, 8), 0, 256)
  model = ar.Transformer(paper, rngs=nnx.Rngs(0))
  # The paper's read in one shot too (the test-only reference), as the variant reads.
  model.residual = dataclasses.replace(model.residual, one_shot=True)
  keys = jax.random.split(jax.random.key(1), 2)  # reads far from uniform
  model.layers.residual.query[...] = jax.random.normal(
    keys[0], model.layers.residual.query.shape
  )
  model.layers.residual.gain[...] += 0.5 * jax.random.normal(
    keys[1], model.layers.residual.gain.shape
  )
  graphdef, state = nnx.split(model)
  wide_model = nnx.merge(nnx.graphdef(ar.Transformer(wide, rngs=nnx.Rngs(0))), state)
  # float32 reassociation between the two reads' reductions, through 4 sublayers.
  np.testing.assert_allclose(wide_model(x), model(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize('num_valid', [1, 2, 4, 6])
def test_window_never_weights_sources_outside_it(num_valid):
  cfg = config(depth_window=2)
  h, w = residual.read_one_shot(cfg, sources(), num_valid, QUERY, GAIN)
  allowed = {0} | set(range(max(num_valid - 2, 0), num_valid))
  for s in range(6):
    if s in allowed:
      assert jnp.all(w[s] > 0), s
    else:
      np.testing.assert_array_equal(w[s], 0.0)
  # It is the ordinary read over exactly those sources.
  chosen = sorted(allowed)
  h_ref, _ = depth.attn_res_read(sources()[jnp.array(chosen)], QUERY, GAIN, eps=1e-6)
  np.testing.assert_allclose(h, h_ref, rtol=1e-5, atol=1e-5)


def test_scalar_mixing_weights_do_not_depend_on_the_input():
  cfg = config(depth_mixing='scalars')
  mixing = jnp.array([0.5, -1.0, 2.0, 3.0, 7.0, 9.0])
  _, w1 = residual.read_one_shot(cfg, sources(0), 4, QUERY, GAIN, None, mixing)
  h2, w2 = residual.read_one_shot(cfg, sources(1), 4, QUERY * 3, GAIN, None, mixing)
  np.testing.assert_array_equal(w1, w2)
  np.testing.assert_allclose(w1[:, 0, 0], [0.5, -1.0, 2.0, 3.0, 0.0, 0.0])
  expected = jnp.einsum('s,sbtd->btd', mixing[:4], sources(1)[:4])
  np.testing.assert_allclose(h2, expected, rtol=1e-5, atol=1e-5)


def test_scalar_mixing_model_weights_are_the_same_for_every_input():
  model = ar.Transformer(config(depth_mixing='scalars'), rngs=nnx.Rngs(0))
  model.layers.residual.mix[...] = jax.random.normal(
    jax.random.key(1), model.layers.residual.mix[...].shape
  )
  x1 = jax.random.randint(jax.random.key(2), (2, 8), 0, 256)
  x2 = jax.random.randint(jax.random.key(3), (2, 8), 0, 256)
  _, stats1 = model(x1, collect_stats=True)
  _, stats2 = model(x2, collect_stats=True)
  np.testing.assert_array_equal(stats1['depth_weights'], stats2['depth_weights'])


def numpy_logits(buffer, query, gain, key_norm):
  v = np.asarray(buffer, np.float64)
  logits = np.sum(np.asarray(query * gain, np.float64) * v, axis=-1)
  if key_norm:
    logits /= np.sqrt(np.mean(v**2, axis=-1) + 1e-6)
  return logits


def test_sigmoid_weights_are_independent_per_source():
  cfg = config(depth_normalizer='sigmoid')
  buffer = sources()
  h, w = residual.read_one_shot(cfg, buffer, 5, QUERY, GAIN)
  expected = 1 / (1 + np.exp(-numpy_logits(buffer, QUERY, GAIN, True)))
  expected[5:] = 0.0
  np.testing.assert_allclose(w, expected, rtol=1e-5, atol=1e-6)
  assert not np.allclose(np.asarray(w).sum(0), 1.0)  # not normalised over sources
  np.testing.assert_allclose(
    h, np.einsum('sbt,sbtd->btd', expected, buffer), rtol=1e-4, atol=1e-4
  )


def test_no_key_norm_uses_raw_sources():
  cfg = config(depth_key_norm=False)
  buffer = sources() * 0.01  # raw logits must stay moderate for a meaningful softmax
  _, w = residual.read_one_shot(cfg, buffer, 6, QUERY, GAIN)
  logits = numpy_logits(buffer, QUERY, GAIN, False)
  expected = np.exp(logits - logits.max(0))
  expected /= expected.sum(0)
  np.testing.assert_allclose(w, expected, rtol=1e-5, atol=1e-6)


def test_input_dependent_query_reads_the_latest_source():
  cfg = config(depth_query_input=True)
  buffer = sources()
  projection = 0.3 * jax.random.normal(jax.random.key(9), (D, D))
  _, w = residual.read_one_shot(cfg, buffer, 4, QUERY, GAIN, projection)
  latest = np.asarray(buffer[3], np.float64)
  latest /= np.sqrt(np.mean(latest**2, axis=-1, keepdims=True) + 1e-6)
  query_bt = np.asarray(QUERY, np.float64) + latest @ np.asarray(
    projection, np.float64
  ) / np.sqrt(D)
  v = np.asarray(buffer[:4], np.float64)
  logits = np.sum(query_bt * np.asarray(GAIN) * v, -1) / np.sqrt(np.mean(v**2, -1) + 1e-6)
  expected = np.exp(logits - logits.max(0))
  expected /= expected.sum(0)
  np.testing.assert_allclose(w[:4], expected, rtol=1e-4, atol=1e-6)
  # The weights now differ from token to token.
  assert float(jnp.std(w[1])) > 1e-3
  # A zero projection is the static query.
  _, w_static = residual.read_one_shot(cfg, buffer, 4, QUERY, GAIN, jnp.zeros((D, D)))
  _, w_paper = depth.attn_res_read(buffer, QUERY, GAIN, eps=1e-6, num_valid=4)
  np.testing.assert_allclose(w_static, w_paper, rtol=1e-5, atol=1e-7)


def test_multihead_weights_are_per_channel_group():
  cfg = config(depth_heads=4)
  buffer = sources()
  h, _ = residual.read_one_shot(cfg, buffer, 5, QUERY, GAIN)
  group = D // 4
  for g in range(4):
    channels = slice(g * group, (g + 1) * group)
    # Each group is an ordinary read of its own channels (its own key RMSNorm).
    h_group, _ = depth.attn_res_read(
      buffer[..., channels], QUERY[channels], GAIN[channels], eps=1e-6, num_valid=5
    )
    np.testing.assert_allclose(h[..., channels], h_group, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
  'variant',
  [
    dict(depth_query_input=True),
    dict(depth_normalizer='sigmoid'),
    dict(depth_key_norm=False),
    dict(depth_mixing='scalars'),
    dict(depth_window=1),
    dict(depth_heads=2),
  ],
)
@pytest.mark.parametrize('residual', ['block'])  # S=3: partial sums and boundaries
def test_every_variant_has_finite_gradients_reaching_its_parameters(variant, residual):
  cfg = config(**variant).replace(residual=residual, block_size=3)
  model = ar.Transformer(cfg, rngs=nnx.Rngs(0))
  x = jax.random.randint(jax.random.key(4), (2, 8), 0, 256)
  graphdef, state = nnx.split(model)
  loss = lambda s: jnp.mean(jax.nn.log_softmax(nnx.merge(graphdef, s)(x))[..., 0])
  grads = jax.jit(jax.grad(loss))(state)
  assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(grads))
  if 'depth_query_input' in variant:  # the projection learns from step 0
    assert float(jnp.abs(grads['layers']['residual']['query_proj'][...]).max()) > 0
  if 'depth_mixing' in variant:
    assert float(jnp.abs(grads['layers']['residual']['mix'][...]).max()) > 0


@pytest.mark.parametrize(
  'overrides,message',
  [
    (dict(depth_window=2, depth_kernel='pallas'), 'ablations .* read in one shot'),
    (dict(depth_heads=3), 'depth_heads'),
    (dict(depth_normalizer='relu'), 'depth_normalizer'),
    (dict(depth_window=-1), 'depth_window'),
    # The execution fields that became automatic rules name what replaced them.
    (dict(depth_read='two_phase'), 'depth_read is no longer a field: the read follows'),
    (dict(depth_read_prefixes=2), 'depth_read_prefixes is no longer a field: an intern'),
    (dict(phase1_backward='keep'), 'phase1_backward is no longer a field: an internal'),
  ],
)
def test_ablation_config_errors(overrides, message):
  with pytest.raises(ValueError, match=message):
    config(**overrides)
