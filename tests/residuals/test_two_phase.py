"""Two-phase Block AttnRes (paper, Algorithm 1) equals the one-shot read."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import attnres_jax as ar
from attnres_jax.residuals.attnres import choices
from attnres_jax.residuals.attnres import depth

from conftest import TINY_MODEL as TINY, tiny_model_config

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
  phase1 = depth.phase1(buffer, queries, gains, eps=1e-6, num_valid=completed)
  partial = jnp.zeros((2, 3, 16), dtype)
  outputs = spread_sources(keys[3], block_size, (2, 3, 16), 1e-2, 1e4).astype(dtype)
  for i in range(block_size):
    mine = phase1[i]
    h = depth.phase2(
      mine, partial[None], jnp.array([i > 0]), queries[i], gains[i], eps=1e-6
    )
    sources = buffer[:completed]
    if i > 0:
      sources = jnp.concatenate([sources, partial[None]])
    h_ref, _ = depth.attn_res_read(sources, queries[i], gains[i], eps=1e-6)
    assert h.dtype == dtype
    # Both are float32 internally; only the order of summation differs (a few ulps of
    # the largest source), plus the final cast for bfloat16 (2^-8 relative).
    tolerance = 2**-8 if dtype == jnp.bfloat16 else 1e-6
    np.testing.assert_allclose(
      np.asarray(h, np.float32),
      np.asarray(h_ref, np.float32),
      atol=tolerance * float(jnp.abs(sources).max()),
      rtol=tolerance,
    )
    partial = partial + outputs[i]


@pytest.mark.parametrize('block_size', [1, 3])
def test_bfloat16_phase1_storage_is_within_its_rounding(block_size):
  """Phase 1 outputs stored in bf16 (model.depth_dtype): the merged read against the
  float32 one-shot read. The stored output o is rounded once (2^-9 relative); it
  enters h as o * c / total with c / total <= 1/s (c = s * exp(m - m'), total >= c),
  and |o| / s <= max |v| (o / s is a convex combination of the sources), so h moves
  by at most 2^-9 max |v|; the final cast to bf16 adds 2^-9 |h| <= 2^-9 max |v|."""
  keys = jax.random.split(jax.random.key(block_size), 4)
  completed = 3
  buffer = spread_sources(keys[0], 5, (2, 3, 16)).astype(jnp.bfloat16)
  queries = jax.random.normal(keys[1], (block_size, 16))
  gains = 1 + 0.3 * jax.random.normal(keys[2], (block_size, 16))
  stats = depth.phase1(
    buffer, queries, gains, eps=1e-6, num_valid=completed, out_dtype=jnp.bfloat16
  )
  assert all(o.dtype == jnp.bfloat16 and m.dtype == jnp.float32 for m, _, o in stats)
  local = spread_sources(keys[3], 1, (2, 3, 16), 1e-2, 1e4).astype(jnp.bfloat16)
  for i in range(block_size):
    mine = stats[i]
    h = depth.phase2(mine, local, jnp.array([i > 0]), queries[i], gains[i], eps=1e-6)
    sources = buffer[:completed]
    if i > 0:
      sources = jnp.concatenate([sources, local])
    h_ref, _ = depth.attn_res_read(
      sources.astype(jnp.float32), queries[i], gains[i], eps=1e-6
    )
    scale = float(jnp.abs(sources.astype(jnp.float32)).max())
    np.testing.assert_allclose(
      np.asarray(h, np.float32), np.asarray(h_ref), rtol=0, atol=2**-8 * scale
    )


@pytest.mark.parametrize(
  'dtype, depth_dtype, storage, outputs',
  [
    ('float32', '', jnp.float32, jnp.float32),
    ('bfloat16', '', jnp.bfloat16, jnp.bfloat16),  # the default: the compute dtype
    ('bfloat16', 'float32', jnp.float32, jnp.float32),
    ('float32', 'bfloat16', jnp.bfloat16, jnp.bfloat16),
  ],
)
def test_depth_state_dtype_follows_depth_dtype_else_the_compute_dtype(
  dtype, depth_dtype, storage, outputs
):
  """The buffer, the partial sums and Phase 1's outputs share one dtype; the online
  softmax statistics stay float32 whatever it is."""
  residual = model(4, 'two_phase', dtype=dtype, depth_dtype=depth_dtype).residual
  assert residual.storage_dtype == storage and residual.phase1_dtype == outputs
  carry = residual.init(jnp.zeros((2, 10, TINY['d_model'])))
  assert carry.buffer_KBTD.dtype == storage
  buffer = jnp.ones((3, 2, 10, TINY['d_model']), storage)
  queries = jnp.ones((2, TINY['d_model']))
  stats = depth.phase1(
    buffer, queries, queries, eps=1e-6, num_valid=2, out_dtype=residual.phase1_dtype
  )
  assert all(
    o.dtype == outputs and m.dtype == s.dtype == jnp.float32 for m, s, o in stats
  )


@functools.cache
def float32_logits():
  """The float32 one-shot logits of Block S = 3 that the two bf16 tests below compare
  their rounding with (the same tokens and parameters; computed once)."""
  x = jax.random.randint(jax.random.key(3), (2, 10), 0, 256)
  return model(3, 'one_shot')(x)


def test_bfloat16_depth_storage_model_matches_one_shot():
  """A float32 model storing its depth buffer in bf16 (model.depth_dtype): the buffer
  and its reads are bf16, the block schedule matches the one-shot read of the same
  storage within twice the storage's own error (as for the bf16 model below)."""
  x = jax.random.randint(jax.random.key(3), (2, 10), 0, 256)
  stored = model(3, 'two_phase', depth_dtype='bfloat16')
  carry = stored.residual.init(jnp.zeros((2, 10, TINY['d_model'])))
  assert carry.buffer_KBTD.dtype == jnp.bfloat16
  logits = stored(x)
  logits_ref = model(3, 'one_shot', depth_dtype='bfloat16')(x)
  exact = float32_logits()
  assert logits.dtype == jnp.float32
  storage_error = float(jnp.abs(logits_ref - exact).max())
  assert storage_error > 0  # the storage is bf16 indeed
  assert float(jnp.abs(logits - logits_ref).max()) <= 2 * storage_error


def test_phase2_merges_several_local_sources():
  """Full's schedule: each sublayer merges the segment's earlier outputs (J local
  slots, the first `valid` of them) with phase 1 over the sources before it."""
  keys = jax.random.split(jax.random.key(9), 4)
  sources = spread_sources(keys[0], 7, (2, 3, 16))
  queries = jax.random.normal(keys[1], (4, 16))
  gains = 1 + 0.3 * jax.random.normal(keys[2], (4, 16))
  before = 3  # the completed sources when the segment starts
  phase1 = depth.phase1(sources, queries, gains, eps=1e-6, num_valid=before)
  local = sources[before:]
  for q in range(4):
    mine = phase1[q]
    h = depth.phase2(mine, local, jnp.arange(4) < q, queries[q], gains[q], eps=1e-6)
    h_ref, _ = depth.attn_res_read(
      sources, queries[q], gains[q], eps=1e-6, num_valid=before + q
    )
    np.testing.assert_allclose(
      h, h_ref, rtol=1e-6, atol=1e-6 * float(jnp.abs(sources).max())
    )


@pytest.mark.parametrize('rms_given', [True, False])
def test_phase1_over_buffer_prefixes_equals_the_masked_read(rms_given):
  """Phase 1 with `prefixes` reads the shortest prefix holding the traced
  `num_valid` slots (one `lax.switch` branch per prefix) and a Python-int `num_valid`
  slices the buffer: statistics and gradients against the whole masked buffer, for a
  `num_valid` in every branch. Both sum the same float32 terms over the valid slots;
  the masked ones add exact zeros, so only the summation order can differ (a few
  ulps: 1e-6 of the largest entry)."""
  keys = jax.random.split(jax.random.key(4), 4)
  sources = spread_sources(keys[0], 9, (2, 3, 16), 1e-2, 1e2)
  queries = jax.random.normal(keys[1], (3, 16))
  gains = 1 + 0.3 * jax.random.normal(keys[2], (3, 16))
  weights = jax.random.normal(keys[3], (3, 16))
  inv_rms = depth.rms_inverse(sources, 1e-6) if rms_given else None

  def loss(sources, queries, inv_rms, num_valid, prefixes):
    stats = depth.phase1(
      sources,
      queries,
      gains,
      eps=1e-6,
      num_valid=num_valid,
      inv_rms_KBT=inv_rms,
      prefixes=prefixes,
    )
    # Every output enters: the sums, and each query's output through its own weights.
    return sum(
      jnp.sum(jnp.log(sum_BT))
      + jnp.sum(out_BTD * weights[q][None, None] / sum_BT[..., None])
      for q, (_, sum_BT, out_BTD) in enumerate(stats)
    )

  grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)), static_argnums=4)
  # A Python int stays static under jit (and compiles faster than it runs op by op).
  sliced = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)), static_argnums=(3, 4))
  close = lambda a, b: np.testing.assert_allclose(
    a, b, rtol=1e-6, atol=1e-6 * float(jnp.abs(b).max())
  )
  for num_valid in (1, 2, 4, 5, 9):
    masked = grad(sources, queries, inv_rms, jnp.int32(num_valid), None)
    for read in (
      grad(sources, queries, inv_rms, jnp.int32(num_valid), (2, 5, 9)),
      sliced(sources, queries, inv_rms, num_valid, None),
    ):
      jax.tree.map(close, read, masked)
  with pytest.raises(ValueError, match='whole buffer'):
    loss(sources, queries, inv_rms, jnp.int32(3), (2, 5))


