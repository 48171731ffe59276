"""depth_accumulate: the in-place sum of Phase 1's buffer cotangent (Pallas interpret
mode off the TPU), alone, on a mesh, and inside the linear-memory backward."""

import functools
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from attnres_jax import depth_accumulate
from attnres_jax import pipeline
from attnres_jax import sharding
from conftest import child_result, tiny_model, with_config


def operands(dtype, num_valid, shape=(5, 2, 256, 128)):
  """A carry and a Phase 1 cotangent, zero from slot `num_valid` on, and their sum."""
  acc_KBTD, d_KBTD = (
    jax.random.normal(jax.random.key(i), shape).astype(dtype) for i in (3, 4)
  )
  d_KBTD = d_KBTD.at[num_valid:].set(0)
  # The kernel adds in float32 and rounds once to `dtype`, as XLA's add does (an
  # exact float32 add for float32 operands): equal bit for bit.
  expected = (acc_KBTD.astype(jnp.float32) + d_KBTD.astype(jnp.float32)).astype(dtype)
  return acc_KBTD, d_KBTD, expected


@pytest.mark.parametrize('dtype', [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize('num_valid', [None, 1, 3, 5])
def test_accumulate_adds_the_cotangent(dtype, num_valid):
  acc_KBTD, d_KBTD, expected = operands(dtype, num_valid)
  got = jax.jit(depth_accumulate.accumulate)(acc_KBTD, d_KBTD, num_valid)
  np.testing.assert_array_equal(got, expected)


def test_accumulate_leaves_the_slots_past_num_valid():
  # What the alias keeps: the carry's own values, whatever `d` holds there.
  acc_KBTD, d_KBTD, expected = operands(jnp.float32, None)
  got = jax.jit(depth_accumulate.accumulate)(acc_KBTD, d_KBTD, jnp.int32(2))
  np.testing.assert_array_equal(got[:2], expected[:2])
  np.testing.assert_array_equal(got[2:], acc_KBTD[2:])


@pytest.mark.parametrize('shape', [(6, 2, 256, 128), (6, 2, 12, 128)])  # kernel, XLA
@pytest.mark.parametrize('num_valid', [1, 4])
def test_accumulate_zeroes_the_slots_after_num_valid(shape, num_valid):
  # The segment's own slots: their carried cotangent is taken before the sum.
  acc_KBTD, d_KBTD, expected = operands(jnp.float32, num_valid, shape)
  expected = expected.at[num_valid : num_valid + 3].set(0)
  fn = functools.partial(depth_accumulate.accumulate, num_zeroed=3)
  got = jax.jit(fn)(acc_KBTD, d_KBTD, jnp.int32(num_valid))
  np.testing.assert_array_equal(got, expected)


def test_accumulate_of_unaligned_tokens_is_xla_add():
  acc_KBTD, d_KBTD, expected = operands(jnp.float32, 3, shape=(5, 2, 12, 128))
  jaxpr = jax.make_jaxpr(depth_accumulate.accumulate)(acc_KBTD, d_KBTD, 3)
  assert 'pallas_call' not in str(jaxpr)
  np.testing.assert_array_equal(
    depth_accumulate.accumulate(acc_KBTD, d_KBTD, 3), expected
  )


@pytest.mark.parametrize(
  'length, dim, itemsize, tile',
  [(1024, 1024, 2, 512), (1024, 1024, 4, 256), (384, 128, 4, 128)],
)
def test_tile_fits_the_block_budget(length, dim, itemsize, tile):
  assert depth_accumulate.choose_tile(length, dim, itemsize, itemsize) == tile


# -- on a mesh (a child process on 4 CPU devices) -------------------------------------


def sharded_results():
  """The child: under batch / batch-and-length splits of the buffer, the kernel runs
  per device and equals the add; a split over slots falls back to the add."""
  mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 2, 1), sharding.AXIS_NAMES)
  out = {}
  for name, rules in {
    'batch': dict(batch=('data', 'fsdp')),
    'batch_length': dict(batch=('data',), length=('fsdp',)),
    'slots': dict(batch=('data',), depth=('fsdp',)),
  }.items():
    rules = {**sharding.DEFAULT_RULES, **rules}
    acc_KBTD, d_KBTD, expected = operands(jnp.float32, 3, shape=(4, 4, 512, 128))

    @jax.jit
    def fn(acc_KBTD, d_KBTD):
      with sharding.logical_rules(mesh, rules):
        return depth_accumulate.accumulate(acc_KBTD, d_KBTD, 3)

    got = fn(acc_KBTD, d_KBTD)
    out[f'{name}_equal'] = bool(np.array_equal(got, expected))
    out[f'{name}_per_device'] = 'shard_map' in str(jax.make_jaxpr(fn)(acc_KBTD, d_KBTD))
  return out


