"""The Transformer in every residual mode, against a literal reading of docs/method.md."""

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import attnres_jax as ar
from attnres_jax.residuals.attnres import depth

from conftest import TINY_MODEL as TINY, randomize_depth_params, tiny_model as make_model
from conftest import with_config

NUM_SUBLAYERS = 2 * TINY['num_layers']
MODES = [
  ('standard', 1),
  ('full', 1),
  ('block', 1),
  ('block', 2),
  ('block', 3),
  ('block', 4),
  ('block', NUM_SUBLAYERS),
]
# One mode per code path of the layer scan, for the properties that do not depend on
# where the block boundaries fall (causality, finite gradients): the standard residual,
# Full (Block S = 1 runs the same code: E1 below), a block spanning layers in a single
# segment (S = 3), a partial last block in a shorter last segment (S = 4). Block S = 2
# and S = 6 only move the block boundaries, which the literal-method test checks.
PATHS = [MODES[0], MODES[1], MODES[4], MODES[5]]


def tokens(batch=2, length=12, seed=0):
  return jax.random.randint(jax.random.key(seed), (batch, length), 0, 256)


def layer(model, k):
  graphdef, state = nnx.split(model.layers)
  return nnx.merge(graphdef, jax.tree.map(lambda x: x[k], state))


def reference_read(sources, query, gain, eps):
  """One read over a Python list of sources, written out term by term."""
  logits = []
  for v in sources:
    v = v.astype(jnp.float32)
    key = v / jnp.sqrt(jnp.mean(v * v, axis=-1, keepdims=True) + eps)
    logits.append(jnp.sum((query * gain)[None, None] * key, axis=-1))  # [D] -> [B, T, D]
  weights = jax.nn.softmax(jnp.stack(logits), axis=0)
  return sum(w[..., None] * v.astype(jnp.float32) for w, v in zip(weights, sources))