@pytest.mark.parametrize(
  'residual, count, prefixes',
  [
    ('full', 4, (13, 29, 45, 65)),  # starts 1, 5, .., 61: 16 segments of 2 layers
    ('full', 0, (13, 29, 45, 65)),  # automatic: 4 for Full
    ('full', 1, None),
    ('block', 0, None),  # automatic: the whole buffer for Block
    ('full', 40, tuple(range(1, 62, 4)[:15]) + (65,)),  # one prefix per segment
    ('block', 2, (8, 17)),  # S = 4: starts 1, 2, .., 16
  ],
)
def test_phase1_prefixes_split_the_segment_starts(residual, count, prefixes):
  """32 layers: the segment starts in groups of equal count, each read up to its
  longest start, the last group up to the whole buffer (`count` 0: the rule's)."""
  cfg = tiny_model_config(num_layers=32, residual=residual, block_size=4)
  attnres = dataclasses.replace(ar.residuals.make(cfg), prefix_count=count)
  assert choices.phase1_prefixes(attnres) == prefixes


def autodiff_merge(stats, local_JBTD, valid_J, query_D, gain_D, eps, inv_rms_JBT):
  """The Phase 2 merge as plain formulas, for autodiff: the reference for
  `depth.phase2`'s written-out VJP."""
  max_BT, sum_BT, out_BTD = stats
  folded_D = query_D * gain_D
  if inv_rms_JBT is None:
    inv_rms_JBT = depth.rms_inverse(local_JBTD, eps)
  logits_JBT = jnp.sum(local_JBTD * depth.lead(folded_D, 4), axis=-1) * inv_rms_JBT
  logits_JBT = jnp.where(valid_J[:, None, None], logits_JBT, -jnp.inf)
  new_max_BT = jax.lax.stop_gradient(jnp.maximum(max_BT, jnp.max(logits_JBT, axis=0)))
  scale_BT = jnp.exp(max_BT - new_max_BT)
  weights_JBT = jnp.exp(logits_JBT - new_max_BT[None])
  total_BT = sum_BT * scale_BT + jnp.sum(weights_JBT, axis=0)
  h_BTD = out_BTD * scale_BT[..., None] + jnp.sum(weights_JBT[..., None] * local_JBTD, 0)
  return h_BTD / total_BT[..., None]


