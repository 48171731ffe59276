"""The depth read and the block bookkeeping against independent implementations."""

import itertools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attnres_jax.residuals.attnres import depth


def numpy_read(sources, query, gain, eps, num_valid=None):
  """Straightforward float64 AttnRes read, one source at a time."""
  sources = np.asarray(sources, np.float64)
  query, gain = np.asarray(query, np.float64), np.asarray(gain, np.float64)
  count = sources.shape[0] if num_valid is None else num_valid
  logits = []
  for s in range(count):
    key = sources[s] / np.sqrt(np.mean(sources[s] ** 2, axis=-1, keepdims=True) + eps)
    logits.append(np.sum(query * gain * key, axis=-1))
  logits = np.stack(logits)
  weights = np.exp(logits - logits.max(axis=0))
  weights /= weights.sum(axis=0)
  h = sum(weights[s][..., None] * sources[s] for s in range(count))
  full_weights = np.zeros((sources.shape[0],) + weights.shape[1:])
  full_weights[:count] = weights
  return h, full_weights


def random_sources(key, num_sources, shape, magnitudes):
  """Sources whose scales span `magnitudes` (e.g. 1e-3 .. 1e4)."""
  keys = jax.random.split(key, num_sources)
  scales = np.geomspace(*magnitudes, num_sources)
  return jnp.stack([s * jax.random.normal(k, shape) for k, s in zip(keys, scales)])


