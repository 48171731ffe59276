"""The Pallas stream write of HC/mHC (attnres_jax/kernels/hyper_pallas.py) equals the
XLA one (residuals/hyper/streams.write), forward and every cotangent, and the models built
with it (`depth_kernel='pallas'`) equal those built without.

On the CPU the kernels run in Pallas interpret mode: the same kernel code and the
same float32 arithmetic as on the TPU. The TPU lowering (Mosaic, under shard_map on
a data-parallel mesh) is checked by an ahead-of-time compile.
"""

import functools
import importlib.util
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import attnres_jax as ar
from attnres_jax.compile_report import aot
from attnres_jax import modes
from attnres_jax.nn import sharding
from attnres_jax.residuals.hyper import coefficients
from attnres_jax.kernels import hyper_pallas as hp
from attnres_jax.kernels import hyper_tiles
from attnres_jax.residuals.hyper import streams as hs
from attnres_jax.kernels import sinkhorn_pallas as sp
from configs import default as default_config
from conftest import child_result
from tests.kernels.mesh_checks import MESH_RULES
from tests.kernels.mesh_checks import assert_mesh_results
from tests.kernels.mesh_checks import max_relative_error
from tests.residuals.test_hyper_connections import TINY
from tests.residuals.test_hyper_connections import randomize
from tests.residuals.test_hyper_connections import tokens

# float32: both versions add the same float32 products; the per-token weight
# cotangents are sums over D = 128 in a different order (XLA's reduction tree against
# the kernel's), a few ulps (2^-24) of the sum of |terms|, which for unit-normal
# inputs is ~sqrt(D) = 11x the result's scale: 1e-5 of the largest. The element-wise
# results are the same sums of m + 1 products in the same order (on the TPU the
# compiler may reassociate them: a few ulps). Measured in interpret mode: element-wise
# results identical, weight cotangents <= 1.8e-7.
F32_TOL = 1e-5
# bfloat16 streams: the element-wise results are the bfloat16 rounding of two float32
# values as close as above, so at worst one bfloat16 ulp apart (2^-8 of the value);
# the weight cotangents are float32 and keep F32_TOL. Measured: identical, <= 9.3e-8.
BF16_TOL = 2.0**-8


# The kernels' cases: m streams, their dtype, and the tile budget (1 byte: the
# narrowest tile, 128 tokens, two tiles along T; None: one tile of all 256). The dtype
# changes only the roundings and the tiling only where a tile starts, so each of the
# paths appears once rather than in every combination: both dtypes at m = 4 (one of
# them over two tiles), another m with bfloat16, and one stream (m = 1) in float32.
KERNEL_CASES = [
  (jnp.float32, 4, None),
  (jnp.bfloat16, 4, 1),
  (jnp.bfloat16, 2, None),
  (jnp.float32, 1, None),
]


def inputs(m, batch, length, dim, dtype, seed=0):
  keys = jax.random.split(jax.random.key(seed), 4)
  return (
    jax.random.normal(keys[0], (m, m, batch, length)),
    jax.random.normal(keys[1], (m, batch, length)),
    jax.random.normal(keys[2], (m, batch, length, dim)).astype(dtype),
    jax.random.normal(keys[3], (batch, length, dim)).astype(dtype),
  )


@functools.cache
def compiled_vjp(fn, tile_bytes=None):
  """`fn`'s results and their VJP of the given cotangents, one jit per function and
  tile budget or cap (the one a test sets, part of the key since the tile is chosen
  while tracing): the tests of one shape share a compilation, e.g. the write's and the
  gated read's with the fused boundary's reference, the kernels apart."""
  del tile_bytes

  def results_and_vjp(args, cotangents):
    outs, vjp = jax.vjp(fn, *args)
    return outs, vjp(jax.tree.unflatten(jax.tree.structure(outs), cotangents))

  return jax.jit(results_and_vjp)


def random_cotangents(shapes, seed):
  """Each result's cotangent: random float32 weights of it (a scalar sum(result *
  weights), so each result gets its own), in the result's dtype as autodiff's
  cotangent of that scalar."""
  keys = jax.random.split(jax.random.key(seed), len(shapes))
  return [jax.random.normal(k, x.shape).astype(x.dtype) for k, x in zip(keys, shapes)]