@pytest.mark.parametrize('given_rms', [False, True])
@pytest.mark.parametrize('valid', [(1, 1, 0), (0, 0, 0), (1, 1, 1)])
def test_phase2_gradients_equal_autodiff(valid, given_rms):
  """The merge's written-out VJP against autodiff of the same formulas, for every
  input (the max too: d max is exact, not dropped) with J = 3 local sources 1e2
  apart in magnitude, some not valid. Float32 both, the same reductions in another
  order: relative to each gradient's scale, a few ulps of float32 (2^-23 = 1.2e-7)
  times the dozen terms per entry; 1e-5 leaves room and no wrong term fits in it."""
  keys = jax.random.split(jax.random.key(11), 7)
  local = spread_sources(keys[0], 3, (2, 5, 16), 1e-1, 1e1)
  stats = (
    jax.random.normal(keys[1], (2, 5)),
    1 + jax.random.uniform(keys[2], (2, 5)),
    jax.random.normal(keys[3], (2, 5, 16)),
  )
  query, gain = jax.random.normal(keys[4], (16,)), 1 + jax.random.normal(keys[5], (16,))
  inv_rms = depth.rms_inverse(local, 1e-6) if given_rms else None
  valid_J = jnp.array(valid, bool)
  cotangent = jax.random.normal(keys[6], (2, 5, 16))

  def loss(merge, stats, local, query, gain, inv_rms):
    return jnp.sum(merge(stats, local, valid_J, query, gain, inv_rms) * cotangent)

  ours = lambda s, l, v, q, g, r: depth.phase2(
    s, l, v, q, g, eps=1e-6, local_inv_rms_JBT=r
  )
  reference = lambda s, l, v, q, g, r: autodiff_merge(s, l, v, q, g, 1e-6, r)
  args = (stats, local, query, gain, inv_rms)
  h, h_ref = ours(*args[:2], valid_J, *args[2:]), reference(*args[:2], valid_J, *args[2:])
  np.testing.assert_allclose(h, h_ref, rtol=1e-6, atol=1e-6 * float(jnp.abs(h_ref).max()))
  grads = jax.grad(functools.partial(loss, ours), argnums=tuple(range(5)))(*args)
  grads_ref = jax.grad(functools.partial(loss, reference), argnums=tuple(range(5)))(*args)
  for g, g_ref in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_ref)):
    scale = float(jnp.abs(g_ref).max()) + float(jnp.abs(h_ref).max())
    np.testing.assert_allclose(g / scale, g_ref / scale, rtol=0, atol=1e-5)


