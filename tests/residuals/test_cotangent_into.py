"""The in-place sum of Phase 1's buffer cotangent into the carried one
(`depth_pallas.cotangent_into`: the backward kernel adds into the carry; Pallas
interpret mode off the TPU), alone, on a mesh, and inside the linear-memory backward."""

import contextlib
import functools
import json
import re
import sys

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from attnres_jax import config as config_lib
from attnres_jax.residuals.attnres import depth
from attnres_jax.kernels import depth_pallas
from attnres_jax.parallel import pipeline
from attnres_jax import residuals
from attnres_jax.nn import sharding
from attnres_jax.residuals.attnres import choices
from conftest import child_result, tiny_model, tiny_model_config, with_residual

EPS = 1e-6
ALIASED = re.compile(r'input_output_aliases=\(\(\d+, 0\),\)')  # the carry in place
# float32: the kernel and autodiff of depth.phase1 sum the same float32 terms in
# another order (test_depth_pallas.F32_TOL: 1e-5 of the largest entry), the carry is
# added once in float32 on both sides. bfloat16: the kernel rounds the float32 sum
# once; the reference adds the carry to autodiff's bfloat16 cotangent (itself within
# test_depth_pallas.BF16_TOL, 2^-6 of its largest entry) and rounds again, 2^-8 of
# the sum: 2^-6 + 2^-8 of the largest entry. Measured: 1.7e-6 (float32), 7.4e-3
# (bfloat16).
TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2.0**-6 + 2.0**-8}


def operands(dtype, shape, num_queries=4):
  """A buffer whose slots differ in scale, queries, gains and a carried cotangent."""
  keys = jax.random.split(jax.random.key(0), 4)
  scale_K = jnp.arange(1, shape[0] + 1, dtype=jnp.float32).reshape(-1, 1, 1, 1)
  buffer_KBTD = (jax.random.normal(keys[0], shape) * scale_K).astype(dtype)
  queries_QD = 0.5 * jax.random.normal(keys[1], (num_queries, shape[-1]))
  gains_QD = 1.0 + 0.3 * jax.random.normal(keys[2], (num_queries, shape[-1]))
  carry_KBTD = jax.random.normal(keys[3], shape).astype(dtype)
  return buffer_KBTD, queries_QD, gains_QD, carry_KBTD


def buffer_cotangent(
  impl, buffer_KBTD, queries_QD, gains_QD, num_valid, forward=None, backward=None
):
  """The buffer's cotangent of a weighted sum of Phase 1's outputs (each its own
  random weights), the forward traced within the context `forward`, the VJP
  evaluated within `backward`."""

  def loss(buffer_KBTD):
    stats = impl(buffer_KBTD, queries_QD, gains_QD, eps=EPS, num_valid=num_valid)
    total = 0.0
    for q, (_, sum_BT, out_BTD) in enumerate(stats):
      k1, k2 = jax.random.split(jax.random.fold_in(jax.random.key(1), q))
      total += jnp.sum(sum_BT * jax.random.normal(k1, sum_BT.shape))
      total += jnp.sum(out_BTD * jax.random.normal(k2, out_BTD.shape))
    return total

  with forward or contextlib.nullcontext():
    _, vjp = jax.vjp(loss, buffer_KBTD)
  with backward or contextlib.nullcontext():
    return vjp(jnp.float32(1))[0]


def fused(
  buffer_KBTD, queries_QD, gains_QD, carry_KBTD, first_BTD, num_valid, num_zeroed
):
  into = depth_pallas.cotangent_into(
    carry_KBTD, num_zeroed=num_zeroed, d_first_BTD=first_BTD
  )
  return buffer_cotangent(
    depth_pallas.phase1, buffer_KBTD, queries_QD, gains_QD, num_valid, backward=into
  )