def value_and_grads(write, args, seed=1, tile_bytes=None):
  """The new streams and the gradients of a random weighting of them w.r.t. every
  input (each new stream gets its own cotangent)."""
  weights = jax.random.normal(jax.random.key(seed), args[2].shape)
  return compiled_vjp(write, tile_bytes)(args, [weights.astype(args[2].dtype)])


def narrow_tiles(monkeypatch, tile_bytes):
  """The kernels' tile budget set to `tile_bytes` (where `choose_tile` reads it), so
  that a test runs several tiles along T."""
  monkeypatch.setattr(hyper_tiles, 'TILE_VMEM_BYTES', tile_bytes)
  assert hp.choose_tile(256, 4, 128, 4) == 128  # the budget took effect


def assert_close(actual, expected, tol, what):
  actual, expected = (np.asarray(x, np.float32) for x in (actual, expected))
  assert actual.shape == expected.shape, what
  scale = float(np.abs(expected).max()) + 1e-30
  np.testing.assert_allclose(actual / scale, expected / scale, atol=tol, err_msg=what)


@pytest.mark.parametrize('dtype,m,tile_bytes', KERNEL_CASES)
def test_kernel_equals_the_xla_write(dtype, m, tile_bytes, monkeypatch):
  """Values and the cotangents of the mixing, the write weights, the streams and
  f(h). tile_bytes=1: the narrowest tile (128 tokens), two tiles along T."""
  if tile_bytes is not None:
    narrow_tiles(monkeypatch, tile_bytes)
  args = inputs(m, 2, 256, 128, dtype)
  new, grads = value_and_grads(hp.write, args, tile_bytes=tile_bytes)
  ref_new, ref_grads = value_and_grads(hs.write, args)
  assert new.dtype == ref_new.dtype == dtype
  tol = F32_TOL if dtype == jnp.float32 else BF16_TOL
  assert_close(new, ref_new, tol, 'new streams')
  names = ('mix', 'write weights', 'streams', 'f(h)')
  for name, g, ref_g, primal in zip(names, grads, ref_grads, args):
    assert g.dtype == ref_g.dtype == primal.dtype, name
    assert_close(g, ref_g, tol if g.dtype == jnp.bfloat16 else F32_TOL, name)


def gated_read_inputs(m, dtype, per_stream=True, seed=0):
  """The projection (HC: [D, m + 2]; mHC: [m, D, m^2 + 2m]), the read's gate [2, R]
  (s and base_i at the read columns, zero elsewhere: `hyper_gated_read_kernels.Columns`),
  streams [m, 2, 256, 128] of RMS 3."""
  keys = jax.random.split(jax.random.key(seed), 3)
  if per_stream:
    num_out = m + 2
    phi = 0.1 * jax.random.normal(keys[0], (128, num_out))
    num_rows, read_columns = m * num_out + m, slice(0, m * num_out, num_out)
  else:
    num_out = m * m + 2 * m
    phi = 0.1 * jax.random.normal(keys[0], (m, 128, num_out))
    num_rows, read_columns = num_out + 1, slice(0, m)
  gate = jnp.zeros((2, num_rows))
  gate = gate.at[:, read_columns].set(jax.random.normal(keys[1], (2, m)))
  streams = (3 * jax.random.normal(keys[2], (m, 2, 256, 128))).astype(dtype)
  return phi, gate, streams


def xla_gated_read(phi, gate, streams, eps):
  """`hyper_pallas.gated_read` composed of the XLA steps the model uses without it:
  the normalised projections, the read weights (HC a_i = base_i + s tanh(n_i0), mHC
  a_i = sigmoid(base_i + s n_i)), the read; the rows [n, inverse RMS] as the kernel
  lays them out; the streams passed through."""
  m, num_out, per_stream = streams.shape[0], phi.shape[-1], phi.ndim == 2
  normed = hs.normed_projection(phi, streams, eps, per_stream=per_stream)
  squares = jnp.square(streams.astype(jnp.float32))
  if per_stream:  # normed [K, m, B, T]
    columns = gate[:, 0 : m * num_out : num_out, None, None]
    read = columns[1] + columns[0] * jnp.tanh(normed[0])
    inv_rms = jax.lax.rsqrt(jnp.mean(squares, -1) + eps)
    rows = jnp.swapaxes(normed, 0, 1).reshape(m * num_out, *normed.shape[2:])
  else:  # normed [K, B, T]
    columns = gate[:, :m, None, None]
    read = jax.nn.sigmoid(columns[1] + columns[0] * normed[:m])
    inv_rms = jax.lax.rsqrt(jnp.mean(squares, axis=(0, 3)) + eps)[None]
    rows = normed
  h = hs.read(read, streams)
  return h, jnp.concatenate([rows, inv_rms]), streams


