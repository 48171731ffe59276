"""Every fast path against the method as the paper states it (attnres/method.py).

method.py is the reference: Python lists of sources and loops, no buffer, no custom
VJP. Here the library's reads (depth.py's one-shot read, Phase 1 with static, masked
and prefix reads, the Pallas Phase 1 kernel, Phase 2's merges) and the library's
Transformer are compared with it, outputs and gradients; and the method is checked
against itself (Block with S = 1 is Full, two-phase is one-shot, zero queries read
the mean).

Tolerances. Everything runs in float32 (2^-24 = 6e-8 relative per rounding). The two
sides compute the same terms in different orders: the library folds the gain into
the query and scales the dot by the inverse RMS, where the method normalises the key
first; the library's contractions and the online softmax sum in other orders. Each
logit then differs by a few ulps of |logit| (< 7 here), which the exponential turns
into a relative error of the same size in each weight; a read is a convex combination
of its sources, so its error is that times max |v|. Measured, of the largest entry:
6.1e-7 for the library's reads, their statistics and gradients, 1.3e-6 for the
method's two-phase loop against its one-shot loop (six sublayers deep); asserted:
1e-5 (READ_TOL). Through the tiny Transformer (6 sublayers, the head) the errors
compound as in tests/models/test_model.py's literal-method test, whose tolerance
MODEL_TOL is (measured: logits within 1.6e-5, gradients 6.2e-6 of the largest).
"""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from attnres_jax.kernels import depth_pallas
from attnres_jax.residuals.attnres import depth
from attnres_jax.residuals.attnres import method

from conftest import TINY_MODEL as TINY, tiny_model

EPS = 1e-6
READ_TOL = 1e-5  # of the largest entry: see the module docstring
MODEL_TOL = 2e-5  # as test_model.py::test_matches_the_literal_method
B, T, D = 2, 5, 16


def spread(key, count, low=1e-2, high=1e2, shape=(B, T, D)):
  """[count, *shape] sources whose scales span low .. high (the reads far from
  uniform)."""
  keys = jax.random.split(key, count)
  scales = np.geomspace(low, high, count)
  return jnp.stack([s * jax.random.normal(k, shape) for k, s in zip(keys, scales)])


def queries_and_gains(key, count):
  """Non-zero queries and non-unit gains, [count, D] each."""
  k1, k2 = jax.random.split(key)
  return 0.5 * jax.random.normal(k1, (count, D)), 1 + 0.3 * jax.random.normal(
    k2, (count, D)
  )


def assert_close(actual, expected, tol=READ_TOL):
  """Every leaf within `tol` of its largest entry (see the module docstring)."""
  chex.assert_trees_all_equal_shapes_and_dtypes(actual, expected)
  for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected)):
    scale = float(jnp.max(jnp.abs(e))) + 1e-30
    chex.assert_trees_all_close(a / scale, e / scale, atol=tol, rtol=0)


def grads_and_output(loss_and_output, *args):
  """(gradients w.r.t. every argument, output) of a function that returns (a scalar
  loss, an output). Run op by op: the functions here are loops over a few small
  arrays, which run in far less time than their compilation takes."""
  argnums = tuple(range(len(args)))
  return jax.grad(loss_and_output, argnums=argnums, has_aux=True)(*args)


def cotangents(key, count, shape=(B, T, D)):
  """Random weights for a scalar loss, one [B, T, D] per output, so that every output
  gets its own cotangent."""
  return jax.random.normal(key, (count, *shape))


# -- the one-shot read ----------------------------------------------------------------