@functools.partial(jax.jit, static_argnums=(5, 6))
def expected(
  buffer_KBTD, queries_QD, gains_QD, carry_KBTD, first_BTD, num_valid, num_zeroed
):
  """The carry plus autodiff's cotangent of the XLA Phase 1 and (if given) `first_BTD`
  at slot 0, zeroed from num_valid on for `num_zeroed` slots (compiled: op by op it
  takes longer than the kernel it checks)."""
  d_KBTD = buffer_cotangent(depth.phase1, buffer_KBTD, queries_QD, gains_QD, num_valid)
  out_KBTD = carry_KBTD.astype(jnp.float32) + d_KBTD.astype(jnp.float32)
  if first_BTD is not None:
    out_KBTD = out_KBTD.at[0].add(first_BTD.astype(jnp.float32))
  out_KBTD = out_KBTD.astype(carry_KBTD.dtype)
  return out_KBTD.at[num_valid : num_valid + num_zeroed].set(0)


SHAPES = {'kernel': (6, 2, 256, 128), 'xla_add': (6, 2, 12, 32)}  # lanes or not


# (num_valid, num_zeroed, d_first given) of the carry's sum: zeroed slots past the
# valid ones, none zeroed, every slot valid (the zeroed ones past the buffer). Each on
# both paths (the kernel, the XLA add), in float32 on one and bfloat16 on the other:
# the dtype changes the roundings only, the path how the sum is written.
CARRY_CASES = [(1, 3, True), (4, 2, False), (2, 0, True), (6, 3, False)]


@pytest.mark.parametrize(
  'shape, dtype, num_valid, num_zeroed, first',
  [
    (shape, dtype, *case)
    for shape, dtypes in (
      ('kernel', (jnp.float32, jnp.bfloat16)),
      ('xla_add', (jnp.bfloat16, jnp.float32)),
    )
    for case, dtype in zip(CARRY_CASES, dtypes * 2)
  ],
)
def test_phase1_vjp_sums_into_the_carry(shape, dtype, num_valid, num_zeroed, first):
  args = operands(dtype, SHAPES[shape])
  first_BTD = (
    3 * jax.random.normal(jax.random.key(5), SHAPES[shape][1:]) if first else None
  )
  fn = jax.jit(functools.partial(fused, num_zeroed=num_zeroed))
  got = fn(*args, first_BTD, jnp.int32(num_valid))
  want = expected(*args, first_BTD, num_valid, num_zeroed)
  assert got.dtype == want.dtype == dtype
  valid = slice(0, num_valid)
  scale = float(jnp.abs(want[valid].astype(jnp.float32)).max())
  np.testing.assert_allclose(
    np.asarray(got[valid], np.float32) / scale,
    np.asarray(want[valid], np.float32) / scale,
    atol=TOL[dtype],
  )
  # The zeroed slots and the later ones (the carry's own, through the alias): exact.
  np.testing.assert_array_equal(got[num_valid:], want[num_valid:])
  jaxpr = str(jax.make_jaxpr(fn)(*args, first_BTD, jnp.int32(num_valid)))
  assert bool(ALIASED.search(jaxpr)) == (shape == 'kernel')


@pytest.mark.parametrize(
  'shape, dtype, num_valid',
  [  # both layouts in both dtypes; every slot valid on one, two past the valid on the other
    ('kernel', jnp.float32, 6),
    ('kernel', jnp.bfloat16, 4),
    ('xla_add', jnp.float32, 4),
    ('xla_add', jnp.bfloat16, 6),
  ],
)
def test_phase1_vjp_written_width_minor_equals_xla(shape, dtype, num_valid):
  """Without a carry, `width_minor_cotangent` (the final read's): the kernel writes
  the buffer's cotangent in [tile, D] blocks where the lanes allow, the XLA layout
  elsewhere; either way autodiff's cotangent of the XLA Phase 1, zero past num_valid."""
  buffer_KBTD, queries_QD, gains_QD, _ = operands(dtype, SHAPES[shape], num_queries=1)
  impl = functools.partial(depth_pallas.phase1, width_minor_cotangent=True)
  fn = jax.jit(lambda *a: buffer_cotangent(impl, *a, num_valid))
  got = fn(buffer_KBTD, queries_QD, gains_QD)
  reference = jax.jit(lambda *a: buffer_cotangent(depth.phase1, *a, num_valid))
  want = reference(buffer_KBTD, queries_QD, gains_QD)
  assert got.dtype == want.dtype == dtype
  scale = float(jnp.abs(want.astype(jnp.float32)).max())
  # As the carry's sums above without the carry: float32 the same terms in another
  # order; bfloat16 both round autodiff's cotangent once (test_depth_pallas.BF16_TOL).
  np.testing.assert_allclose(
    np.asarray(got, np.float32) / scale,
    np.asarray(want, np.float32) / scale,
    atol=TOL[dtype],
  )
  np.testing.assert_array_equal(got[num_valid:], 0)
  # The backward kernel's cotangent output: [K, B, T, D] (width minor) where the
  # lanes allow, [K, B, D, T] (tokens minor) elsewhere.
  k, b, t, d = SHAPES[shape]
  jaxpr = str(jax.make_jaxpr(fn)(buffer_KBTD, queries_QD, gains_QD))
  dims = ','.join(map(str, (k, b, t, d) if shape == 'kernel' else (k, b, d, t)))
  name = {jnp.float32: 'f32', jnp.bfloat16: 'bf16'}[dtype]
  assert re.search(rf':{name}\[{dims}\] [^=]*= pallas_call', jaxpr)


