"""The Pallas Phase 1 kernel (depth_pallas.py) equals the XLA one (depth.phase1).

On the CPU the kernels run in Pallas interpret mode: the same kernel code, the same
float32 arithmetic in the same order as on the TPU, so these tests check the kernel's
math (forward and the hand-written VJP) against JAX autodiff of the XLA version. The
TPU lowering itself (Mosaic) is checked by an ahead-of-time compile.
"""

import functools
import importlib.util
import json
import os
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from attnres_jax.compile_report import aot
from attnres_jax.residuals.attnres import depth
from attnres_jax.kernels import depth_pallas
from attnres_jax.kernels import depth_pallas_kernels
from attnres_jax import residuals
from attnres_jax.nn import sharding
from attnres_jax.compile_report import tpu_topology
from configs import default as default_config
from conftest import child_result
from conftest import tiny_model
from conftest import tiny_model_config
from conftest import with_config
from conftest import with_residual
from tests.kernels.mesh_checks import MESH_RULES
from tests.kernels.mesh_checks import assert_mesh_results
from tests.kernels.mesh_checks import max_relative_error

EPS = 1e-6
BATCH, LENGTH = 2, 8

# float32: the two versions sum the same float32 terms (dots over D = 32, exponentials
# and weighted sums over K <= 7 slots) in different orders; each result is a few ulps
# (2^-24) of the largest, amplified by at most |logit| (< 30 here) through the
# exponential: 1e-5 of the largest entry. Measured: <= 1.8e-6.
F32_TOL = 1e-5
# A bfloat16 result (an output in bfloat16, or the bfloat16 buffer's cotangent) is the
# rounding of two float32 values that differ as above: they round to neighbouring
# bfloat16 values at worst, one ulp, 2^-8 of the value. The XLA cotangent of a
# bfloat16 buffer is also the bfloat16 sum of its three bfloat16-rounded terms (the
# weighted sum, the logits, the RMS): three more roundings. 2^-6 of the largest.
# Measured: 3.0e-3 (the buffer's cotangent), 6.3e-7 (the rest).
BF16_TOL = 2.0**-6


def schedule_cases(residual, block_size):
  """(K slots, Q queries, num_valid) of each Phase 1 call of the tiny model (3 layers,
  6 sublayers) under `residual` with blocks of `block_size` sublayers."""
  r = residuals.make(tiny_model_config(residual=residual, block_size=block_size))
  num_layers, per_segment = r.cfg.num_layers, r.segment_layers
  return [
    (r.num_slots, 2 * min(per_segment, num_layers - layer), r.first_local_slot(segment))
    for segment, layer in enumerate(range(0, num_layers, per_segment))
  ]


SCHEDULES = {
  'block_s1': ('block', 1),
  'block_s2': ('block', 2),
  'block_s3': ('block', 3),
  'block_sL': ('block', 6),
  'full': ('full', 1),
}


def inputs(num_slots, num_queries, dtype, seed=0, batch=BATCH):
  """A buffer whose slots differ in scale (the logits are far from uniform), queries,
  gains and the buffer's inverse RMS."""
  keys = jax.random.split(jax.random.key(seed), 3)
  scale_K = jnp.arange(1, num_slots + 1, dtype=jnp.float32).reshape(-1, 1, 1, 1)
  buffer_KBTD = (
    jax.random.normal(keys[0], (num_slots, batch, LENGTH, 32)) * scale_K
  ).astype(dtype)
  queries_QD = 0.5 * jax.random.normal(keys[1], (num_queries, 32))
  gains_QD = 1.0 + 0.3 * jax.random.normal(keys[2], (num_queries, 32))
  return buffer_KBTD, queries_QD, gains_QD, depth.rms_inverse(buffer_KBTD, EPS)


def weighted_sum(stats, seed=1):
  """A scalar of every output (sum and output of each query) with random weights, so
  that each gets its own cotangent."""
  total = 0.0
  for q, (_, sum_BT, out_BTD) in enumerate(stats):
    k1, k2 = jax.random.split(jax.random.fold_in(jax.random.key(seed), q))
    total += jnp.sum(sum_BT * jax.random.normal(k1, sum_BT.shape))
    total += jnp.sum(out_BTD.astype(jnp.float32) * jax.random.normal(k2, out_BTD.shape))
  return total