@pytest.mark.parametrize('num_local', [1, 3])
def test_phase1_read_is_phase2_without_a_valid_local_source(num_local):
  """A segment's first sublayer skips Phase 2 (`depth.phase1_read`): with no valid
  local source the merge's old scale is exp(0) = 1 and every local weight exp(-inf) =
  0, so it gives out / sum exactly, and the same gradients of the sum and the output
  (the max is stop-gradient in Phase 1: its cotangent is dropped): exactly with one
  local source (autodiff of the same operations); with several, the merge's
  written-out VJP forms d sum as -c <g, h>, a 16-term float32 reduction where autodiff
  of out / sum forms -<g, out> / sum^2: a few ulps (2^-23) of the gradient's scale."""
  keys = jax.random.split(jax.random.key(12), 5)
  local = spread_sources(keys[0], num_local, (2, 5, 16), 1e-1, 1e1)
  stats = (
    jax.random.normal(keys[1], (2, 5)),
    1 + jax.random.uniform(keys[2], (2, 5)),
    jax.random.normal(keys[3], (2, 5, 16)),
  )
  query, gain = jax.random.normal(keys[4], (2, 16))
  valid_J = jnp.zeros(num_local, bool)
  merged = lambda stats: depth.phase2(stats, local, valid_J, query, gain, eps=1e-6)
  skipped = lambda stats: depth.phase1_read(stats, local.dtype)
  np.testing.assert_array_equal(skipped(stats), merged(stats))
  cotangent = jax.random.normal(keys[1], (2, 5, 16))
  grads = [
    jax.grad(lambda s, f=f: jnp.sum(f(s) * cotangent))(stats) for f in (merged, skipped)
  ]
  for g, g_ref in zip(grads[1][1:], grads[0][1:]):
    if num_local == 1:
      np.testing.assert_array_equal(g, g_ref)
    else:
      scale = float(jnp.abs(g_ref).max())
      np.testing.assert_allclose(g / scale, g_ref / scale, rtol=0, atol=1e-6)


def model(block_size=2, depth_read='two_phase', spread=True, **overrides):
  """`depth_read`: 'two_phase' (the library's read) or 'one_shot' (the test-only
  reference read, `AttnResResidual.one_shot`)."""
  cfg = tiny_model_config(**{'residual': 'block', 'block_size': block_size, **overrides})
  m = ar.Transformer(cfg, rngs=nnx.Rngs(0))
  if depth_read == 'one_shot':
    m.residual = dataclasses.replace(m.residual, one_shot=True)
  keys = jax.random.split(jax.random.key(1), 3)
  reads = m.layers.residual
  reads.query[...] = jax.random.normal(keys[0], reads.query.shape)
  reads.gain[...] = 1 + 0.3 * jax.random.normal(keys[1], reads.gain.shape)
  # Embeddings 1e3 times larger than usual: sources 1e6 apart in magnitude across
  # depth once the sublayers (outputs O(1)) are added.
  if spread:
    m.embedding[...] = m.embedding[...] * 1e3
  return m