def test_carry_of_another_dtype_is_refused():
  buffer_KBTD, queries_QD, gains_QD, carry_KBTD = operands(jnp.bfloat16, (3, 1, 8, 32))
  traced = jax.jit(fused, static_argnums=(5, 6))  # refused while tracing, before a run
  with pytest.raises(ValueError, match="carry of the buffer's shape and dtype"):
    traced(buffer_KBTD, queries_QD, gains_QD, carry_KBTD.astype(jnp.float32), None, 2, 1)


def cost_bytes(num_valid, expected_valid=None, num_zeroed=2, shape=(9, 2, 256, 128)):
  """The CostEstimate bytes of the forward and the backward kernel (in that order)
  of `fused`, with num_valid a Python int or (expected_valid given) traced."""
  args = operands(jnp.float32, shape)

  def fn(*args, num_valid):
    return buffer_cotangent(
      depth_pallas.phase1,
      *args[:3],
      num_valid,
      forward=depth_pallas.expected_valid(expected_valid),
      backward=depth_pallas.cotangent_into(args[3], num_zeroed=num_zeroed),
    )

  traced = expected_valid is not None
  jaxpr = str(
    jax.make_jaxpr(fn if traced else functools.partial(fn, num_valid=num_valid))(
      *args, **(dict(num_valid=jnp.int32(num_valid)) if traced else {})
    )
  )
  counts = re.findall(r'bytes_accessed=(\d+)', jaxpr)
  assert len(counts) == 4  # each kernel: the TPU and the interpreted version
  assert counts[0] == counts[1] and counts[2] == counts[3]
  return int(counts[0]), int(counts[2])


def test_cost_estimates_charge_the_stated_mean_of_a_traced_num_valid():
  """A traced num_valid (a scan over segments) is charged the mean the caller states,
  as a Python int num_valid is charged itself: the compiler's total over the scan's
  calls is what the kernels load. What one call loads (BlockSpecs): the forward reads
  num_valid slots; the backward reads them, and the carry at them, and writes the
  carry at num_valid + num_zeroed slots."""
  slot = 2 * 256 * 128 * 4
  forward_2, backward_2 = cost_bytes(2)
  forward_4, backward_4 = cost_bytes(4)
  assert forward_4 - forward_2 == 2 * slot
  assert backward_4 - backward_2 == 2 * 3 * slot
  assert cost_bytes(4, expected_valid=3.0) == tuple(
    (a + b) // 2 for a, b in zip((forward_2, backward_2), (forward_4, backward_4))
  )
  # Slots past the buffer are neither read nor zeroed: num_valid + num_zeroed <= K.
  assert cost_bytes(8)[1] - backward_4 == 4 * 2 * slot + 3 * slot


