"""Sharded training on 8 simulated CPU devices equals training on one device (E4).

JAX fixes its device count when it starts, and the rest of the suite runs on one CPU
device, so the checks run in child processes started with
XLA_FLAGS=--xla_force_host_platform_device_count=8 (one per residual mode, in
parallel); each prints its measurements as JSON and the tests here judge them. Run one
directly with `python tests/nn/test_sharding.py block`.

Per mode, one train step (AdamW, clipping, weight decay) on the same global batch on
meshes (data, fsdp, tensor) = (8,1,1) (the standard residual), (2,2,2), (1,2,4)
against one device:
  * the loss, the gradient norm, the updated parameters and the optimizer moments;
  * every parameter's (and moment's) actual sharding against the one its logical axis
    names give under the rules, written out independently here;
  * the compiled step holds no collective over a whole AttnRes depth buffer (the depth
    read stays local; only the small pseudo-queries and gains are gathered), also with
    the hidden width split over 'tensor'.
"""

from __future__ import annotations

import functools
import json
import os
import re
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# mHC stands for both hyper-connection residuals: HC runs through the same residual
# class, streams and parameter axes, and a child costs ~35 s of CPU.
RESIDUALS = ('standard', 'full', 'block', 'mhc')
ATTNRES = ('full', 'block')  # the residuals with a depth buffer
MESHES = ((8, 1, 1), (2, 2, 2), (1, 2, 4))
# AttnRes and mHC on the meshes that split every axis: (2, 2, 2) the batch of their
# depth buffer or streams [K, B, T, D] over both 'data' and 'fsdp', with 'tensor';
# (1, 2, 4) one head per device. The data-only mesh (8, 1, 1) splits nothing of
# theirs that (2, 2, 2) does not; the standard residual checks it (every shared
# parameter, the step).


def meshes_of(residual: str):
  return MESHES if residual == 'standard' else MESHES[1:]


# Divisible by every mesh axis above, so no dimension falls back to unsplit.
MODEL = dict(
  vocab_size=256, d_model=32, num_layers=2, num_heads=4, mlp_dim=64, block_size=2
)
BATCH, LENGTH = 8, 24  # no parameter has a dimension of 24: see _buffer_collectives
# The rules, independently of attnres_jax.nn.sharding.DEFAULT_RULES (compared below).
EXPECTED_RULES = {
  'batch': ('data', 'fsdp'),
  'length': (),
  'hidden': (),
  'depth': (),
  'embed': ('fsdp',),
  'heads': ('tensor',),
  'head_dim': (),
  'mlp': ('tensor',),
  'vocab': ('tensor',),
  'layers': ('stage',),
  'stages': ('stage',),
  'sublayers': (),
}


# -- the child: runs with 8 devices ---------------------------------------------------


def _buffer_collectives(hlo_text: str, num_slots: int) -> list[str]:
  """Collectives whose result is (a shard of) a depth buffer [S, B, T, D]."""
  found = []
  pattern = re.compile(
    r'= \(?(\w+)\[([\d,]+)\][^=]*? (all-gather|all-to-all|all-reduce|'
    r'reduce-scatter|collective-permute|all-gather-start|'
    r'all-reduce-start|collective-permute-start)\('
  )
  for line in hlo_text.splitlines():
    match = pattern.search(line)
    if match:
      dims = [int(d) for d in match.group(2).split(',')]
      # [slots, batch (maybe a shard), length, width (maybe a shard)]; not the
      # [queries, slots, batch, length] logits of Phase 1.
      if len(dims) == 4 and dims[0] == num_slots and dims[2] == LENGTH:
        found.append(line.strip()[:200])
  return found