class AttnResReadTest(chex.TestCase):
  @chex.variants(with_jit=True, without_jit=True)
  def test_matches_numpy_reference_across_magnitudes(self):
    sources = random_sources(jax.random.key(0), 7, (2, 5, 16), (1e-3, 1e4))
    query = 0.5 * jax.random.normal(jax.random.key(1), (16,))
    gain = 1.0 + 0.2 * jax.random.normal(jax.random.key(2), (16,))
    for num_valid in (1, 4, None):
      read = self.variant(
        lambda s, q, g, n=num_valid: depth.attn_res_read(s, q, g, eps=1e-6, num_valid=n)
      )
      h, weights = read(sources, query, gain)
      h_ref, weights_ref = numpy_read(sources, query, gain, 1e-6, num_valid)
      # float32 arithmetic on values up to 1e4: relative error a few ulp (1.2e-7).
      np.testing.assert_allclose(weights, weights_ref, rtol=1e-5, atol=1e-6)
      np.testing.assert_allclose(h, h_ref, rtol=1e-5, atol=1e-5 * np.abs(h_ref).max())

  def test_bfloat16_sources_are_read_in_float32(self):
    sources = random_sources(jax.random.key(3), 5, (2, 3, 32), (1e-3, 1e4))
    sources_bf16 = sources.astype(jnp.bfloat16)
    query = jax.random.normal(jax.random.key(4), (32,))
    gain = jnp.ones((32,))
    h, weights = depth.attn_res_read(sources_bf16, query, gain, eps=1e-6)
    self.assertEqual(h.dtype, jnp.bfloat16)
    self.assertEqual(weights.dtype, jnp.float32)
    # Reference on the same (already rounded) bfloat16 values, in float64: only the
    # final cast to bfloat16 (8 mantissa bits, relative 2^-8) may differ.
    h_ref, weights_ref = numpy_read(sources_bf16.astype(jnp.float32), query, gain, 1e-6)
    np.testing.assert_allclose(weights, weights_ref, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(
      h.astype(jnp.float32), h_ref, rtol=2**-8, atol=2**-8 * np.abs(h_ref).max() * 1e-3
    )

  def test_invalid_sources_get_exactly_zero_weight(self):
    sources = random_sources(jax.random.key(5), 6, (1, 2, 8), (1.0, 10.0))
    h, weights = depth.attn_res_read(
      sources, jnp.ones(8), jnp.ones(8), eps=1e-6, num_valid=2
    )
    np.testing.assert_array_equal(weights[2:], 0.0)
    np.testing.assert_allclose(weights.sum(0), 1.0, rtol=1e-6)
    # Garbage in the invalid slots cannot leak into the output.
    poisoned = sources.at[2:].set(1e30)
    h_poisoned, _ = depth.attn_res_read(
      poisoned, jnp.ones(8), jnp.ones(8), eps=1e-6, num_valid=2
    )
    np.testing.assert_array_equal(h, h_poisoned)

  def test_zero_query_gives_the_mean_of_the_valid_sources(self):
    sources = random_sources(jax.random.key(6), 5, (2, 4, 8), (1e-2, 1e2))
    h, weights = depth.attn_res_read(
      sources, jnp.zeros(8), jnp.ones(8), eps=1e-6, num_valid=3
    )
    np.testing.assert_allclose(weights[:3], 1 / 3, rtol=1e-6)
    np.testing.assert_allclose(h, sources[:3].mean(0), rtol=1e-5, atol=1e-6)

  def test_gain_folds_into_query(self):
    sources = random_sources(jax.random.key(7), 4, (1, 3, 8), (0.1, 10.0))
    query = jax.random.normal(jax.random.key(8), (8,))
    gain = jax.random.uniform(jax.random.key(9), (8,), minval=0.5, maxval=2.0)
    h1, w1 = depth.attn_res_read(sources, query, gain, eps=1e-6)
    h2, w2 = depth.attn_res_read(sources, query * gain, jnp.ones(8), eps=1e-6)
    np.testing.assert_allclose(w1, w2, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(h1, h2, rtol=1e-6, atol=1e-6)


def sources_by_rule(sublayer, block_size, num_sublayers):
  """The source list of one sublayer (docs/method.md), as names: 'b0' = embedding,
  'bn' = block n complete, 'pn:i' = partial sum of the first i outputs of block n."""
  del num_sublayers
  block = sublayer // block_size + 1  # 1-based block containing the sublayer
  position = sublayer % block_size + 1  # 1-based position within the block
  names = [f'b{n}' for n in range(block)]
  if position >= 2:
    names.append(f'p{block}:{position - 1}')
  return names


def sources_by_buffer(sublayer, block_size, num_sublayers):
  """What the buffer bookkeeping reads: fill a symbolic buffer by simulation."""
  slots = [['b0']] + [[] for _ in range(depth.num_blocks(num_sublayers, block_size))]
  for l in range(sublayer):
    slots[depth.output_slot(l, block_size)].append(f'v{l}')
  names = []
  for slot in range(depth.num_valid_sources(sublayer, block_size)):
    members = slots[slot]
    if slot == 0:
      names.append('b0')
      continue
    # Describe the slot's content in the rule's vocabulary.
    first = (slot - 1) * block_size
    expected_full = [
      f'v{l}' for l in range(first, min(first + block_size, num_sublayers))
    ]
    if members == expected_full:
      names.append(f'b{slot}')
    else:
      assert members == expected_full[: len(members)], (slot, members)
      names.append(f'p{slot}:{len(members)}')
  return names


@pytest.mark.parametrize(
  'num_sublayers,block_size',
  list(itertools.product([1, 2, 5, 8, 12], [1, 2, 3, 4, 5, 8, 13])),
)
def test_block_bookkeeping_matches_design(num_sublayers, block_size):
  for sublayer in range(num_sublayers):
    assert sources_by_buffer(sublayer, block_size, num_sublayers) == sources_by_rule(
      sublayer, block_size, num_sublayers
    ), sublayer
    names = sources_by_rule(sublayer, block_size, num_sublayers)
    assert names.count('b0') == 1  # the embedding exactly once
  # The final read sees every block, the last possibly partial, and each output once.
  final = depth.num_slots(num_sublayers, block_size)
  assert final == -(-num_sublayers // block_size) + 1
  assert depth.output_slot(num_sublayers - 1, block_size) == final - 1


def test_full_is_block_size_one():
  for l in range(10):
    assert depth.num_valid_sources(l, 1) == l + 1  # embedding + every earlier output
    assert depth.output_slot(l, 1) == l + 1