def test_layer_scan_charges_phase1_the_mean_of_its_valid_slots():
  """Block over four one-layer segments (K = 5 slots; the segments' first local slots,
  Phase 1's num_valid, are 1, 2, 3, 4): the linear-memory stack's forward (as its
  backward) has the Phase 1 kernel in the segments' scan charge 2.5 slots a call,
  what it loads on average, not all K; so does its primal (no gradient taken). The
  final read's kernel (one query over all K slots, a static count) is charged K."""
  model = tiny_model(
    'block',
    2,
    num_layers=4,
    schedule_layers=1,
    depth_kernel='pallas',
  )
  residual = model.residual
  graphdef, state = nnx.split(model)
  tokens = jnp.zeros((2, 16), jnp.int32)
  loss = lambda s: jnp.mean(nnx.merge(graphdef, s)(tokens) ** 2)
  costs = lambda jaxpr: {int(c) for c in re.findall(r'bytes_accessed=(\d+)', str(jaxpr))}

  def alone(mean, final=False):
    """The forward kernel's cost for the model's shapes: a segment's Phase 1
    (num_valid traced), or the final read's (`final`)."""
    ones_QD = jnp.ones((1 if final else 2, 32))
    fn = lambda buffer_KBTD, num_valid: depth_pallas.phase1(
      buffer_KBTD,
      ones_QD,
      ones_QD,
      eps=EPS,
      num_valid=5 if final else num_valid,
      inv_rms_KBT=None if final else jnp.ones((5, 2, 16)),
      out_dtype=jnp.float32 if final else residual.phase1_dtype,
      width_minor_cotangent=final,
    )
    buffer_KBTD = jnp.zeros((5, 2, 16, 32), residual.storage_dtype)
    costed = depth_pallas.expected_valid(mean) if mean else contextlib.nullcontext()
    with costed:
      return costs(jax.make_jaxpr(fn)(buffer_KBTD, jnp.int32(1)))

  mean, every_slot, final = alone(2.5), alone(None), alone(None, final=True)
  assert len(mean) == 1 and mean != every_slot and not final & (mean | every_slot)
  # The primal: forward kernels only.
  assert costs(jax.make_jaxpr(loss)(state)) == mean | final
  with_grad = costs(jax.make_jaxpr(jax.grad(loss))(state))
  assert mean <= with_grad and not every_slot & with_grad


# -- on a mesh (a child process on 4 CPU devices) -------------------------------------


def sharded_results():
  """The child: under batch / batch-and-length splits of the buffer, the fused
  kernel runs per device and equals the reference."""
  mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 2, 1), sharding.AXIS_NAMES)
  out = {}
  for name, rules in {
    'batch': dict(batch=('data', 'fsdp')),
    'batch_length': dict(batch=('data',), length=('fsdp',)),
  }.items():
    rules = {**sharding.DEFAULT_RULES, **rules}
    args = operands(jnp.float32, (5, 4, 512, 128))

    @jax.jit
    def fn(*args):
      with sharding.logical_rules(mesh, rules):
        return fused(*args, first_BTD, jnp.int32(3), 1)

    first_BTD = jax.random.normal(jax.random.key(5), (4, 512, 128))
    want = expected(*args, first_BTD, 3, 1)
    got = fn(*args)
    out[f'{name}_error'] = float(np.abs(got - want).max() / np.abs(want).max())
    jaxpr = str(jax.make_jaxpr(fn)(*args))
    out[f'{name}_per_device'] = 'shard_map' in jaxpr and bool(ALIASED.search(jaxpr))
  return out


def test_phase1_vjp_sums_into_the_carry_on_a_mesh():
  results = child_result(__file__, 4, 'sharded')
  assert set(results) == {
    f'{name}_{what}'
    for name in ('batch', 'batch_length')
    for what in ('error', 'per_device')
  }
  for name, value in results.items():
    assert value is True if name.endswith('per_device') else value <= TOL[jnp.float32]


# -- inside the linear-memory backward -------------------------------------------------


def gradients(model, tokens, **residual_fields):
  """The gradients and the jaxpr of their program (the same trace: the jit's cache);
  `residual_fields`: AttnResResidual's test-only references."""
  model = with_residual(model, **residual_fields)
  graphdef, state = nnx.split(model)
  loss = lambda s: jnp.mean(nnx.merge(graphdef, s)(tokens) ** 2)
  grad_fn = jax.jit(jax.grad(loss))
  return grad_fn(state), jax.make_jaxpr(grad_fn)(state).jaxpr


