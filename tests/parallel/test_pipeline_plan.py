"""The static side of pipeline parallelism (`attnres_jax/parallel/pipeline_plan.py`, no devices):
the schedule runs every chunk once in order, the transfer plan reproduces the paper's
counts and Fig. 3 and its windows cover every new slot, the loop-by-loop and
kernel-by-kernel split of a compiled program's estimate, the final read's own VJP
against autodiff, and invalid pipelines fail before compiling. The pipelined steps
themselves (devices): test_pipeline.py."""

from __future__ import annotations

import chex
import numpy as np
import pytest

from attnres_jax import config as config_lib
from attnres_jax.parallel import pipeline_transfer
from attnres_jax.compile_report import pipeline_hlo
from attnres_jax.parallel import pipeline_plan
from attnres_jax.nn import sharding
from attnres_jax.residuals.attnres import residual as attnres
from configs import default as default_config


@pytest.mark.parametrize(
  'stages,virtual,micro', [(2, 1, 3), (4, 1, 4), (2, 2, 2), (4, 2, 6), (2, 4, 3)]
)
def test_schedule_runs_every_chunk_once_in_order(stages, virtual, micro):
  pipe = pipeline_plan.PipelineConfig(stages, virtual, micro)
  when = {}
  for t, row in enumerate(pipeline_plan.schedule_table(pipe)):
    for p, slot in enumerate(row):
      if slot is not None:
        m, v = slot
        chunk = v * stages + p
        assert (m, chunk) not in when
        when[m, chunk] = t
  assert len(when) == micro * pipe.num_chunks
  for (m, chunk), t in when.items():
    if chunk:  # the previous chunk ran earlier (its message arrives one later)
      assert when[m, chunk - 1] < t
  idle = stages * (stages - 1)  # the fill and drain triangles
  assert pipeline_plan.bubble_fraction(pipe) == idle / (stages * pipe.num_iterations)


def test_transfer_plan_counts_are_the_papers_eqs_7_and_8_at_one_block_per_chunk():
  # P = 4, V = 2, N_p = 1: 8 chunks of one block each (8 layers, 2 sublayers a block).
  model = config_lib.model_config(num_layers=8, residual='block', block_size=2)
  plan = pipeline_plan.transfer_plan(model, pipeline_plan.PipelineConfig(4, 2))
  naive, cached = plan.block_transmissions()
  # Eq. 7, naive: transition j sends the j N_p blocks so far, 1 + 2 + ... + 7.
  assert naive == 28
  # Eq. 8, cached: the first virtual stage as naive (1, 2, 3); from the second on, the
  # P N_p blocks since the receiver last saw the state: 4 per transition.
  assert cached == 1 + 2 + 3 + 4 * 4
  assert plan.width == 4 and plan.num_slots == 9
  # On the wire: C - 1 = 7 transitions of K = 9 slots (naive) or W = 4 (cached).
  assert plan.wire_slots() == (7 * 9, 7 * 4)
  # The paper's naive sends only the accumulated slots, embedding included.
  assert plan.accumulated_slots() == 28 + 7


def test_transfer_plan_reproduces_the_papers_figure_3():
  # Fig. 3: P = 4 ranks, V = 2, 8 chunks of one layer; a block (4 sublayers) spans two
  # chunks, so N_p = 1/2 (the paper's footnote). Chunk c writes block 1 + c // 2; rank
  # c mod 4 runs chunk c, and caches what it received at its first virtual stage.
  model = config_lib.model_config(num_layers=8, residual='block', block_size=4)
  plan = pipeline_plan.transfer_plan(model, pipeline_plan.PipelineConfig(4, 2))
  sets = [(set(n), set(c)) for n, c in plan.block_sets(embedding=True)]
  figure = [  # (naive, cached) per transition: slot 0 = b0 (the embedding), i = b_i
    ({0, 1}, {0, 1}),  # rank 0 -> 1: first virtual stage, the receiver has nothing
    ({0, 1}, {0, 1}),
    ({0, 1, 2}, {0, 1, 2}),
    ({0, 1, 2}, {1, 2}),  # rank 3 -> 0: has b0 from chunk 0; b1 was finished by chunk 1
    ({0, 1, 2, 3}, {1, 2, 3}),  # rank 1 cached b1's partial sum, not its completion
    ({0, 1, 2, 3}, {2, 3}),  # rank 2 cached b0, b1 (complete at chunk 2)
    ({0, 1, 2, 3, 4}, {2, 3, 4}),
  ]
  assert sets == figure
  second = [n - c for n, c in sets[3:]]  # transitions into the second virtual stage
  assert sum(map(len, second)) == 6  # the figure's 6 redundant transmissions removed
  # Embedding excluded (our default count): 16 naive, 14 cached.
  assert plan.block_transmissions() == (16, 14)
  assert plan.block_transmissions(embedding=True) == (23, 17)
  # On the wire: 7 whole buffers of K = 5 slots against 7 windows of W = 3.
  assert (plan.num_slots, plan.width) == (5, 3)
  assert plan.wire_slots() == (35, 21)
  assert plan.accumulated_slots() == 23
  # A stage caches, per microbatch, only the slots it later reads from its cache (those
  # below every later window): b0 and b1, not the whole buffer of K = 5 slots.
  assert pipeline_transfer.CachedTransfer(plan, 4).cache_slots == 2