@pytest.mark.parametrize('num_valid', [None, 1, 3, 'array'])
def test_one_shot_read_equals_the_method(num_valid):
  """depth.attn_res_read over all sources, a static prefix of them, or a prefix given
  as an array (as the layer scan gives it: the rest masked), against method.read of
  the valid ones: the read and its gradients."""
  sources_KBTD = spread(jax.random.key(0), 6)
  queries_QD, gains_QD = queries_and_gains(jax.random.key(1), 1)
  count = 4 if num_valid == 'array' else num_valid or 6
  valid = jnp.int32(count) if num_valid == 'array' else num_valid
  c_BTD = cotangents(jax.random.key(2), 1)[0]

  def library(sources_KBTD, query_D, gain_D):
    h_BTD, _ = depth.attn_res_read(
      sources_KBTD, query_D, gain_D, eps=EPS, num_valid=valid
    )
    return jnp.sum(h_BTD * c_BTD), h_BTD

  def reference(sources_KBTD, query_D, gain_D):
    h_BTD = method.read(list(sources_KBTD[:count]), query_D, gain_D, eps=EPS)
    return jnp.sum(h_BTD * c_BTD), h_BTD

  args = (sources_KBTD, queries_QD[0], gains_QD[0])
  got = grads_and_output(library, *args)
  assert_close(got, grads_and_output(reference, *args))
  np.testing.assert_array_equal(got[0][0][count:], 0.0)  # unread sources: no gradient


def test_zero_query_reads_the_mean_of_the_sources():
  sources_KBTD = spread(jax.random.key(3), 4)
  gain_D = 1 + 0.3 * jax.random.normal(jax.random.key(4), (D,))
  mean_BTD = jnp.mean(sources_KBTD, axis=0)
  # A mean of four float32 values: a few ulps of the largest (1e2 scale).
  assert_close(method.read(list(sources_KBTD), jnp.zeros(D), gain_D, eps=EPS), mean_BTD)
  h_BTD, _ = depth.attn_res_read(sources_KBTD, jnp.zeros(D), gain_D, eps=EPS)
  assert_close(h_BTD, mean_BTD)
  stats = depth.phase1(
    sources_KBTD[:3], jnp.zeros((1, D)), gain_D[None], eps=EPS, num_valid=3
  )
  h_BTD = depth.phase2(
    stats[0], sources_KBTD[3:], jnp.array([True]), jnp.zeros(D), gain_D, eps=EPS
  )
  assert_close(h_BTD, mean_BTD)


# -- Phase 1 and Phase 2 --------------------------------------------------------------


def library_phase1(how, buffer_KBTD, queries_QD, gains_QD, num_valid, inv_rms_KBT):
  """The library's Phase 1 statistics, read `how`."""
  kwargs = dict(eps=EPS, inv_rms_KBT=inv_rms_KBT)
  if how == 'static':  # a Python int: the valid slots sliced
    return depth.phase1(
      buffer_KBTD, queries_QD, gains_QD, num_valid=int(num_valid), **kwargs
    )
  if how == 'masked':  # an array: the whole buffer, masked
    return depth.phase1(buffer_KBTD, queries_QD, gains_QD, num_valid=num_valid, **kwargs)
  if how == 'prefixes':  # an array: the shortest static prefix (its VJP written out)
    prefixes = (2, 4, buffer_KBTD.shape[0])
    return depth.phase1(
      buffer_KBTD, queries_QD, gains_QD, num_valid=num_valid, prefixes=prefixes, **kwargs
    )
  assert how == 'pallas'  # the kernel (Pallas interpret mode off the TPU)
  return depth_pallas.phase1(
    buffer_KBTD, queries_QD, gains_QD, num_valid=num_valid, **kwargs
  )


def library_reads(phase1_how, local, carried_rms, args, num_valid):
  """Each query's read by the library: Phase 1 over the buffer's `num_valid` slots,
  then Phase 2 with the local slots query q reads: Block's partial sum (one slot)
  from the block's second sublayer on, or for Full the q local slots written before
  it, passed as a model's segment passes them ('full_in_place': the q slots alone,
  the merge chosen for the segment's J; 'full': all J slots, the first q valid)."""
  buffer_KBTD, queries_QD, gains_QD, local_JBTD = args
  inv_rms = lambda x: depth.rms_inverse(x, EPS) if carried_rms else None
  stats = library_phase1(
    phase1_how, buffer_KBTD, queries_QD, gains_QD, num_valid, inv_rms(buffer_KBTD)
  )
  num_local = local_JBTD.shape[0]
  reads = []
  for q, (query_D, gain_D) in enumerate(zip(queries_QD, gains_QD)):
    count = min(q, 1) if local == 'block' else q
    if count == 0:
      reads.append(depth.phase1_read(stats[q], buffer_KBTD.dtype))
      continue
    # Block: its one partial sum (J = 1, the merge that autodiff differentiates).
    slots_JBTD = local_JBTD if local == 'full' else local_JBTD[:count]
    valid_J = jnp.arange(slots_JBTD.shape[0]) < count
    reads.append(
      depth.phase2(
        stats[q],
        slots_JBTD,
        valid_J,
        query_D,
        gain_D,
        eps=EPS,
        local_inv_rms_JBT=inv_rms(slots_JBTD),
        num_written=None if local == 'block' else count,
        num_local=num_local if local == 'full_in_place' else None,
      )
    )
  return stats, reads


