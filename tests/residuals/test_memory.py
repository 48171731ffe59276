"""The linear-memory backward pass equals plain autodiff; its memory is linear in depth."""

import collections
import functools
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx


from attnres_jax.nn import stack
from attnres_jax.residuals.attnres import choices
from attnres_jax.residuals.attnres.float_residuals import keeping_float_residuals
from conftest import tiny_model, with_config, with_residual

# The test-only reference of AttnResResidual: plain autodiff of the two-phase
# schedule instead of the linear-memory backward.
PLAIN = dict(autodiff_backward=True)


def random_model(residual, block_size, **overrides):
  return tiny_model(residual, block_size, random_depth=True, **overrides)


def gradients(model, residual_fields=None, **cfg_changes):
  """`cfg_changes` to the config, `residual_fields` to the residual (its test-only
  references)."""
  model = with_config(model, **cfg_changes)
  if residual_fields:
    model = with_residual(model, **residual_fields)
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
  for (path, a), b in zip(
    jax.tree_util.tree_leaves_with_path(actual), jax.tree.leaves(expected)
  ):
    scale = float(jnp.abs(b).max()) + 1e-30
    np.testing.assert_allclose(a / scale, b / scale, atol=5e-5, err_msg=str(path))


@functools.cache
def plain_gradients(residual, block_size, schedule_layers):
  """Plain autodiff's gradients of `random_model(...)` (deterministic: seeded), once
  per model for the tests below that compare with it (the remat variants, the Phase 1
  prefixes, the float32 reference of the bf16 tests); its Phase 1 reads the whole
  buffer, masked (no written-out VJP anywhere)."""
  model = random_model(residual, block_size, schedule_layers=schedule_layers)
  return gradients(model, dict(PLAIN, prefix_count=1), remat='none')


# One case per path of the backward pass over TINY's 3 layers (6 sublayers). Full's
# default one-layer segments are test_phase1_prefixes_change_no_gradient[full-1-True]
# (the same program: 3 segments, 3 prefixes). A single block (S = 6) adds no path:
# its one segment ending on an open block is Block S = 4's last segment, a single
# segment is S = 3's. Each remat policy once: it wraps the sublayers the same way in
# every mode.
@pytest.mark.parametrize(
  'residual,block_size,schedule_layers,remat',
  [
    ('full', 1, 2, 'none'),  # segments of 2 layers, and a shorter last one
    ('full', 1, 3, 'none'),  # a single segment: Phase 1 masked, no prefixes
    ('block', 2, 0, 'none'),  # one block per one-layer segment
    ('block', 3, 0, 'none'),  # a block spanning layers, two blocks in one segment
    ('block', 4, 0, 'none'),  # 4 does not divide the 6 sublayers: a partial last block
    ('block', 2, 2, 'none'),  # two blocks per segment, and a shorter last segment
    ('block', 3, 0, 'sublayer'),
    ('full', 1, 2, 'layer'),
    ('full', 1, 2, 'minimal'),
  ],
)
def test_linear_memory_backward_equals_plain_autodiff(
  residual, block_size, schedule_layers, remat
):
  model = random_model(residual, block_size, schedule_layers=schedule_layers)
  plain = plain_gradients(residual, block_size, schedule_layers)
  linear = gradients(model, remat=remat)
  assert_grads_close(linear, plain)


@pytest.mark.parametrize('linear_memory_backward', [True, False])
@pytest.mark.parametrize('residual,block_size', [('full', 1), ('block', 2)])
def test_phase1_prefixes_change_no_gradient(residual, block_size, linear_memory_backward):
  """Phase 1 of each segment reads a prefix of the buffer (`choices.phase1_prefixes`,
  3 of them here: a `lax.switch` branch per prefix, every one taken by some segment)
  with its VJP written out, and gives plain autodiff's gradients of the whole masked
  read."""
  model = random_model(residual, block_size)
  prefixes = choices.phase1_prefixes(with_residual(model, prefix_count=3).residual)
  assert prefixes is not None and len(prefixes) == 3, prefixes
  read = gradients(
    model, dict(prefix_count=3, autodiff_backward=not linear_memory_backward)
  )
  assert_grads_close(read, plain_gradients(residual, block_size, 0))