def test_phase1_with_kept_results_returns_them_and_the_kernels_vjp():
  """`phase1(kept=...)`: an earlier call's results, returned as they are, and the
  VJP of a call that runs the forward kernel itself. Exactly equal: the kernel is
  deterministic, so the kept maximum (the backward kernel's only residual from the
  forward one) is the one the call would compute, and the same backward kernel runs
  on the same operands."""
  buffer_KBTD, queries_QD, gains_QD, _ = operands(jnp.float32, SHAPES['kernel'])
  call = functools.partial(depth_pallas.phase1, eps=EPS, num_valid=4)
  kept = call(buffer_KBTD, queries_QD, gains_QD)
  plain, plain_vjp = jax.vjp(call, buffer_KBTD, queries_QD, gains_QD)
  again, kept_vjp = jax.vjp(
    functools.partial(call, kept=kept), buffer_KBTD, queries_QD, gains_QD
  )
  chex.assert_trees_all_equal(again, kept)
  chex.assert_trees_all_equal(again, plain)
  keys = iter(jax.random.split(jax.random.key(5), 3 * len(plain)))
  cotangent = jax.tree.map(lambda x: jax.random.normal(next(keys), x.shape), plain)
  chex.assert_trees_all_equal(kept_vjp(cotangent), plain_vjp(cotangent))


@pytest.mark.parametrize(
  'residual, block_size, num_layers, keeps',
  [
    ('full', 1, 32, True),  # 2-layer segments: 31 slots read on average, 4 queries
    ('full', 1, 16, True),  # 15 slots
    ('full', 1, 8, False),  # 7 slots
    ('block', 4, 32, False),  # 8.5: 7.5 completed blocks and the embedding
    ('block', 4, 8, False),  # 2.5
    ('block', 8, 32, False),  # 4.5 against 8 queries
  ],
)
def test_auto_keeps_phase1_where_its_reads_outweigh_its_outputs(
  residual, block_size, num_layers, keeps
):
  """Phase 1's results kept for the backward pass where a segment's Phase 1, computed
  again, would read more than three times as many slots as it writes outputs."""
  cfg = tiny_model_config(residual=residual, block_size=block_size, num_layers=num_layers)
  attnres = residuals.make(config_lib.ModelConfig.from_config(cfg))
  segments = num_layers // attnres.segment_layers
  mean_first = sum(attnres.first_local_slot(s) for s in range(segments)) / segments
  queries = 2 * attnres.segment_layers
  assert choices.keeps_phase1(mean_first, queries) == keeps


def kernel_launches(jaxpr) -> int:
  """The Pallas calls in `jaxpr` and the jaxprs it holds (a loop's body once, each
  branch of a conditional)."""
  count = 0
  for eqn in jaxpr.eqns:
    count += eqn.primitive.name == 'pallas_call'
    for value in eqn.params.values():
      for sub in value if isinstance(value, (list, tuple)) else [value]:
        if isinstance(sub, (jax.extend.core.ClosedJaxpr, jax.extend.core.Jaxpr)):
          count += kernel_launches(getattr(sub, 'jaxpr', sub))
  return count