def run_checks(residual: str) -> dict:
  """One train step per mesh against one device; returns the measurements."""
  import jax  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top
  from flax import nnx  # pylint: disable=g-import-not-at-top
  from jax.sharding import NamedSharding  # pylint: disable=g-import-not-at-top
  from jax.sharding import PartitionSpec as P  # pylint: disable=g-import-not-at-top

  from attnres_jax.runs import checkpointing
  from attnres_jax.residuals.attnres import depth
  from attnres_jax.training import optim
  from attnres_jax.nn import sharding
  from attnres_jax.training import step as train
  from attnres_jax import config as config_lib  # pylint: disable=g-import-not-at-top
  from attnres_jax.residuals.attnres import residual as attnres  # pylint: disable=g-import-not-at-top
  from conftest import equality_train_config  # pylint: disable=g-import-not-at-top

  assert jax.device_count() == 8, jax.devices()
  model_config = config_lib.model_config(residual=residual, **MODEL)
  tx, schedule = optim.make_optimizer(equality_train_config())
  graphdef, _ = checkpointing.abstract_model(model_config)
  declared = sharding.logical_axes_tree(
    nnx.state(
      nnx.eval_shape(lambda: train.model_lib.Transformer(model_config, rngs=nnx.Rngs(0)))
    )
  )
  rng = np.random.default_rng(0)
  tokens = rng.integers(1, 256, (BATCH, LENGTH + 1)).astype(np.int32)
  weights = np.ones((BATCH, LENGTH), np.float32)
  weights[0, LENGTH // 2 :] = 0  # padding, as in eval batches
  batch = {'inputs': tokens[:, :-1], 'targets': tokens[:, 1:], 'weights': weights}
  slots = (
    depth.num_slots(
      config_lib.num_sublayers(model_config), attnres.block_size_of(model_config)
    )
    if residual in ATTNRES
    else None
  )

  def moments(state, name):  # Adam's mu or nu: a tree like the parameters
    return optax.tree_utils.tree_get(state.opt_state, name)

  def expected_sharding(mesh, names):
    return NamedSharding(mesh, P(*(EXPECTED_RULES[n] or None for n in names)))

  def step_on(shape, rules):
    devices = jax.devices()[: int(np.prod(shape))]
    mesh = sharding.make_mesh(sharding.default_mesh_config(shape=shape), devices)
    layout = train.make_layout(model_config, tx, mesh, rules)
    state = train.create_train_state(model_config, tx, 0, layout)
    mismatches = []
    for tree, what in (
      (state.params, 'params'),
      (moments(state, 'mu'), 'mu'),
      (moments(state, 'nu'), 'nu'),
    ):
      for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        names = functools.reduce(lambda d, k: d[k.key], path, declared)
        want = expected_sharding(mesh, names)
        want_shard = want.shard_shape(leaf.shape)
        got_shard = leaf.addressable_shards[0].data.shape
        if not leaf.sharding.is_equivalent_to(want, leaf.ndim) or got_shard != want_shard:
          mismatches.append(
            f'{what}{jax.tree_util.keystr(path)}: {names} -> '
            f'{leaf.sharding.spec} shard {got_shard}, want '
            f'{want.spec} shard {want_shard}'
          )
    global_batch = layout.to_global(batch)
    compiled = (
      train.jit_train_step(layout, graphdef=graphdef, tx=tx, schedule=schedule)
      .lower(state, global_batch)
      .compile()
    )
    new_state, metrics = compiled(state, global_batch)
    hlo = compiled.as_text()
    return {
      'metrics': {k: float(v) for k, v in jax.device_get(metrics).items()},
      'state': jax.device_get(
        (new_state.params, moments(new_state, 'mu'), moments(new_state, 'nu'))
      ),
      'mismatches': mismatches,
      'buffer_collectives': _buffer_collectives(hlo, slots) if slots else [],
    }

  rules = sharding.rules_from_config(sharding.default_mesh_config())
  out = {'rules_match': rules == EXPECTED_RULES, 'meshes': {}}
  if slots:  # the HLO check sees an all-gather of a buffer when there is one
    mesh = sharding.make_mesh(sharding.default_mesh_config(shape=(8, 1, 1)))
    gather = jax.jit(
      lambda x: jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P())),
      in_shardings=NamedSharding(mesh, P(None, 'data')),
    )
    hlo = (
      gather.lower(jax.ShapeDtypeStruct((slots, BATCH, LENGTH, 32), 'float32'))
      .compile()
      .as_text()
    )
    out['probe_detected'] = len(_buffer_collectives(hlo, slots))
  reference = step_on((1, 1, 1), rules)
  out['reference'] = reference['metrics']
  for shape in meshes_of(residual):
    result = step_on(shape, rules)
    diffs = {}
    for name, got, want in zip(
      ('params', 'mu', 'nu'), result['state'], reference['state']
    ):
      diffs[name] = max(
        float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want))
      )
      diffs[name + '_scale'] = max(
        float(np.max(np.abs(np.asarray(b)))) for b in jax.tree.leaves(want)
      )
    out['meshes'][str(shape)] = dict(
      metrics=result['metrics'],
      max_abs_diff=diffs,
      mismatches=result['mismatches'],
      buffer_collectives=result['buffer_collectives'],
    )
  if residual in ATTNRES:
    # The hidden width split over 'tensor' too: the depth read then sums its dot
    # products over devices ([Q, K, B, T] all-reduce) but still moves no buffer.
    tensor_rules = dict(rules, hidden=('tensor',))
    result = step_on((2, 2, 2), tensor_rules)
    out['hidden_on_tensor'] = dict(
      loss=result['metrics']['loss'], buffer_collectives=result['buffer_collectives']
    )
  return out