def pallas_gated_read(phi, gate, streams):
  return hp.gated_read(phi, gate, streams, 1e-6)


def xla_gated_read_eps(phi, gate, streams):
  return xla_gated_read(phi, gate, streams, 1e-6)


def gated_read_and_grads(gated_read, args, seed=1, tile_bytes=None):
  """The gated read's three results and the gradients of a random weighting of all
  of them w.r.t. phi, the gate and the streams (`gated_read` without eps: 1e-6).
  The results' shapes and dtypes: the XLA steps' (a kernel's of other shapes fails
  its VJP)."""
  shapes = jax.eval_shape(xla_gated_read_eps, *args)
  cotangents = random_cotangents(shapes, seed)
  return compiled_vjp(gated_read, tile_bytes)(args, cotangents)


@pytest.mark.parametrize('per_stream', [True, False], ids=['hc', 'mhc'])
@pytest.mark.parametrize('dtype,m,tile_bytes', KERNEL_CASES)
def test_gated_read_equals_xla(per_stream, dtype, m, tile_bytes, monkeypatch):
  """HC's and mHC's read with its projections in one kernel each way equals the XLA
  steps:
  values and the cotangents of phi, the gate and the streams (the streams' sums the
  write's cotangent of the passed-through streams, the read's and the projections').
  The projections and h are the same float32 sums in another order (F32_TOL;
  measured <= 3.0e-7, bfloat16 h <= 4.0e-7). phi's and the gate's cotangents are
  float32 sums over tokens and D (F32_TOL; measured <= 8.5e-7). The float32 streams'
  cotangent: F32_TOL (measured <= 6.5e-7). The streams'
  bfloat16 cotangent: the XLA steps round the read's and the projections' cotangents
  to bfloat16 each and then their sum with the passed-through one, the kernel rounds
  the float32 sum once; each rounding errs by up to 2^-8 of a value no larger than
  the sum's scale, so they differ by up to 3 x 2^-8 of it (measured 1.35-1.5 x 2^-8);
  a wrong term moves it by O(1)."""
  if tile_bytes is not None:
    narrow_tiles(monkeypatch, tile_bytes)
  args = gated_read_inputs(m, dtype, per_stream)
  outs, grads = gated_read_and_grads(pallas_gated_read, args, tile_bytes=tile_bytes)
  ref_outs, ref_grads = gated_read_and_grads(xla_gated_read_eps, args)
  for name, x, ref in zip(('h', 'projections', 'passed'), outs, ref_outs):
    assert x.dtype == ref.dtype, name
    bf16 = x.dtype == jnp.bfloat16
    assert_close(x, ref, BF16_TOL if bf16 else F32_TOL, name)
  np.testing.assert_array_equal(outs[2], args[2])
  assert_close(grads[0], ref_grads[0], F32_TOL, 'phi')
  assert_close(grads[1], ref_grads[1], F32_TOL, 'gate')
  assert grads[2].dtype == dtype
  streams_tol = F32_TOL if dtype == jnp.float32 else 3 * 2.0**-8
  assert_close(grads[2], ref_grads[2], streams_tol, 'streams')


def pallas_boundary(mix, write, streams, out, phi, gate):
  return hp.boundary(mix, write, streams, out, phi, gate, 1e-6)


def boundary_shapes(args):
  """The boundary's results' shapes and dtypes: the XLA write's, then the XLA gated
  read's."""
  return jax.eval_shape(lambda *a: xla_gated_read_eps(*a[4:], hs.write(*a[:4])), *args)


def boundary_and_grads(boundary, args, seed=3, tile_bytes=None):
  """The boundary's three results and the gradients of a random weighting of them
  w.r.t. all six inputs (the write's weights, streams and f(h); phi and the gate)
  (`boundary` without eps: 1e-6)."""
  cotangents = random_cotangents(boundary_shapes(args), seed)
  return compiled_vjp(boundary, tile_bytes)(args, cotangents)