def method_reads(local, args, num_valid):
  """The same reads by method.py's Phase 1 and Phase 2."""
  buffer_KBTD, queries_QD, gains_QD, local_JBTD = args
  stats = method.phase1(list(buffer_KBTD[:num_valid]), queries_QD, gains_QD, eps=EPS)
  reads = []
  for q, (query_D, gain_D) in enumerate(zip(queries_QD, gains_QD)):
    count = min(q, 1) if local == 'block' else q
    new_sources = list(local_JBTD[:count])
    reads.append(
      method.phase2(stats[q], new_sources, query_D, gain_D, eps=EPS, dtype=jnp.float32)
    )
  return stats, reads


# Each Phase 1 read with each Phase 2 merge, and each written-out VJP with the inverse
# RMS both recomputed and carried (the cross product would repeat the same code paths).
CASES = [
  ('static', 'block', False),
  ('static', 'full_in_place', True),
  ('masked', 'block', True),
  ('masked', 'full', False),
  ('prefixes', 'full_in_place', False),
  ('prefixes', 'full', True),
  ('prefixes', 'block', False),
  ('pallas', 'full', True),
]


@pytest.mark.parametrize('phase1_how,local,carried_rms', CASES)
def test_two_phase_reads_equal_the_method(phase1_how, local, carried_rms):
  """Phase 1's statistics (max, sum, unnormalised output) and each query's read equal
  method.py's, and so do the gradients of the reads w.r.t. the buffer, the queries,
  the gains and the local slots (through the hand-written VJPs where there is one)."""
  keys = jax.random.split(jax.random.key(5), 4)
  num_queries, num_valid = 3, 3
  args = (
    spread(keys[0], 6),
    *queries_and_gains(keys[1], num_queries),
    spread(keys[2], num_queries, 1e-1, 1e3),
  )
  c_QBTD = cotangents(keys[3], num_queries)
  loss = lambda reads: sum(jnp.sum(h_BTD * c_BTD) for h_BTD, c_BTD in zip(reads, c_QBTD))
  # A Python int is sliced; an array (as the layer scan gives it) is masked or picks
  # a prefix.
  valid = num_valid if phase1_how == 'static' else jnp.int32(num_valid)

  def library(*args):
    stats, reads = library_reads(phase1_how, local, carried_rms, args, valid)
    return loss(reads), (stats, reads)

  def reference(*args):
    stats, reads = method_reads(local, args, num_valid)
    return loss(reads), (stats, reads)

  got_grads, (got_stats, got_reads) = grads_and_output(library, *args)
  want_grads, (want_stats, want_reads) = grads_and_output(reference, *args)
  assert_close(tuple(got_stats), tuple(want_stats))
  assert_close(got_reads, want_reads)
  assert_close(got_grads, want_grads)
  np.testing.assert_array_equal(got_grads[0][num_valid:], 0.0)  # slots not read


# -- the method against itself ----------------------------------------------------------


def random_sublayers(key, count):
  """`count` sublayers f(h) = scale * tanh(h W), scales 0.1 .. 10, so that the
  sources differ and every read is far from a mean."""
  keys = jax.random.split(key, count)
  scales = np.geomspace(0.1, 10.0, count)
  weights = [jax.random.normal(k, (D, D)) / np.sqrt(D) for k in keys]
  return [lambda h, w=w, s=s: s * jnp.tanh(h @ w) for w, s in zip(weights, scales)]


NUM_SUBLAYERS = 6


def method_inputs(seed):
  keys = jax.random.split(jax.random.key(seed), 3)
  sublayers = random_sublayers(keys[0], NUM_SUBLAYERS)
  embedding_BTD = jax.random.normal(keys[1], (B, T, D))
  return sublayers, embedding_BTD, *queries_and_gains(keys[2], NUM_SUBLAYERS + 1)