@functools.cache
def compiled_grads(impl, out_dtype, carried_rms):
  """The gradients of `weighted_sum` w.r.t. buffer, queries, gains and (`carried_rms`)
  the inverse RMS, with Phase 1's statistics, compiled once: the calls of one shape
  (a schedule's segments; num_valid traced as in the scan) share a compilation."""

  def loss(buffer_KBTD, queries_QD, gains_QD, inv_rms_KBT, num_valid):
    stats = impl(
      buffer_KBTD,
      queries_QD,
      gains_QD,
      eps=EPS,
      num_valid=num_valid,
      inv_rms_KBT=inv_rms_KBT,
      out_dtype=out_dtype,
    )
    return weighted_sum(stats), stats

  argnums = (0, 1, 2, 3) if carried_rms else (0, 1, 2)
  return jax.jit(jax.grad(loss, argnums=argnums, has_aux=True))


def run(impl, buffer_KBTD, queries_QD, gains_QD, inv_rms_KBT, num_valid, out_dtype):
  """(forward statistics, gradients of `weighted_sum` w.r.t. buffer, queries, gains
  and the inverse RMS when given)."""
  grad_fn = compiled_grads(impl, out_dtype, inv_rms_KBT is not None)
  grads, stats = grad_fn(buffer_KBTD, queries_QD, gains_QD, inv_rms_KBT, num_valid)
  return stats, grads


def assert_close(actual, expected, tol, what):
  actual, expected = (np.asarray(x, np.float32) for x in (actual, expected))
  assert actual.dtype == expected.dtype and actual.shape == expected.shape, what
  scale = float(np.abs(expected).max()) + 1e-30
  np.testing.assert_allclose(actual / scale, expected / scale, atol=tol, err_msg=what)


def check_equal(num_slots, num_queries, num_valid, dtype, out_dtype, carried_rms):
  buffer_KBTD, queries_QD, gains_QD, inv_rms_KBT = inputs(num_slots, num_queries, dtype)
  inv_rms_KBT = inv_rms_KBT if carried_rms else None
  traced_valid = None if num_valid is None else jnp.int32(num_valid)
  args = (buffer_KBTD, queries_QD, gains_QD, inv_rms_KBT, traced_valid, out_dtype)
  xla_stats, xla_grads = run(depth.phase1, *args)
  pallas_stats, pallas_grads = run(depth_pallas.phase1, *args)
  assert len(pallas_stats) == num_queries
  for q, (a, b) in enumerate(zip(pallas_stats, xla_stats)):
    assert a[2].dtype == b[2].dtype == jnp.dtype(out_dtype)
    for name, x, y in zip(('max', 'sum', 'out'), a, b):
      tol = BF16_TOL if x.dtype == jnp.bfloat16 else F32_TOL
      assert_close(x, y, tol, f'query {q} {name}')
  for name, x, y in zip(
    ('buffer', 'queries', 'gains', 'inv_rms'), pallas_grads, xla_grads
  ):
    assert x.dtype == y.dtype, name
    tol = BF16_TOL if (x.dtype == jnp.bfloat16 or out_dtype == jnp.bfloat16) else F32_TOL
    assert_close(x, y, tol, f'd {name}')
  if num_valid is not None:  # slots past num_valid get no gradient at all
    np.testing.assert_array_equal(np.asarray(pallas_grads[0][num_valid:], np.float32), 0)


@pytest.mark.parametrize('schedule', list(SCHEDULES))
def test_each_phase1_call_of_a_schedule_equals_xla(schedule):
  """float32 buffer, the inverse RMS recomputed (the backward's case), every segment's
  (K, Q, num_valid < K) of the schedule."""
  for num_slots, num_queries, num_valid in schedule_cases(*SCHEDULES[schedule]):
    assert num_valid < num_slots
    check_equal(num_slots, num_queries, num_valid, jnp.float32, jnp.float32, False)