def kernels_apart_and_grads(args, seed=3, tile_bytes=None):
  """The same of the boundary as the two kernels it fuses, the write, then the gated
  read of the new streams: the chain rule through the two kernels' compiled VJPs (the
  programs the tests above compile): the write's forward, the gated read's results
  and VJP, the write's VJP of the new streams' cotangent."""
  cotangents = random_cotangents(boundary_shapes(args), seed)
  write = compiled_vjp(hp.write, tile_bytes)
  write_args, read_args = args[:4], args[4:]
  new, _ = write(write_args, [jnp.zeros_like(write_args[2])])
  outs, (d_phi, d_gate, d_new) = compiled_vjp(pallas_gated_read, tile_bytes)(
    (*read_args, new), cotangents
  )
  _, write_grads = write(write_args, [d_new])
  return outs, (*write_grads, d_phi, d_gate)


@pytest.mark.parametrize('per_stream', [True, False], ids=['hc', 'mhc'])
@pytest.mark.parametrize('dtype,m,tile_bytes', KERNEL_CASES)
def test_boundary_equals_the_kernels_apart(per_stream, dtype, m, tile_bytes, monkeypatch):
  """One sublayer's write fused with the next one's gated read equals the write
  kernel followed by the gated read kernel (each tested against XLA above): values
  and the cotangents of all six inputs. On chip it does the same float32 operations
  in the same order, and rounds the new streams and their cotangent to the storage
  dtype where the two kernels store them; measured identical. Bounds: F32_TOL for
  float32 (a compiler may still order the two programs' sums differently), and with
  bfloat16 streams BF16_TOL for everything, since a one-ulp difference of a rounded
  intermediate (2^-8 of it) reaches every result computed from it."""
  if tile_bytes is not None:
    narrow_tiles(monkeypatch, tile_bytes)
  args = (*inputs(m, 2, 256, 128, dtype), *gated_read_inputs(m, dtype, per_stream)[:2])
  outs, grads = boundary_and_grads(pallas_boundary, args, tile_bytes=tile_bytes)
  ref_outs, ref_grads = kernels_apart_and_grads(args, tile_bytes=tile_bytes)
  tol = F32_TOL if dtype == jnp.float32 else BF16_TOL
  names = ('h', 'projections', 'new streams', 'mix', 'write weights', 'streams')
  names += ('f(h)', 'phi', 'gate')
  for name, x, ref in zip(names, (*outs, *grads), (*ref_outs, *ref_grads)):
    assert x.dtype == ref.dtype, name
    assert_close(x, ref, tol, name)


def sharded_errors():
  """The child: on a (2, 2, 1) mesh under each of MESH_RULES, the largest relative
  difference between the Pallas kernels there and the references on one device (the
  XLA write, gated reads and Sinkhorn; the kernels apart for the fused boundary;
  computed once for both rules), whether the kernel runs per device, and whether a
  split of the width is refused."""
  mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 2, 1), sharding.AXIS_NAMES)
  args = inputs(4, 4, 256, 128, jnp.float32)
  logits = 3 * args[0]  # [m, m, B, T]
  sinkhorn_loss = lambda f: jax.jit(jax.value_and_grad(lambda x: jnp.sum(f(x) * logits)))
  read_args = {v: gated_read_inputs(4, jnp.float32, v == 'hc') for v in ('hc', 'mhc')}
  boundary_args = {v: (*args, *read_args[v][:2]) for v in read_args}
  host = lambda x: jax.tree.map(np.asarray, x)
  reference = {
    'write': host(value_and_grads(hs.write, args)),
    'sinkhorn': host(
      sinkhorn_loss(lambda x: coefficients.sinkhorn(x, 20, (0, 1)))(logits)
    ),
    **{
      f'gated_read_{v}': host(gated_read_and_grads(xla_gated_read_eps, a))
      for v, a in read_args.items()
    },
    **{
      f'boundary_{v}': host(kernels_apart_and_grads(a)) for v, a in boundary_args.items()
    },
  }
  out = {}
  for name, rules in MESH_RULES.items():
    rules = {**sharding.DEFAULT_RULES, **rules}

    def under_rules(fn, *args, rules=rules):
      with sharding.logical_rules(mesh, rules):
        return fn(*args)

    on_mesh = lambda fn: functools.partial(under_rules, fn)
    pallas = {
      'write': value_and_grads(on_mesh(hp.write), args),
      'sinkhorn': sinkhorn_loss(on_mesh(lambda x: sp.sinkhorn(x, 20)))(logits),
      **{
        f'gated_read_{v}': gated_read_and_grads(on_mesh(pallas_gated_read), a)
        for v, a in read_args.items()
      },
      **{
        f'boundary_{v}': boundary_and_grads(on_mesh(pallas_boundary), a)
        for v, a in boundary_args.items()
      },
    }
    for what, result in pallas.items():
      key = name if what == 'write' else f'{name}_{what}'
      out[key] = max_relative_error(host(result), reference[what])
    jaxpr = jax.make_jaxpr(on_mesh(hp.write))(*args)
    out[f'{name}_per_device'] = 'shard_map' in str(jaxpr)
  rules = {**sharding.DEFAULT_RULES, 'batch': ('data',), 'hidden': ('fsdp',)}
  try:
    with sharding.logical_rules(mesh, rules):
      hp.write(*args)
    out['width_split_refused'] = False
  except ValueError as e:
    out['width_split_refused'] = "map 'depth' and 'hidden' to no mesh axis" in str(e)
  return out