def test_accumulate_on_a_mesh():
  results = child_result(__file__, 4, 'sharded')
  assert results == dict(
    batch_equal=True,
    batch_per_device=True,
    batch_length_equal=True,
    batch_length_per_device=True,
    slots_equal=True,
    slots_per_device=False,
  )


# -- inside the linear-memory backward -------------------------------------------------


def gradients(model, tokens, **changes):
  model = with_config(model, **changes)
  graphdef, state = nnx.split(model)
  loss = lambda s: jnp.mean(nnx.merge(graphdef, s)(tokens) ** 2)
  return jax.jit(jax.grad(loss))(state)


@pytest.mark.parametrize('schedule_layers', [0, 2])
def test_full_linear_memory_backward_with_the_kernels_equals_autodiff(schedule_layers):
  """Full AttnRes with the Phase 1 kernel, 128 tokens of width 128 (the accumulate
  kernel runs: lane-aligned), through the segments' scan and a shorter last segment."""
  model = tiny_model(
    'full',
    1,
    random_depth=True,
    d_model=128,
    num_heads=1,
    depth_kernel='pallas',
    schedule_layers=schedule_layers,
  )
  tokens = jax.random.randint(jax.random.key(2), (2, 128), 0, 256)
  plain = gradients(model, tokens, linear_memory_backward=False)
  linear = gradients(model, tokens, linear_memory_backward=True)
  # As test_memory.assert_grads_close (5e-5 there): the two backward passes sum the
  # same float32 terms in different orders, a few ulps of each parameter's largest
  # gradient entry; here over 128 tokens of width 128 instead of 12 of width 32, so
  # longer sums. Measured: 6.1e-5 (the MLP's up projection, schedule_layers=2), the
  # same to all digits without the accumulate kernel and the slices outside the scan
  # (main before them): the Phase 1 kernel's order of sums, not this path's.
  for (path, a), b in zip(
    jax.tree_util.tree_leaves_with_path(linear), jax.tree.leaves(plain)
  ):
    scale = float(jnp.abs(b).max()) + 1e-30
    np.testing.assert_allclose(a / scale, b / scale, atol=1e-4, err_msg=str(path))


def test_resumed_chunk_with_the_kernels_equals_autodiff():
  """A pipeline chunk (layers 2-3 of 4, resumed from the carry at segment 2, traced)
  through the linear-memory backward with both kernels: the cotangents of its layers
  and of the received carry equal plain autodiff of the chunk."""
  model = tiny_model(
    'full',
    1,
    random_depth=True,
    d_model=128,
    num_heads=1,
    num_layers=4,
    depth_kernel='pallas',
    schedule_layers=1,
  )
  residual, cfg = model.residual, model.cfg
  graphdef, layer_state = nnx.split(model.layers)
  tokens = jax.random.randint(jax.random.key(2), (2, 128), 0, 256)
  positions_BT = jnp.broadcast_to(jnp.arange(128), tokens.shape)
  run = functools.partial(
    pipeline.run_chunk, residual, graphdef, model_config=cfg, layers_per_chunk=2
  )
  head, chunk = (
    jax.tree.map(lambda x, s=s: x[s], layer_state) for s in (slice(2), slice(2, 4))
  )
  carry = run(head, residual.init(model.embed(tokens)), 0, positions_BT)
  weights = jax.tree.map(
    lambda x: jax.random.normal(jax.random.key(x.ndim), x.shape), carry
  )

  def grads(custom_stack):
    def loss(chunk, carry):
      out = run(chunk, carry, jnp.int32(2), positions_BT, custom_stack=custom_stack)
      return sum(jnp.sum(o * w) for o, w in zip(out, weights))

    grad_fn = jax.grad(loss, argnums=(0, 1))
    return grad_fn(chunk, carry), str(jax.make_jaxpr(grad_fn)(chunk, carry))

  (plain, _), (linear, jaxpr) = grads(None), grads(residual.custom_stack)
  assert 'input_output_aliases=((1, 0),)' in jaxpr  # the accumulate kernel ran
  # Tolerance as in the test above (the same float32 sums in another order).
  for (path, a), b in zip(
    jax.tree_util.tree_leaves_with_path(linear), jax.tree.leaves(plain)
  ):
    scale = float(jnp.abs(b).max()) + 1e-30
    np.testing.assert_allclose(a / scale, b / scale, atol=1e-4, err_msg=str(path))


if __name__ == '__main__' and sys.argv[1:] == ['sharded']:
  print(json.dumps(sharded_results()))