# The block schedule's grid: Block sizes dividing the 6 sublayers and not (4), a single
# block (6), and Full with schedule segments of 1, 2 and 3 (= all) layers.
SCHEDULES = (
  [dict(residual='block', block_size=s) for s in BLOCK_SIZES]
  + [dict(residual='full', schedule_layers=g) for g in (1, 2, 3)]
  + [dict(residual='block', block_size=2, schedule_layers=3)]
)


def schedule_id(schedule):
  return '-'.join(f'{k}={v}' for k, v in schedule.items())


@pytest.mark.parametrize('schedule', SCHEDULES, ids=schedule_id)
def test_block_schedule_equals_the_one_shot_read(schedule):
  x = jax.random.randint(jax.random.key(2), (2, 10), 0, 256)
  logits = model(depth_read='two_phase', **schedule)(x)
  logits_ref = model(depth_read='one_shot', **schedule)(x)
  # Sources 1e6 apart: float32, summation order only (see above), through 6
  # sublayers and the head; the large (tied) logits are compared to their scale.
  np.testing.assert_allclose(
    logits, logits_ref, rtol=2e-5, atol=1e-6 * float(jnp.abs(logits_ref).max())
  )


# A block spanning layers (S = 3), a partial last block (S = 4), Full in segments of
# 2 layers and a last one of 1 (which covers Full's default one-layer segments, and
# Block S = 1 runs Full's code).
@pytest.mark.parametrize('schedule', [SCHEDULES[i] for i in (2, 3, 6)], ids=schedule_id)
def test_block_schedule_gradients_equal_the_one_shot_read(schedule):
  """With the linear-memory backward (tests/residuals/test_memory.py checks it against plain
  autodiff of the same schedule for every remat policy)."""
  x = jax.random.randint(jax.random.key(2), (2, 10), 0, 256)

  def grads(depth_read):
    m = model(depth_read=depth_read, spread=False, **schedule)
    graphdef, state = nnx.split(m)
    return jax.jit(jax.grad(lambda s: jnp.mean(nnx.merge(graphdef, s)(x) ** 2)))(state)

  # Gradients at the usual scale (with 1e3 embeddings, mean(logits^2) is so badly
  # conditioned that float32 rounding of the forward pass shows up at 1e-3).
  for (path, g), g_ref in zip(
    jax.tree_util.tree_leaves_with_path(grads('two_phase')),
    jax.tree.leaves(grads('one_shot')),
  ):
    scale = float(jnp.abs(g_ref).max()) + 1e-30
    np.testing.assert_allclose(g / scale, g_ref / scale, atol=5e-5, err_msg=str(path))


def test_two_phase_bfloat16_model_matches_one_shot():
  x = jax.random.randint(jax.random.key(3), (2, 10), 0, 256)
  logits = model(3, 'two_phase', dtype='bfloat16')(x)
  logits_ref = model(3, 'one_shot', dtype='bfloat16')(x)
  exact = float32_logits()  # the same parameters in float32
  # Same bf16 sublayer arithmetic; the reads differ only inside float32 and are cast
  # to bf16 (2^-8 relative) before each sublayer, which can flip one rounding that
  # the later sublayers carry on. Each bf16 schedule therefore lies within bf16's own
  # rounding error of the float32 model, and the two within twice that of each other
  # (the triangle inequality); a wrong read is off by the logits' own scale.
  bf16_error = float(jnp.abs(logits_ref - exact).max())
  assert float(jnp.abs(logits - logits_ref).max()) <= 2 * bf16_error, bf16_error


# Full, and a block spanning layers in one segment: S = 6 would run the same single
# segment of 3 layers with the block boundaries moved (the forward pass above checks
# those), and the depth state is per token, so nothing about it is cached.
@pytest.mark.parametrize('block_size', [1, 3])
def test_cached_two_phase_decoding_equals_recomputation(block_size):
  m = model(block_size)
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
    logits, cache = step(m, x[:, t : t + 1], cache, jnp.int32(t))
    # Position t from the cache equals position t of the full forward pass.
    np.testing.assert_allclose(logits[:, 0], full[:, t], rtol=2e-5, atol=1e-6 * scale)