def test_kernel_on_a_mesh_equals_xla():
  """Streams (and mHC's maps) split over batch, or over batch and length (4 CPU
  devices): the write, HC's and mHC's gated reads and Sinkhorn equal XLA, and the
  fused boundaries the kernels apart, both references on one device."""
  errors = child_result(__file__, 4, 'sharded')
  assert_mesh_results(errors, 7 * len(MESH_RULES) + 1, F32_TOL)


def pallas_sinkhorn(logits):
  return sp.sinkhorn(logits, 20)


def xla_sinkhorn(logits):
  return coefficients.sinkhorn(logits, 20, (0, 1))


@pytest.mark.parametrize('scale', [1.0, 3.0, 30.0, 1e4])
@pytest.mark.parametrize('max_tile', [None, 128])
def test_sinkhorn_kernel_equals_the_xla_sinkhorn(scale, max_tile, monkeypatch):
  """mHC's maps [m, m, B, T] (rows i, columns j), values and the logits' gradient of
  a random weighting; max_tile=128: two tiles along T. Values: the same float32
  operations, sums over 4 terms in another order: a few ulps of entries <= 1 (1e-6;
  measured <= 2.4e-7). Gradients: 20 iterations back, 1e-5 of the largest (measured
  <= 5.4e-7 up to scale 30). At scale 1e4 a log-domain value carries an absolute
  rounding error of ~2^-24 |logit| ~ 1e-3 in either version, which exp() turns into
  relative errors of that size (measured 3.4e-4 between the two): there the
  gradient is only checked to be finite."""
  if max_tile is not None:
    monkeypatch.setattr(sp, 'MAX_TILE', max_tile)
  logits = scale * jax.random.normal(jax.random.key(0), (4, 4, 2, 256))
  weights = jax.random.normal(jax.random.key(1), logits.shape)
  # One program per function and tile cap for all scales (the logits an argument).
  out, (grad,) = compiled_vjp(pallas_sinkhorn, max_tile)((logits,), [weights])
  ref_out, (ref_grad,) = compiled_vjp(xla_sinkhorn)((logits,), [weights])
  np.testing.assert_allclose(out, ref_out, atol=1e-6)
  np.testing.assert_allclose(out.sum(1), 1.0, atol=1e-6)  # rows, as the reference
  assert bool(jnp.all(jnp.isfinite(grad)))
  if scale <= 30:
    assert_close(grad, ref_grad, F32_TOL, 'logits')


def test_tile_choice():
  # d1024, m = 4, bfloat16: 256 tokens fit the budget, 512 do not.
  assert hp.choose_tile(1024, 4, 1024, 2) == 256
  assert hp.vmem_bytes(256, 4, 1024, 2) <= hp.TILE_VMEM_BYTES
  assert hp.vmem_bytes(512, 4, 1024, 2) > hp.TILE_VMEM_BYTES
  # The boundary's backward holds more (3m + 3 blocks, 5m + 3 float32 values): 128.
  assert hp.choose_tile(1024, 4, 1024, 2, (15, 23)) == 128
  assert hp.choose_tile(96, 4, 32, 4) == 96  # no multiple of 128 divides: all of T
  assert hp.choose_tile(1, 4, 32, 4) == 1  # a decoding step
  assert sp.choose_tile(1024) == sp.MAX_TILE and sp.choose_tile(96) == 96


def model_loss_and_grads(residual, kernel, dtype='float32', length=32, **overrides):
  cfg = ar.model_config(
    **TINY,
    residual=residual,
    depth_kernel=kernel,
    dtype=dtype,
    param_dtype='float32',
    **overrides,
  )
  model = randomize(ar.Transformer(cfg, rngs=nnx.Rngs(0)))
  graphdef, state = nnx.split(model)
  tokens_BT = tokens(length=length)

  def loss(state):
    logits = nnx.merge(graphdef, state)(tokens_BT)
    return jnp.mean(jax.nn.log_softmax(logits.astype(jnp.float32))[..., 0])

  return jax.jit(jax.value_and_grad(loss))(state)