def reference_logits(model, tokens_BT):
  """The method (docs/method.md) literally: lists of sources, no buffer, no scan."""
  cfg = model.cfg
  positions = jnp.broadcast_to(jnp.arange(tokens_BT.shape[1]), tokens_BT.shape)
  embedding = model.embed(tokens_BT)
  eps = cfg.attn_res_eps
  if cfg.residual == 'standard':
    h = embedding
    for l in range(NUM_SUBLAYERS):
      h = h + layer(model, l // 2).sublayer(l % 2, h, positions)
    return model.head(h)
  if cfg.residual == 'full':
    values = [embedding]  # v_0 = h_1, then the raw output of every sublayer
    for l in range(NUM_SUBLAYERS):
      lay = layer(model, l // 2)
      h = reference_read(
        values, lay.residual.query[...][l % 2], lay.residual.gain[...][l % 2], eps
      )
      values.append(lay.sublayer(l % 2, h, positions))
    final_sources = values
  else:
    size = cfg.block_size
    blocks, partial = [embedding], None  # b_0 .. b_{n-1}, and b_n^i
    for l in range(NUM_SUBLAYERS):
      if l % size == 0 and partial is not None:  # a block boundary: b_n is complete
        blocks.append(partial)
        partial = None
      sources = blocks + ([partial] if partial is not None else [])
      lay = layer(model, l // 2)
      h = reference_read(
        sources, lay.residual.query[...][l % 2], lay.residual.gain[...][l % 2], eps
      )
      out = lay.sublayer(l % 2, h, positions)
      partial = out if partial is None else partial + out
    final_sources = blocks + [partial]
  h = reference_read(
    final_sources, model.final_residual.query[...], model.final_residual.gain[...], eps
  )
  return model.head(h)


@pytest.mark.parametrize('residual,block_size', MODES)
def test_matches_the_literal_method(residual, block_size):
  model = randomize_depth_params(make_model(residual, block_size))
  x = tokens()
  # float32 throughout; the buffer form sums the same terms in another order.
  np.testing.assert_allclose(model(x), reference_logits(model, x), rtol=2e-5, atol=2e-5)


def test_e1_block_size_one_equals_full():
  full = randomize_depth_params(make_model('full'))
  block = randomize_depth_params(make_model('block', 1))
  x = tokens()
  chex.assert_trees_all_equal(nnx.state(full), nnx.state(block))
  np.testing.assert_allclose(block(x), full(x), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize('eps', [1e-12, 1e-6])
def test_e2_zero_queries_match_the_standard_model(eps):
  """Zero queries: every read is the mean of its sources, which sum to the standard
  stream; PreNorm removes the scale up to the RMSNorm epsilon."""
  x = tokens()
  overrides = dict(norm_eps=eps)
  standard = make_model('standard', **overrides)(x)
  for residual, block_size in MODES[1:]:
    logits = make_model(residual, block_size, **overrides)(x)
    if eps == 1e-12:
      # eps negligible against the mean square of the (averaged) stream: only float32
      # rounding remains (tens of ulps through 6 sublayers and the head).
      np.testing.assert_allclose(logits, standard, rtol=1e-5, atol=1e-5)
    else:
      # With eps > 0, a read that is the stream divided by c is normalised as
      # x / sqrt(ms/c^2 + eps) instead of x / sqrt(ms + eps): a relative change of
      # about c^2 eps / (2 ms). Here c <= 2L+1 = 7 and ms >= 1/d (embedding std
      # d^-1/2), so at most 49e-6 * 32 / 2 ~ 1e-3 per normalisation.
      np.testing.assert_allclose(logits, standard, rtol=3e-3, atol=3e-3)


def test_shared_weights_do_not_depend_on_the_mode():
  """Every parameter of the standard model is the same in every mode (the AttnRes
  parameters take no random numbers); AttnRes adds only its residual parameters."""
  shared = nnx.to_flat_state(nnx.state(make_model('standard')))
  for residual, block_size in MODES[1:]:
    state = nnx.to_flat_state(nnx.state(make_model(residual, block_size)))
    added = {path for path, _ in state} - {path for path, _ in shared}
    assert added and all(
      'residual' in path[0] or 'residual' in path[1] for path in added
    ), added
    state = dict(state)
    for path, value in shared:
      np.testing.assert_array_equal(state[path][...], value[...], err_msg=str(path))


@pytest.mark.parametrize(
  'residual,block_size', [('standard', 1), ('full', 1), ('block', 3)]
)
def test_scan_equals_unrolled(residual, block_size):
  model = randomize_depth_params(make_model(residual, block_size))
  x = tokens()
  scanned = model(x)
  model = with_config(model, scan_layers=False)
  # Same operations, but XLA fuses and reassociates a loop body differently inside a
  # scan: float32 rounding, a few ulps per op over ~10 ops, of the largest logits
  # (measured up to 1.8e-6 of max |logit|, two-phase Block S=3, whose online-softmax
  # merge fuses differently when unrolled).
  scale = float(jnp.abs(scanned).max())
  np.testing.assert_allclose(model(x), scanned, rtol=1e-5, atol=3e-6 * scale)


def gradients_and_logits(model, x):
  """The gradients of a loss of every logit, and the logits, from one jitted program:
  the same model's compiles once for the tests below (the persistent cache)."""

  def loss_and_logits(m):
    logits = m(x)
    return jnp.mean(jax.nn.log_softmax(logits)[..., 0]), logits

  return nnx.jit(nnx.grad(loss_and_logits, has_aux=True))(model)


def test_standard_segments_of_several_layers_compute_the_same_model():
  """`standard@G` (the scan's body holding G layers; TINY's 3 layers: a segment of 2
  and a last one of 1) changes only the loop structure: same logits and gradients."""
  model = make_model('standard', 1)
  grouped = with_config(model, schedule_layers=2)
  assert grouped.residual.segment_layers == 2
  x = tokens()
  expected, logits = gradients_and_logits(model, x)
  actual, grouped_logits = gradients_and_logits(grouped, x)
  # The same float32 ops, fused differently in a body of two layers: a few ulps of
  # the largest logit or gradient entry (as scan against unrolled above).
  scale = float(jnp.abs(logits).max())
  np.testing.assert_allclose(grouped_logits, logits, rtol=1e-5, atol=3e-6 * scale)
  for (path, a), b in zip(
    jax.tree_util.tree_leaves_with_path(nnx.state(actual)),
    jax.tree.leaves(nnx.state(expected)),
  ):
    scale = float(jnp.abs(b).max()) + 1e-30
    np.testing.assert_allclose(a / scale, b / scale, atol=1e-5, err_msg=str(path))


@pytest.mark.parametrize('residual,block_size', [('standard', 1), ('block', 2)])
def test_jit_equals_eager(residual, block_size):
  model = randomize_depth_params(make_model(residual, block_size))
  graphdef, state = nnx.split(model)
  x = tokens()
  jitted = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x))(state, x)
  # XLA fuses and reorders float32 sums under jit: a few ulps of the logits.
  np.testing.assert_allclose(jitted, model(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize('residual,block_size', PATHS)
def test_causal(residual, block_size):
  """The gradient of the logits at position t wrt every later input is zero."""
  model = randomize_depth_params(make_model(residual, block_size))
  length, t = 10, 4

  def logits_at_t(embeddings):
    return model.forward_embeddings(embeddings)[0, t].sum()

  embeddings = model.embed(tokens(1, length))
  grads = jax.jit(jax.grad(logits_at_t))(embeddings)  # jitted: eager ops are slow
  assert jnp.all(grads[:, t + 1 :] == 0)
  assert jnp.any(grads[:, : t + 1] != 0)


@pytest.mark.parametrize('residual,block_size', PATHS)
def test_gradients_are_finite(residual, block_size):
  model = randomize_depth_params(make_model(residual, block_size))
  grads, _ = gradients_and_logits(model, tokens())
  for path, g in jax.tree_util.tree_leaves_with_path(grads):
    assert jnp.all(jnp.isfinite(g)), path
  if residual != 'standard':
    # Every query but the very first sublayer's (a single source) gets a gradient.
    # The first reads a single source: softmax of one logit has zero derivative (up to
    # float32 rounding in the one-shot softmax backward, ~1e-11 here; exactly zero in
    # the two-phase read, which takes the embedding as is: see residual.merge).
    query_grads = grads['layers']['residual']['query'][...].reshape(-1, TINY['d_model'])
    sizes = jnp.abs(query_grads).max(axis=-1)
    assert sizes[0] < 1e-6 * jnp.min(sizes[1:])
    assert jnp.all(sizes[1:] > 0)


@pytest.mark.parametrize('residual,block_size', [('full', 1), ('block', 4)])
def test_converted_standard_model_gives_standard_logits(residual, block_size):
  standard = make_model('standard', norm_eps=1e-12)
  # Move the shared weights away from their init so the conversion must copy them.
  standard.layers.mlp.up[...] = standard.layers.mlp.up[...] * 1.5
  # How the reads are computed is not part of the function: conversion accepts it.
  target_cfg = standard.cfg.replace(
    residual=residual, block_size=block_size, depth_kernel='xla'
  )
  converted = ar.convert_standard_to_attnres(standard, target_cfg)
  converted.residual = dataclasses.replace(converted.residual, one_shot=True)
  assert converted.cfg.residual == residual
  np.testing.assert_array_equal(converted.layers.residual.query[...], 0.0)
  np.testing.assert_array_equal(converted.layers.mlp.up[...], standard.layers.mlp.up[...])
  x = tokens()
  # eps negligible: float32 rounding only (see test_e2).
  np.testing.assert_allclose(converted(x), standard(x), rtol=1e-5, atol=1e-5)


def test_conversion_rejects_a_different_architecture():
  standard = make_model('standard')
  cfg = standard.cfg.replace(residual='full', d_model=64)
  with pytest.raises(ValueError, match='d_model'):
    ar.convert_standard_to_attnres(standard, cfg)


@pytest.mark.parametrize(
  'overrides,message',
  [
    (dict(block_size=0), 'block_size'),
    (dict(block_size=-2), 'block_size'),
    (dict(num_heads=3), 'does not divide'),
    (dict(residual='dense'), 'residual must be one of'),
    (dict(d_model=24, num_heads=8), 'even'),
    (dict(dtype='float16'), 'dtype'),
    (dict(remat='some'), 'remat'),
    (dict(num_layers=0), 'num_layers'),
    (dict(attn_res_eps=0.0), 'attn_res_eps'),
    (dict(schedule_layers=4), 'schedule_layers'),  # TINY has 3 layers
    (dict(residual='block', block_size=4, schedule_layers=1), 'whole blocks'),
    (dict(depth_read='three_phase'), 'depth_read'),
  ],
)
def test_config_errors_are_readable(overrides, message):
  with pytest.raises(ValueError, match=message):
    make_model(**overrides)


def test_bfloat16_model_runs_the_read_in_float32():
  model = randomize_depth_params(make_model('block', 2, dtype='bfloat16'))
  x = tokens()
  logits, stats = model(x, collect_stats=True)
  assert logits.dtype == jnp.float32
  # The depth weights come from a float32 softmax: they sum to one to float32
  # rounding (a few 2^-24 over <= 4 sources), where bfloat16 weights (2^-8 each)
  # would miss by ~1e-3.
  for weights in (stats['depth_weights'], stats['final_depth_weights']):
    assert weights.dtype == jnp.float32
    np.testing.assert_allclose(np.sum(weights, axis=-1), 1.0, rtol=0, atol=1e-6)
  reference = randomize_depth_params(make_model('block', 2))(x)
  # bfloat16 rounds every activation to 8 mantissa bits (relative 2^-9 = 0.2%); about
  # 20 rounded ops in sequence give a few tenths to a few percent of relative error
  # (measured 1.7-1.8%), while a wrong dtype path (e.g. logits from bf16 weights
  # without float32 accumulation, or a broken read) is off by tens of percent.
  relative_rms = jnp.sqrt(jnp.mean((logits - reference) ** 2) / jnp.mean(reference**2))
  assert relative_rms < 0.03, relative_rms
  assert (
    depth.attn_res_read(
      jnp.ones((2, 1, 1, 4), jnp.bfloat16), jnp.ones(4), jnp.ones(4), eps=1e-6
    )[1].dtype
    == jnp.float32
  )