def test_pipeline_chunks_read_the_whole_buffer():
  """A pipeline's stages are vmapped and their segment starts differ: a switch on
  that batched index would run every branch, so a chunk keeps the masked read."""
  model = with_residual(random_model('full', 1), prefix_count=3)
  assert choices.phase1_prefixes(model.residual) is not None
  chunk, _ = model.residual.pipeline_chunk(1)
  assert choices.phase1_prefixes(chunk) is None


def test_sublayer_vjp_keeps_no_boolean_residuals():
  # The causal mask is built from iotas: plain `jax.vjp` of the attention sublayer
  # after its PreNorm (what the custom backward keeps a closure of) keeps it as a
  # boolean residual (which the custom backward's scan would stack per segment);
  # under `keeping_float_residuals` it is recomputed, and every residual with a shape
  # that it keeps is one plain autodiff keeps.
  model = tiny_model('block', 2)
  graphdef, state = nnx.split(model.layers)
  layer = jax.tree.map(lambda x: x[0], state)
  _, attention = stack.sublayer_halves(graphdef, 0)
  h_BTD = jnp.ones((2, 12, model.cfg.d_model), jnp.float32)
  positions_BT = jnp.broadcast_to(jnp.arange(12), (2, 12))

  def residuals(fn):
    """What the VJP closure holds (its leaves: the saved values), by shape and dtype."""
    _, vjp_fn = jax.vjp(lambda s, h: fn(s, h, positions_BT), layer, h_BTD)
    return collections.Counter((x.shape, str(x.dtype)) for x in jax.tree.leaves(vjp_fn))

  plain = residuals(attention)
  kept = residuals(keeping_float_residuals(attention))
  dropped = plain - kept
  assert not kept - plain  # nothing saved that plain autodiff does not save
  assert any(dtype == 'bool' for _, dtype in dropped)  # the mask (plain keeps it)
  # Dropped besides: booleans and float scalars (constants), nothing with a shape.
  assert all(dtype == 'bool' or shape == () for shape, dtype in dropped), dropped


@pytest.mark.parametrize(
  'residual,block_size,per_layer_stacks',
  [
    ('standard', 1, 4),  # each sublayer's input and its normed input
    ('block', 2, 3),  # the normed inputs, and the partial sum the MLP reads
    ('full', 1, 2),  # the normed inputs alone
  ],
)
def test_backward_keeps_no_float32_activation_and_no_sublayer_input(
  residual, block_size, per_layer_stacks
):
  # bfloat16 activations. The PreNorm is checkpointed: autodiff keeps its bfloat16
  # input, not the float32 upcast and normed values (before: six float32 [L, B, T, D]
  # stacks in every mode). AttnRes's linear-memory backward keeps no sublayer input
  # at all: it recomputes the read anyway and reruns the norm from it.
  model = tiny_model(residual, block_size, dtype='bfloat16')  # AttnRes: linear memory
  tokens = jax.random.randint(jax.random.key(2), (2, 12), 0, 256)
  graphdef, state = nnx.split(model)
  loss = lambda s: jnp.mean(nnx.merge(graphdef, s)(tokens).astype(jnp.float32) ** 2)
  _, vjp_fn = jax.vjp(loss, state)
  activation = (2, 12, model.cfg.d_model)  # [B, T, D], alone or stacked
  kept = [v for v in jax.tree.leaves(vjp_fn) if v.shape[-3:] == activation]
  per_layer = [v for v in kept if v.shape[:-3] == (model.cfg.num_layers,)]
  assert not [v.shape for v in per_layer if v.dtype != jnp.bfloat16]
  assert not [v.shape for v in kept if v.shape == activation and v.dtype != jnp.bfloat16]
  assert len(per_layer) == per_layer_stacks