@pytest.mark.parametrize('residual', ['hc', 'mhc'])
def test_model_with_the_kernel_equals_the_xla_model(residual):
  """Loss and every parameter's gradient, float32, dynamic HC / mHC with every
  parameter moved from its initial value, the kernels under remat (as training runs
  them; remat = no remat for XLA's: test_hyper_connections): only the weight
  cotangents' summation order differs (above), through four sublayers: 1e-5 of each
  gradient's scale. Measured: losses identical, gradients <= 5.8e-7 of their scale."""
  loss, grads = model_loss_and_grads(residual, 'pallas', remat='sublayer')
  ref_loss, ref_grads = model_loss_and_grads(residual, 'xla')
  np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-6)
  flat, ref_flat = (jax.tree.leaves_with_path(g) for g in (grads, ref_grads))
  for (path, g), (_, ref_g) in zip(flat, ref_flat):
    assert_close(g, ref_g, 1e-5, jax.tree_util.keystr(path))


@pytest.mark.parametrize('residual', ['hc', 'mhc'])
def test_model_with_the_fused_kernels_equals_the_xla_model(residual):
  """At 128 tokens (a whole lane tile) the projections run through a kernel too (at
  32, above, they are XLA's), with the read and the write before it
  (`hyper_pallas.boundary`). Loss to 1e-6; the gradients to 2e-4 of each one's
  scale: in this randomised model the read gates' gradients are sums over the 256
  tokens with heavy cancellation, so tiny changes of the projections move them a
  lot. Measured by perturbing XLA's own projections by one float32 ulp (2^-24,
  random sign): HC's read_scale gradient moves by 7.2e-5 of its scale, static_read's
  by 5.4e-5; the kernels' projections (a few ulps from XLA's, other summation order)
  move them by 4.0e-5 / 3.2e-5, every other gradient <= 7.2e-6; mHC <= 2.6e-6. A
  wrong column or stream in the kernel moves them by O(1)."""
  loss, grads = model_loss_and_grads(residual, 'pallas', length=128)
  ref_loss, ref_grads = model_loss_and_grads(residual, 'xla', length=128)
  np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-6)
  flat, ref_flat = (jax.tree.leaves_with_path(g) for g in (grads, ref_grads))
  for (path, g), (_, ref_g) in zip(flat, ref_flat):
    assert_close(g, ref_g, 2e-4, jax.tree_util.keystr(path))


def test_option_is_validated_and_parsed():
  assert modes.fields('mhc/pallas') == dict(
    residual='mhc', hc_streams=4, depth_kernel='pallas'
  )
  with pytest.raises(ValueError, match='apply to full and block only'):
    modes.fields('hc/bf16')
  with pytest.raises(ValueError, match='depth_kernel must be one of'):
    ar.model_config(**TINY, residual='hc', depth_kernel='triton')


needs_libtpu = pytest.mark.skipif(
  importlib.util.find_spec('libtpu') is None,
  reason='libtpu (the TPU compiler) is not installed',
)


@needs_libtpu
@pytest.mark.parametrize('residual', ['hc', 'mhc'])
def test_train_step_compiles_for_tpu_with_the_kernel(residual, tmp_path):
  """Mosaic lowers the kernels inside the production train step (data parallel on
  v5e:2x2: the kernels run per device under shard_map)."""
  config = default_config.get_config('tiny')
  config.model.update(dtype='bfloat16', residual=residual, depth_kernel='pallas')
  config.train.seq_len = 128  # a whole lane tile: the fused read and write as well
  report = aot.compile_report(config, 'v5e:2x2', steps=('train',), hlo_dir=str(tmp_path))
  assert report['steps']['train']['bytes_accessed'] > 0
  with open(os.path.join(tmp_path, 'train.hlo.txt'), encoding='utf-8') as f:
    text = f.read()
  # the fused write and read forward and backward, the last write's (and mHC's
  # Sinkhorn)
  assert text.count('custom_call_target="tpu_custom_call"') >= 4


if __name__ == '__main__' and sys.argv[1:] == ['sharded']:
  print(json.dumps(sharded_errors()))