@pytest.mark.parametrize(
  'dtype, out_dtype, carried_rms',
  [
    (jnp.float32, jnp.float32, True),  # the forward's case: the carried inverse RMS
    (jnp.bfloat16, jnp.float32, False),
    (jnp.bfloat16, jnp.float32, True),
    (jnp.bfloat16, jnp.bfloat16, False),  # depth_dtype='bfloat16'
  ],
)
def test_storage_dtypes_and_carried_rms_equal_xla(dtype, out_dtype, carried_rms):
  check_equal(7, 4, 3, dtype, out_dtype, carried_rms)  # Full, 3 layers, segment 2


def test_all_slots_valid_and_a_single_query():
  check_equal(4, 1, 4, jnp.float32, jnp.float32, False)
  check_equal(4, 2, None, jnp.float32, jnp.float32, True)


def test_many_slots_few_valid():
  """K large relative to the valid slots: the steps past num_valid read nothing new
  and add nothing (Full over 16 layers has 33 slots; its first segment reads 1)."""
  check_equal(33, 4, 1, jnp.float32, jnp.float32, False)
  check_equal(33, 2, 3, jnp.bfloat16, jnp.float32, True)


def forward_cost_bytes(num_slots, num_valid, traced):
  """The forward kernel's CostEstimate bytes for a [K, 2, 128, 32] float32 buffer."""
  buffer_KBTD = jnp.zeros((num_slots, 2, 128, 32))
  queries_QD = jnp.ones((4, 32))

  def fn(buffer_KBTD, num_valid):
    return depth_pallas.phase1(
      buffer_KBTD, queries_QD, queries_QD, eps=EPS, num_valid=num_valid
    )

  fn = fn if traced else functools.partial(fn, num_valid=num_valid)
  args = (buffer_KBTD, jnp.int32(num_valid)) if traced else (buffer_KBTD,)
  counts = re.findall(r'bytes_accessed=(\d+)', str(jax.make_jaxpr(fn)(*args)))
  assert counts and len(set(counts)) == 1  # the TPU and the interpreted version
  return int(counts[0])


def test_cost_estimate_counts_the_valid_slots_only_when_static():
  """A Python int num_valid bounds the slots the forward reads (the CostEstimate the
  TPU compiler charges the call); a traced one (the layer scan) counts all K."""
  slot = 2 * 128 * 32 * 4
  static = forward_cost_bytes(33, 2, traced=False)
  assert forward_cost_bytes(33, 33, traced=False) - static == 31 * slot
  assert forward_cost_bytes(33, 2, traced=True) - static == 31 * slot


def test_tile_is_lane_aligned_divides_the_length_and_fits_the_budget():
  for length, queries, dim, itemsize in [
    (1024, 4, 1024, 2),
    (1024, 16, 1024, 2),
    (2048, 32, 2048, 4),  # over budget even at 128: the least tile
    (8, 4, 32, 4),  # shorter than a lane row: the whole length
    (200, 4, 32, 4),  # no multiple of 128 divides it: the whole length
  ]:
    tile = depth_pallas_kernels.choose_tile(length, queries, dim, itemsize, 2)
    assert length % tile == 0
    if length % 128 == 0:
      assert tile % 128 == 0
      need = depth_pallas_kernels.vmem_bytes(tile, queries, dim, itemsize, 2)
      assert tile == 128 or need <= depth_pallas_kernels.TILE_VMEM_BYTES
    else:
      assert tile == length


# -- the whole model -----------------------------------------------------------------


def loss_and_grads(model, **changes):
  model = with_config(model, **changes)
  tokens = jax.random.randint(jax.random.key(2), (2, 12), 0, 256)
  graphdef, state = nnx.split(model)

  @jax.jit
  def fn(state):
    return jax.value_and_grad(lambda s: jnp.mean(nnx.merge(graphdef, s)(tokens) ** 2))(
      state
    )

  return fn(state)