def test_block_size_one_is_full():
  sublayers, *args = method_inputs(6)
  full = method.full_attnres(sublayers, *args, eps=EPS)
  block = method.block_attnres(sublayers, *args, block_size=1, eps=EPS)
  # The same sources summed in the same order: bitwise.
  chex.assert_trees_all_equal(block, full)


@pytest.mark.parametrize('block_size', [1, 2, 3, 4, NUM_SUBLAYERS])
def test_the_methods_two_phase_schedule_is_its_one_shot_read(block_size):
  sublayers, *args = method_inputs(7)
  one_shot = lambda *a: method.block_attnres(
    sublayers, *a, block_size=block_size, eps=EPS
  )
  two_phase = lambda *a: method.block_attnres_two_phase(
    sublayers, *a, block_size=block_size, eps=EPS
  )
  c_BTD = cotangents(jax.random.key(8), 1)[0]
  with_loss = lambda f: lambda *a: (jnp.sum(f(*a) * c_BTD), f(*a))
  got = grads_and_output(with_loss(two_phase), *args)
  # Six sublayers deep, each read's few-ulp differences pass through the later
  # sublayers (scales up to 10): measured 1.3e-6 of the largest entry.
  assert_close(got, grads_and_output(with_loss(one_shot), *args))


# -- the library's Transformer ----------------------------------------------------------


def layer(model, k):
  graphdef, state = nnx.split(model.layers)
  return nnx.merge(graphdef, jax.tree.map(lambda x: x[k], state))


def method_logits(model, tokens_BT):
  """The model's own embedding, sublayers, head and depth parameters, assembled by
  method.py's loop over the sublayers."""
  cfg = model.cfg
  positions_BT = jnp.broadcast_to(jnp.arange(tokens_BT.shape[1]), tokens_BT.shape)
  sublayers = [
    functools.partial(layer(model, l // 2).sublayer, l % 2, positions_BT=positions_BT)
    for l in range(2 * cfg.num_layers)
  ]
  queries_RD, gains_RD = (
    jnp.concatenate([per_layer[...].reshape(-1, cfg.d_model), final[...][None]])
    for per_layer, final in (
      (model.layers.residual.query, model.final_residual.query),
      (model.layers.residual.gain, model.final_residual.gain),
    )
  )
  args = (sublayers, model.embed(tokens_BT), queries_RD, gains_RD)
  if cfg.residual == 'full':
    h_BTD = method.full_attnres(*args, eps=cfg.attn_res_eps)
  else:
    h_BTD = method.block_attnres(*args, block_size=cfg.block_size, eps=cfg.attn_res_eps)
  return model.head(h_BTD)


@pytest.mark.parametrize('residual,block_size', [('full', 1), ('block', 2), ('block', 3)])
def test_transformer_equals_the_method(residual, block_size):
  """The Transformer as the library runs it by default (the block schedule in the
  layer scan, the linear-memory backward) against method.py's sublayer loop, with
  non-zero queries: logits, and the gradients of a loss w.r.t. every parameter."""
  model = tiny_model(residual, block_size, random_depth=True)
  tokens_BT = jax.random.randint(jax.random.key(9), (2, 12), 0, TINY['vocab_size'])
  c_BTV = jax.random.normal(jax.random.key(10), (2, 12, TINY['vocab_size']))

  def grads_and_logits(logits_fn):
    """Jitted, the logits from the same program as the gradients (the method's loop
    run op by op costs more than its compilation)."""

    def loss_and_logits(m):
      logits_BTV = logits_fn(m)
      return jnp.sum(logits_BTV * c_BTV), logits_BTV

    return nnx.jit(nnx.grad(loss_and_logits, has_aux=True))(model)

  got, got_logits = grads_and_logits(lambda m: m(tokens_BT))
  want, want_logits = grads_and_logits(lambda m: method_logits(m, tokens_BT))
  np.testing.assert_allclose(got_logits, want_logits, rtol=MODEL_TOL, atol=MODEL_TOL)
  assert_close(nnx.state(got), nnx.state(want), MODEL_TOL)