def test_transfer_plan_window_covers_every_new_slot():
  """Per transition, the window holds every slot the receiver's copy lacks: the
  slots written by the chunks since it last received the state (all, the first time)."""
  for residual, block_size, layers, stages, virtual in [
    ('block', 3, 12, 2, 3),
    ('block', 4, 8, 4, 2),
    ('full', 1, 8, 2, 2),
    ('block', 8, 16, 2, 4),
  ]:
    model = config_lib.model_config(
      num_layers=layers, residual=residual, block_size=block_size
    )
    pipe = pipeline_plan.PipelineConfig(stages, virtual)
    plan = pipeline_plan.transfer_plan(model, pipe)
    size = attnres.block_size_of(model)
    per_chunk = 2 * layers // pipe.num_chunks
    for c in range(pipe.num_chunks - 1):
      seen_until = c + 1 - stages  # the receiver last received before this chunk
      start_sublayer = max(seen_until, 0) * per_chunk
      lacking = set(
        range(1 + start_sublayer // size, 1 + ((c + 1) * per_chunk - 1) // size + 1)
      )
      if seen_until < 0:
        lacking.add(0)  # never saw the embedding
      window = set(range(plan.starts[c], plan.starts[c] + plan.width))
      assert lacking <= window, (residual, block_size, c, lacking, window)
      assert plan.starts[c] + plan.width <= plan.num_slots


# A loop of 5 trips (the schedule's, forward: one `while` in its op_name) whose body
# prefetches a 4 MiB array into on-chip memory (S(1)) and negates it, and a negate
# after it, in the TPU compiler's shapes.
_LOOP_HLO = """
HloModule m

%body (p: (s32[], f32[1024,1024])) -> (s32[], f32[1024,1024]) {
  %p = (s32[], f32[1024,1024]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = f32[1024,1024]{1,0} get-tuple-element(%p), index=1
  %cs = (f32[1024,1024]{1,0}, f32[1024,1024]{1,0:S(1)}, u32[]) copy-start(%x)
  %cd = f32[1024,1024]{1,0:S(1)} copy-done(%cs)
  %n = f32[1024,1024]{1,0} negate(%cd)
  %one = s32[] constant(1)
  %j = s32[] add(%i, %one)
  ROOT %t = (s32[], f32[1024,1024]{1,0}) tuple(%j, %n)
}

%cond (p: (s32[], f32[1024,1024])) -> pred[] {
  %p = (s32[], f32[1024,1024]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[] constant(5)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

ENTRY %main (x: f32[1024,1024]) -> f32[1024,1024] {
  %x = f32[1024,1024]{1,0} parameter(0)
  %zero = s32[] constant(0)
  %init = (s32[], f32[1024,1024]{1,0}) tuple(%zero, %x)
  %w = (s32[], f32[1024,1024]{1,0}) while(%init), condition=%cond, body=%body, metadata={op_name="jit(f)/jvp()/while"}, backend_config={"known_trip_count":{"n":"5"}}
  %y = f32[1024,1024]{1,0} get-tuple-element(%w), index=1
  ROOT %z = f32[1024,1024]{1,0} negate(%y)
}
"""


def test_time_by_loop_splits_the_estimate_by_loop_and_kind():
  """Bytes-bound kernels: the loop's prefetch (async copies) and negate (other) count
  5 times each, the entry's negate once; the parts add up to the estimate."""
  split = pipeline_hlo.time_by_loop(_LOOP_HLO, 1.0, peak_flops=1e30, bandwidth=1.0)
  loop, entry = split['fwd/outer'], split['entry']
  assert loop['async copies'] == pytest.approx(5 * entry['other'])
  # The loop's negate and its counter's add (12 bytes a trip, of 8 MiB).
  assert loop['other'] == pytest.approx(5 * entry['other'], rel=1e-5)
  assert loop['matmul'] == loop['copies'] == entry['async copies'] == 0
  assert sum(sum(kinds.values()) for kinds in split.values()) == pytest.approx(1.0)


def test_top_kernels_lists_the_loop_kernels_by_cost():
  """The loop's two 4 MiB kernels (prefetch, negate; 5 trips each) first, then its
  counter's add; the entry's negate left out; seconds on `time_by_loop`'s scale."""
  top = pipeline_hlo.top_kernels(_LOOP_HLO, 1.0, peak_flops=1e30, bandwidth=1.0)
  split = pipeline_hlo.time_by_loop(_LOOP_HLO, 1.0, peak_flops=1e30, bandwidth=1.0)
  assert {k['loop'] for k in top} == {'fwd/outer'}
  assert {k['opcode'] for k in top[:2]} == {'copy-start', 'negate'}
  assert top[0]['seconds'] == pytest.approx(5 * split['entry']['other'])
  assert top[1]['seconds'] == pytest.approx(top[0]['seconds'])
  assert top[2]['opcode'] == 'add' and top[2]['seconds'] < top[1]['seconds'] / 1000
  assert sum(k['seconds'] for k in top) == pytest.approx(sum(split['fwd/outer'].values()))
  assert pipeline_hlo.top_kernels(_LOOP_HLO, 1.0, 1e30, 1.0, count=1) == top[:1]


@pytest.mark.parametrize('dtype', ['float32', 'bfloat16'])
def test_final_read_keeping_its_weights_equals_autodiff(dtype):
  """`pipeline_vjp.final_read` (its backward written out, from the kept weights and
  dots) against autodiff of `depth.read_parts`, the read it replaces in the schedule,
  inverse RMS given: equal values, and gradients up to float32 rounding in another
  order (the buffer's cotangent then rounded to its dtype)."""
  import jax

  from attnres_jax.residuals.attnres import depth
  from attnres_jax.parallel import pipeline_vjp

  keys = jax.random.split(jax.random.key(0), 5)
  buffer_KBTD = jax.random.normal(keys[0], (5, 2, 3, 16)).astype(dtype)
  inv_rms_KBT = depth.rms_inverse(buffer_KBTD, 1e-6) * 1.5  # not the buffer's own
  query_D, gain_D = (
    jax.random.normal(keys[1], (16,)),
    1 + jax.random.normal(keys[2], (16,)),
  )
  d_h_BTD = jax.random.normal(keys[3], (2, 3, 16)).astype(dtype)

  def reference(*args):
    buffer, inv_rms, query, gain = args
    return depth.read_parts(buffer, query, gain, eps=1e-6, inv_rms_KBT=inv_rms)[0]

  args = (buffer_KBTD, inv_rms_KBT, query_D, gain_D)
  want, want_vjp = jax.vjp(reference, *args)
  got, got_vjp = jax.vjp(pipeline_vjp.final_read, *args)
  assert got.dtype == want.dtype
  np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
  # Absolute: float32 sums in another order, measured 4.0e-6 on O(1) inputs (relative
  # differences are larger only on near-zero entries, where the softmax terms cancel);
  # the bfloat16 buffer's cotangent, rounded from float32 values that differ by those
  # ulps, may land one bfloat16 ulp apart: 2^-7 at |x| ~ 2 (measured 7.8e-3).
  atol = 1e-5 if dtype == 'float32' else 1e-2
  for g, w in zip(got_vjp(d_h_BTD), want_vjp(d_h_BTD)):
    assert g.dtype == w.dtype and g.shape == w.shape
    np.testing.assert_allclose(
      np.asarray(g, np.float32), np.asarray(w, np.float32), rtol=0, atol=atol
    )


def test_entry_updates_in_place_equal_autodiff():
  """`pipeline_vjp.swap_entry` and `set_entry_where` (the delay line's and the cache's
  updates, their backward passes in place) against autodiff of the indexing they
  replace, vmapped over stages with a per-stage index and condition as the schedule
  runs them: values and cotangents only move and select numbers, so they are equal."""
  import jax
  import jax.numpy as jnp

  from attnres_jax.parallel import pipeline_vjp

  keys = iter(jax.random.split(jax.random.key(0), 16))
  normal = lambda *shape: jax.random.normal(next(keys), shape)
  # A carry per stage (2 stages) and entry (4): a buffer and its inverse RMS.
  stacked = attnres.DepthCarry(normal(2, 4, 3, 8), normal(2, 4, 3))
  new = attnres.DepthCarry(normal(2, 3, 8), normal(2, 3))
  index, condition = jnp.array([1, 3]), jnp.array([True, False])

  def swap_reference(stacked, index, new):
    old = jax.tree.map(lambda x: x[index], stacked)
    return old, jax.tree.map(lambda x, y: x.at[index].set(y), stacked, new)

  def set_reference(stacked, index, condition, new):
    return jax.tree.map(
      lambda x, y: x.at[index].set(jnp.where(condition, y, x[index])), stacked, new
    )

  for got_fn, want_fn, fixed in [
    (pipeline_vjp.swap_entry, swap_reference, (index,)),
    (pipeline_vjp.set_entry_where, set_reference, (index, condition)),
  ]:
    got, got_vjp = jax.vjp(lambda s, n: jax.vmap(got_fn)(s, *fixed, n), stacked, new)
    want, want_vjp = jax.vjp(lambda s, n: jax.vmap(want_fn)(s, *fixed, n), stacked, new)
    chex.assert_trees_all_equal(got, want)
    cotangent = jax.tree.map(lambda x: jax.random.normal(next(keys), x.shape), want)
    chex.assert_trees_all_equal(got_vjp(cotangent), want_vjp(cotangent))


def test_invalid_pipelines_fail_before_compiling():
  model = config_lib.model_config(num_layers=4)
  with pytest.raises(ValueError, match='not divisible by stage x virtual_stages'):
    pipeline_plan.validate(pipeline_plan.PipelineConfig(3, 1, 1), model, 8)
  with pytest.raises(ValueError, match='does not split into 3 microbatches'):
    pipeline_plan.validate(pipeline_plan.PipelineConfig(2, 1, 3), model, 8)
  with pytest.raises(ValueError, match='num_microbatches >= stage'):
    pipeline_plan.validate(pipeline_plan.PipelineConfig(2, 2, 1), model, 8)
  with pytest.raises(ValueError, match='pipeline_schedule must be one of'):
    pipeline_plan.validate(
      pipeline_plan.PipelineConfig(2, 1, 2, schedule='1f1b'), model, 8
    )
  with pytest.raises(ValueError, match='data-parallel'):
    pipeline_plan.validate(pipeline_plan.PipelineConfig(2, 1, 4), model, 8, data_shards=4)
  # A residual refuses what it cannot pipeline (`Residual.pipeline_refusal`).
  ablation = config_lib.model_config(num_layers=4, residual='full', depth_window=2)
  with pytest.raises(ValueError, match='ablations are not pipelined'):
    pipeline_plan.validate(pipeline_plan.PipelineConfig(2, 1, 2), ablation, 8)
  for residual in ('hc', 'mhc'):  # run (the children above), so accepted
    pipeline_plan.validate(
      pipeline_plan.PipelineConfig(2, 2, 2),
      config_lib.model_config(num_layers=4, residual=residual),
      8,
    )
  # The run config's one validation (`config.validate`) includes the pipeline and the
  # batch split over the data-parallel devices.
  config = default_config.get_config('tiny')  # 2 layers, batch 8
  config.mesh.update(stage=2, num_microbatches=3)
  with pytest.raises(ValueError, match='does not split into 3 microbatches'):
    config_lib.validate(config)
  config.mesh.update(num_microbatches=2, shape=(-1, 1, 1))  # 4 devices: 2 data shards
  config_lib.validate(config, num_devices=4)
  with pytest.raises(ValueError, match='does not split over the 3 data-parallel'):
    config_lib.validate(config, num_devices=6)
  for bad in (
    dict(stage=0),
    dict(virtual_stages=2),
    dict(stage=2, pipeline_transfer='cache'),
    dict(axis_names=('data', 'fsdp', 'stage')),
  ):
    with pytest.raises(ValueError, match='Invalid mesh config'):
      sharding.validate_mesh_config(sharding.default_mesh_config(**bad))