@pytest.mark.parametrize(
  'residual, block_size, changes',
  [
    ('block', 2, {}),
    ('block', 3, dict(autodiff_backward=True)),  # plain autodiff of the kernel
    ('full', 1, {}),
    ('block', 4, dict(dtype='bfloat16', depth_dtype='bfloat16')),
    # Full's fused backward (cotangent_into) with bfloat16 Phase 1 outputs: the
    # build `full/bf16/pallas` that the TPU report quotes.
    ('full', 1, dict(dtype='bfloat16', depth_dtype='bfloat16')),
  ],
)
def test_tiny_model_loss_and_gradients_equal_xla(residual, block_size, changes):
  changes = dict(changes)
  plain = changes.pop('autodiff_backward', False)  # a test-only residual field
  model = tiny_model(residual, block_size, random_depth=True, **changes)
  model = with_residual(model, autodiff_backward=plain)
  xla_loss, xla_grads = loss_and_grads(model)
  pallas_loss, pallas_grads = loss_and_grads(model, depth_kernel='pallas')
  bf16 = changes.get('dtype') == 'bfloat16'
  # float32: as in test_memory.assert_grads_close, a few ulps of each parameter's
  # largest gradient entry after ~20 layers of float32 arithmetic. bfloat16: every
  # sublayer rounds its activations to bfloat16, so a one-ulp difference in a Phase 1
  # output (above) can flip later roundings: a few bfloat16 ulps, 2^-5. Measured:
  # 5.8e-6 (float32, Block S=2), 1.3e-2 (bfloat16, Block S=4).
  tol = 2.0**-5 if bf16 else 5e-5
  np.testing.assert_allclose(pallas_loss, xla_loss, rtol=tol)
  for (path, a), b in zip(
    jax.tree_util.tree_leaves_with_path(pallas_grads), jax.tree.leaves(xla_grads)
  ):
    scale = float(jnp.abs(b).max()) + 1e-30
    np.testing.assert_allclose(a / scale, b / scale, atol=tol, err_msg=str(path))


def test_pallas_kernel_needs_the_two_phase_read():
  with pytest.raises(ValueError, match="depth_kernel='pallas'.*two-phase"):
    tiny_model_config(depth_kernel='pallas', residual='full', depth_window=2)
  with pytest.raises(ValueError, match='depth_kernel must be one of'):
    tiny_model_config(depth_kernel='triton')


def test_pallas_kernel_that_cannot_fit_on_chip_memory_is_refused():
  """The kernels hold one slot at a time, so what they need does not grow with the
  slots: Full AttnRes over 16 or 64 layers (33 or 129 slots; refused at width 2048
  when the whole buffer sat in VMEM) is accepted. It grows with a segment's queries
  and their dtype: one segment of 16 layers (32 queries) at width 2048 needs about
  70 MiB at the narrowest tile with bfloat16 outputs (the compute dtype's, the
  default) and 103 MiB with float32 storage, more than v5p's 64 MiB: refused."""
  full = dict(residual='full', dtype='bfloat16', depth_kernel='pallas', mlp_dim=64)
  wide = dict(d_model=2048, num_heads=16)
  for layers in (16, 64):
    tiny_model_config(**full, **wide, num_layers=layers)
  with pytest.raises(ValueError, match="needs 69.6 MiB.*depth_kernel='xla'"):
    tiny_model_config(**full, **wide, num_layers=16, schedule_layers=16)
  with pytest.raises(ValueError, match="needs 102.6 MiB.*depth_kernel='xla'"):
    tiny_model_config(
      **full, **wide, num_layers=16, schedule_layers=16, depth_dtype='float32'
    )
  tiny_model_config(**full, d_model=1024, num_heads=8, num_layers=16, schedule_layers=4)


# -- on a device mesh (a child process with 4 CPU devices) ------------------------------