@pytest.mark.parametrize(
  'residual, block_size, schedule_layers, phase1_backwards, segment_kinds',
  [
    ('full', 1, 0, ('auto', 'keep'), 1),  # 3 segments of 1 layer
    ('full', 1, 2, ('auto',), 2),
    # segments of 2 layers, one block each, and one of 1
    ('block', 4, 0, ('auto', 'keep'), 2),
  ],
  ids=['full-1-0-auto-keep', 'full-1-2-auto', 'block-4-0-auto-keep'],
)
def test_linear_memory_backward_with_the_kernels_equals_autodiff(
  residual, block_size, schedule_layers, phase1_backwards, segment_kinds
):
  """Full and Block AttnRes with the Phase 1 kernel, 128 tokens of width 128 (the
  accumulate kernel runs: lane-aligned), through the segments' scan and a shorter
  last segment; with Phase 1 computed again in the backward pass (what 'auto' picks
  at this depth) or kept from the forward pass ('keep'), each against one plain
  autodiff of the same model."""
  model = tiny_model(
    residual,
    block_size,
    random_depth=True,
    d_model=128,
    num_heads=1,
    depth_kernel='pallas',
    schedule_layers=schedule_layers,
  )
  tokens = jax.random.randint(jax.random.key(2), (2, 128), 0, 256)
  plain, _ = gradients(model, tokens, autodiff_backward=True)
  # What 'auto' picks at this depth: Phase 1 computed again (the rule as
  # `attnres.backward` applies it, over the scan's segments' first slots); so the
  # 'auto' program below is the one that recomputes, which 'keep' is compared with.
  residual = model.residual
  segments = model.cfg.num_layers // residual.segment_layers
  mean_first = sum(residual.first_local_slot(s) for s in range(segments)) / segments
  assert not choices.keeps_phase1(
    mean_first, residual.sublayers_per_layer * residual.segment_layers
  )
  jaxprs = {}
  for phase1_backward in phase1_backwards:
    # 'auto': the rule (`choices.keeps_phase1`); 'keep': the test-only override.
    keep = {'auto': None, 'keep': True}[phase1_backward]
    linear, jaxpr = gradients(model, tokens, keep_phase1=keep)
    jaxprs[phase1_backward] = jaxpr
    assert re.search(r'input_output_aliases=\(\(\d+, 0\),\)', str(jaxpr))  # fused sum
    if phase1_backward == 'keep':  # the backward pass launches no forward kernel: one
      # fewer in the scan's body and in a shorter last segment (`segment_kinds` of
      # them), each one per platform (jax.lax.platform_dependent: TPU, interpret mode)
      recomputed = jaxprs['auto']  # Phase 1 computed again (above)
      removed = kernel_launches(recomputed) - kernel_launches(jaxpr)
      assert removed == segment_kinds * 2
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
      np.testing.assert_allclose(
        a / scale, b / scale, atol=1e-4, err_msg=f'{phase1_backward} {path}'
      )


@pytest.mark.parametrize(
  'residual_name, block_size, schedule_layers', [('full', 1, 1), ('block', 4, 0)]
)
def test_resumed_chunk_with_the_kernels_equals_autodiff(
  residual_name, block_size, schedule_layers
):
  """A pipeline chunk (layers 2-3 of 4, resumed from the carry at its first
  segment, traced) through the linear-memory backward with the kernels: the
  cotangents of its layers and of the received carry equal plain autodiff of the
  chunk. Full: one layer a segment; Block S=4: one 2-layer segment."""
  model = tiny_model(
    residual_name,
    block_size,
    random_depth=True,
    d_model=128,
    num_heads=1,
    num_layers=4,
    depth_kernel='pallas',
    schedule_layers=schedule_layers,
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
  # Compiled (op by op, the kernels' interpret mode dispatches hundreds of programs).
  head_fn = jax.jit(lambda head, x: run(head, residual.init(x), 0, positions_BT))
  carry = head_fn(head, model.embed(tokens))
  weights = jax.tree.map(
    lambda x: jax.random.normal(jax.random.key(x.ndim), x.shape), carry
  )

  def grads(custom_stack):
    def loss(chunk, carry):
      first_segment = jnp.int32(2 // residual.segment_layers)
      out = run(chunk, carry, first_segment, positions_BT, custom_stack=custom_stack)
      return sum(jnp.sum(o * w) for o, w in zip(out, weights))

    grad_fn = jax.jit(jax.grad(loss, argnums=(0, 1)))
    return grad_fn(chunk, carry), str(jax.make_jaxpr(grad_fn)(chunk, carry))

  (plain, _), (linear, jaxpr) = grads(None), grads(residual.custom_stack)
  # Full's chunks sum into the carried cotangent in the fused kernel; Block's add
  # outside it (faster there, `attnres_backward.make_stack`).
  fused = re.search(r'input_output_aliases=\(\(\d+, 0\),\)', jaxpr)
  assert bool(fused) == (residual_name == 'full')
  # Tolerance as in the test above (the same float32 sums in another order).
  for (path, a), b in zip(
    jax.tree_util.tree_leaves_with_path(linear), jax.tree.leaves(plain)
  ):
    scale = float(jnp.abs(b).max()) + 1e-30
    np.testing.assert_allclose(a / scale, b / scale, atol=1e-4, err_msg=str(path))


if __name__ == '__main__' and sys.argv[1:] == ['sharded']:
  print(json.dumps(sharded_results()))