# -- the tests: run the children, judge the measurements ------------------------------


@pytest.fixture(scope='module')
def children():
  """One child per residual mode, started together (they compile on both cores)."""
  from conftest import child_env, start_children  # pylint: disable=g-import-not-at-top

  result, stop = start_children(os.path.abspath(__file__), RESIDUALS, child_env(8))
  yield result
  stop()


@pytest.mark.parametrize('residual', RESIDUALS)
def test_sharded_step_equals_one_device(children, residual):
  out, _ = children(residual)
  reference = out['reference']
  for shape in meshes_of(residual):
    got = out['meshes'][str(shape)]
    diff = got['max_abs_diff']
    # float32 sums in another order (per-device partial sums, then a cross-device
    # reduction) differ by a few ulps: measured <= 1e-6 relative on the loss. The
    # bounds leave 10x room and are still far below any real error (a wrong shard
    # or a missed reduction changes these by whole percents).
    assert got['metrics']['loss'] == pytest.approx(reference['loss'], rel=1e-5), shape
    assert got['metrics']['grad_norm'] == pytest.approx(
      reference['grad_norm'], rel=1e-5
    ), shape
    assert got['metrics']['tokens'] == reference['tokens']
    # Moments: mu = 0.1 g, nu = 0.05 g^2 (clipped gradient) -> relative to their size.
    assert diff['mu'] <= 1e-5 * diff['mu_scale'], (shape, diff)
    assert diff['nu'] <= 1e-5 * diff['nu_scale'], (shape, diff)
    # Parameters move by lr * g / (|g| + eps) <= lr = 1e-2 in this step; rounding of g
    # reaches them scaled by lr / eps = 10, and the parameters themselves are O(1)
    # (ulp 1.2e-7).
    assert diff['params'] <= 1e-5, (shape, diff)


@pytest.mark.parametrize('residual', RESIDUALS)
def test_parameter_shardings_follow_logical_axes(children, residual):
  out, stderr = children(residual)
  assert out['rules_match'], 'DEFAULT_RULES differ from the documented table'
  for shape in meshes_of(residual):
    assert out['meshes'][str(shape)]['mismatches'] == [], shape
  # The compiler never had to replicate a tensor to reach a sharding we asked for.
  assert 'Involuntary full rematerialization' not in stderr


@pytest.mark.parametrize('residual', ATTNRES)
def test_depth_read_does_not_gather_the_buffer(children, residual):
  out, _ = children(residual)
  for shape in meshes_of(residual):
    got = out['meshes'][str(shape)]
    assert got['buffer_collectives'] == [], (shape, got['buffer_collectives'])
  assert out['probe_detected'] == 1  # the check sees an all-gather of a buffer
  split = out['hidden_on_tensor']
  assert split['buffer_collectives'] == [], split['buffer_collectives']
  assert split['loss'] == pytest.approx(out['reference']['loss'], rel=1e-5)


if __name__ == '__main__':
  print(json.dumps(run_checks(sys.argv[1])))