def sharded_errors():
  """The child: on a (2, 2, 1) mesh under each of MESH_RULES, the largest relative
  difference between the Pallas Phase 1 there and the XLA one on one device (forward
  and gradients; computed once for both rules)."""
  mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 2, 1), sharding.AXIS_NAMES)
  buffer_KBTD, queries_QD, gains_QD, inv_rms_KBT = inputs(7, 4, jnp.float32, batch=4)
  host = lambda x: jax.tree.map(np.asarray, x)
  rms = {False: None, True: inv_rms_KBT}  # carried or not
  reference = {
    carried: host(
      run(depth.phase1, buffer_KBTD, queries_QD, gains_QD, r, jnp.int32(5), jnp.float32)
    )
    for carried, r in rms.items()
  }
  out = {}
  for name, rules in MESH_RULES.items():
    rules = {**sharding.DEFAULT_RULES, **rules}
    spec = sharding.logical_to_spec(sharding.DEPTH_BUFFER, rules, mesh=mesh)
    placed_KBTD = jax.device_put(buffer_KBTD, jax.NamedSharding(mesh, spec))

    def impl(fn, *args, **kwargs):
      with sharding.logical_rules(mesh, rules):
        return fn(*args, **kwargs)

    for carried, r in rms.items():
      args = (placed_KBTD, queries_QD, gains_QD, r, jnp.int32(5), jnp.float32)
      pallas = run(functools.partial(impl, depth_pallas.phase1), *args)
      out[f'{name}_carried_rms_{carried}'] = max_relative_error(
        host(pallas), reference[carried]
      )
    jaxpr = jax.make_jaxpr(
      functools.partial(impl, depth_pallas.phase1, eps=EPS, num_valid=5)
    )(placed_KBTD, queries_QD, gains_QD)
    out[f'{name}_per_device'] = 'shard_map' in str(jaxpr)  # the kernel runs per device
  rules = {**sharding.DEFAULT_RULES, 'batch': ('data',), 'hidden': ('fsdp',)}
  try:
    with sharding.logical_rules(mesh, rules):
      depth_pallas.phase1(placed_KBTD, queries_QD, gains_QD, eps=EPS, num_valid=5)
    out['width_split_refused'] = False
  except ValueError as e:
    out['width_split_refused'] = "map 'depth' and 'hidden' to no mesh axis" in str(e)
  return out


def test_kernel_on_a_mesh_equals_xla():
  errors = child_result(__file__, 4, 'sharded')
  # As on one device: float32 summation order.
  assert_mesh_results(errors, 3 * len(MESH_RULES) + 1, F32_TOL)


# -- the TPU lowering ----------------------------------------------------------------

needs_libtpu = pytest.mark.skipif(
  importlib.util.find_spec('libtpu') is None,
  reason='libtpu (the TPU compiler) is not installed',
)


@needs_libtpu
def test_tiny_model_train_step_compiles_for_tpu_with_the_kernel(tmp_path):
  """Mosaic lowers both kernels inside the production train step (data parallel on
  v5e:2x2: the kernels run per device under shard_map) and the byte count includes
  them."""
  config = default_config.get_config('tiny')
  config.model.update(dtype='bfloat16', residual='block', block_size=2)
  config.model.depth_kernel = 'pallas'
  report = aot.compile_report(config, 'v5e:2x2', steps=('train',), hlo_dir=str(tmp_path))
  step = report['steps']['train']
  assert step['bytes_accessed'] > 0 and step['est_step_seconds'] > 0
  with open(os.path.join(tmp_path, 'train.hlo.txt'), encoding='utf-8') as f:
    text = f.read()
  assert text.count('custom_call_target="tpu_custom_call"') >= 2  # forward, backward


@needs_libtpu
def test_full_attnres_over_16_layers_at_width_2048_compiles_for_v5p():
  """The shape whose all-slot block (33 slots) ran v5p out of VMEM: one device's
  Phase 1 of Full AttnRes at d2048 (8 rows of 1024 tokens, 4 queries, bfloat16),
  forward and backward, now compiles (one slot per step)."""
  device = tpu_topology.get_topology('v5p:2x2x1').devices[0]
  placed = jax.sharding.SingleDeviceSharding(device)

  def loss(buffer_KBTD, queries_QD, num_valid):
    stats = depth_pallas.phase1(
      buffer_KBTD, queries_QD, queries_QD, eps=EPS, num_valid=num_valid
    )
    return sum(jnp.sum(s) + jnp.sum(o) for _, s, o in stats)

  shapes = [
    ((33, 8, 1024, 2048), jnp.bfloat16),
    ((4, 2048), jnp.float32),
    ((), jnp.int32),
  ]
  args = [jax.ShapeDtypeStruct(s, d, sharding=placed) for s, d in shapes]
  compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(*args).compile()
  assert compiled.as_text().count('custom_call_target="tpu_custom_call"') == 2


if __name__ == '__main__' and sys.argv[1:] == ['sharded']:
  print(json.dumps(sharded_errors()))