def assert_within_twice_the_rounding(linear, plain, exact):
  """Per parameter, |linear - plain| <= 2 |plain - exact| (max over entries): two
  passes each within a rounding error of the exact gradient (see the callers)."""
  for (path, a), b, c in zip(
    jax.tree_util.tree_leaves_with_path(linear),
    jax.tree.leaves(plain),
    jax.tree.leaves(exact),
  ):
    rounding = float(jnp.abs(b - c).max())
    assert float(jnp.abs(a - b).max()) <= 2 * rounding, (path, rounding)


def test_bfloat16_linear_memory_backward_is_close_to_plain():
  model = random_model('block', 2, dtype='bfloat16')
  plain = gradients(model, PLAIN)
  linear = gradients(model)
  exact = plain_gradients('block', 2, 0)  # the same parameters in float32
  # bfloat16 activations (8 mantissa bits): both passes round intermediate
  # cotangents differently. Each lies within bf16's own rounding error of the
  # float32 gradient, so the two lie within twice that of each other (the triangle
  # inequality), per parameter relative to its largest entry; a wrong backward pass
  # is off by the gradient's own scale.
  assert_within_twice_the_rounding(linear, plain, exact)


@pytest.mark.parametrize('residual,block_size', [('block', 3), ('full', 1)])
def test_bfloat16_depth_storage_backward_is_close_to_plain(residual, block_size):
  """depth_dtype='bfloat16' under float32 compute: the buffer, partial sums and Phase 1
  outputs stored in bf16 through the linear-memory backward, against plain autodiff of
  the same storage."""
  model = random_model(residual, block_size, depth_dtype='bfloat16')
  plain = gradients(model, PLAIN)
  linear = gradients(model)
  exact = plain_gradients(residual, block_size, 0)  # float32 storage
  # The same triangle as above: both passes round the stored values and the buffer's
  # cotangents (bf16, 2^-9 relative per rounding) at different points, each within
  # bf16 storage's own error of float32 storage.
  assert_within_twice_the_rounding(linear, plain, exact)


def compiled_temp_bytes(residual, block_size, num_layers, linear):
  # A fixed schedule segment (2 layers), so that only the depth changes.
  model = tiny_model(residual, block_size, num_layers=num_layers, schedule_layers=2)
  if not linear:
    model = with_residual(model, **PLAIN)
  graphdef, state = nnx.split(model)
  x = jnp.zeros((4, 64), jnp.int32)
  grad_fn = jax.jit(jax.grad(lambda s: jnp.mean(nnx.merge(graphdef, s)(x))))
  return grad_fn.lower(state).compile().memory_analysis().temp_size_in_bytes


def test_full_attnres_memory_grows_linearly_in_depth():
  """The extra memory over the standard model grows linearly in depth with the custom
  backward pass and quadratically with plain autodiff: from 16 to 32 to 64 layers, the
  extra memory an added layer brings stays the same (linear) or grows (quadratic)."""
  depths = (16, 32, 64)
  standard = {
    layers: compiled_temp_bytes('standard', 1, layers, True) for layers in depths
  }
  extra = {
    (linear, layers): compiled_temp_bytes('full', 1, layers, linear) - standard[layers]
    for linear in (True, False)
    for layers in depths
  }

  def growth(linear):  # extra bytes per added layer, 32 -> 64 over 16 -> 32
    per_layer = lambda a, b: (extra[linear, b] - extra[linear, a]) / (b - a)
    return per_layer(32, 64) / per_layer(16, 32)

  # Linear: 1 (measured 0.95; below 16 layers the per-layer extra still settles, which
  # made 8 -> 32 layers grow 4.4x). Quadratic alone: 2; plain autodiff's quadratic
  # term beside its linear ones: measured 1.77.
  assert growth(True) < 1.25, extra
  assert growth(False) > 1.5, extra
  assert extra[True, 64] < 0.25 * extra[False, 64], extra  # measured 0.088
