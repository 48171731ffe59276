"""A residual is one class and one registry line: a toy residual written here, against
the interface alone, and registered here, runs through the stack, trains through
`Transformer` and the library's train step, evaluates, analyses, decodes, counts its
FLOPs and runs under the pipeline, with no edit to the library.

The pipeline check runs in a child process with 2 simulated devices (as in
test_pipeline.py); run it directly with `python tests/residuals/test_residual.py pipeline`.
"""

import dataclasses
import functools
import json
import os
import sys
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from flax import nnx

from attnres_jax.runs import checkpointing
from attnres_jax import config as config_lib
from attnres_jax.evaluation import evaluate
from attnres_jax import flops
from attnres_jax.models import transformer as model_lib
from attnres_jax.training import optim
from attnres_jax.parallel import pipeline
from attnres_jax.parallel import pipeline_plan
from attnres_jax import residuals
from attnres_jax.nn import sharding
from attnres_jax.nn import stack
from attnres_jax.evaluation import statistics
from attnres_jax.training import step as train
from conftest import child_env, start_children, train_config

D, NUM_LAYERS = 8, 5


class Gates(nnx.Module):
  """One learned scalar per sublayer of a layer (rows: [2])."""

  def __init__(self):
    self.gate = nnx.Param(jnp.ones(2), out_sharding=('sublayers',), eager_sharding=False)


class GatedCarry(NamedTuple):
  h_BTD: jax.Array
  count: jax.Array  # sublayers run so far


@dataclasses.dataclass(frozen=True)
class GatedResidual(residuals.Residual):
  """h <- h + gate * f(h), in segments of 2 layers (5 layers: a shorter last one).

  The carry also counts the sublayers run; each segment hands its gates to its
  layers through `begin_segment`, as AttnRes hands over its Phase 1 statistics.
  """

  cfg: Any
  segment_layers: int = 2
  no_decay = frozenset({'gate'})

  def layer_params(self):
    return Gates()

  def init(self, x_BTD):
    return GatedCarry(x_BTD, jnp.zeros((), jnp.int32))

  def begin_segment(self, carry, params, segment):
    return carry, params.gate[...]  # [G, 2]: the stack hands each layer its row

  def read(self, inner, params, per_layer, layer_in_segment, which):
    return inner.h_BTD, None

  def write(self, inner, params, per_layer, layer_in_segment, which, out_BTD):
    h_BTD = inner.h_BTD + per_layer[which].astype(out_BTD.dtype) * out_BTD
    return GatedCarry(h_BTD, inner.count + 1)

  def final(self, carry, params):
    return carry.h_BTD, None

  def forward_flops(self):
    return 2.0 * self.cfg.d_model * 2 * self.cfg.num_layers  # a multiply-add per channel

  def io_per_sublayer(self):
    return 2.0, 1.0

  def carry_axes(self):
    return GatedCarry(sharding.HIDDEN, ())


residuals.register('gated', GatedResidual)  # the one registry line

MODEL = dict(
  vocab_size=64, d_model=16, num_layers=4, num_heads=2, mlp_dim=32, residual='gated'
)


def toy_batch(batch=4, length=8, seed=0):
  tokens = (
    np.random.default_rng(seed).integers(1, 64, (batch, length + 1)).astype(np.int32)
  )
  return {
    'inputs': tokens[:, :-1],
    'targets': tokens[:, 1:],
    'weights': np.ones((batch, length), np.float32),
  }


# -- the interface alone, through the stack -------------------------------------------


class ToyLayer(nnx.Module):
  """A layer in the shape the stack expects: `sublayer(which, h, positions)` and the
  residual's parameters as `residual`."""

  def __init__(self, residual, rngs):
    self.weights = nnx.Param(jax.random.normal(rngs.params(), (2, D, D)) / D**0.5)
    self.residual = residual.layer_params()

  def sublayer(self, which, h_BTD, positions_BT):
    del positions_BT
    return jnp.tanh(h_BTD @ self.weights[...][which])


@pytest.mark.parametrize('scan_layers', [True, False])
@pytest.mark.parametrize('remat', ['none', 'layer'])
def test_a_residual_written_against_the_interface_runs_through_the_stack(
  scan_layers, remat
):
  cfg = ml_collections.ConfigDict(
    dict(num_layers=NUM_LAYERS, scan_layers=scan_layers, remat=remat)
  )
  residual = GatedResidual(cfg)

  @nnx.vmap(in_axes=0, out_axes=0)
  def make_layers(rngs):
    return ToyLayer(residual, rngs)

  layers = make_layers(nnx.Rngs(0).split(NUM_LAYERS))
  gates = jnp.arange(2 * NUM_LAYERS, dtype=jnp.float32).reshape(NUM_LAYERS, 2) / 10
  layers.residual.gate[...] = gates
  x = jax.random.normal(jax.random.key(1), (2, 3, D))
  positions = jnp.zeros((2, 3), jnp.int32)
  graphdef, state = nnx.split(layers)

  def run(state):
    carry, _ = stack.run_layers(residual, graphdef, state, x, positions, cfg=cfg)
    return carry.h_BTD, carry.count

  h, count = jax.jit(run)(state)
  expected = x
  weights = layers.weights[...]
  for k in range(NUM_LAYERS):
    for which in (0, 1):
      expected = expected + gates[k, which] * jnp.tanh(expected @ weights[k, which])
  assert int(count) == 2 * NUM_LAYERS
  np.testing.assert_allclose(h, expected, rtol=1e-5, atol=1e-5)  # float32, 10 steps
  # Gradients flow to the residual's own parameters through the stack.
  grads = jax.grad(lambda s: jnp.sum(run(s)[0]))(state)
  assert grads['residual']['gate'][...].shape == (NUM_LAYERS, 2)
  assert bool(jnp.all(grads['residual']['gate'][...] != 0))


# -- registered: the whole library --------------------------------------------------


def test_a_registered_residual_runs_through_the_library():

  with pytest.raises(ValueError, match="'gated'"):  # the error lists the new mode
    config_lib.model_config(**{**MODEL, 'residual': 'gate'})
  cfg = config_lib.model_config(**MODEL)
  model = model_lib.Transformer(cfg, rngs=nnx.Rngs(0))
  assert isinstance(model.residual, GatedResidual)
  # Training: its gates are spared weight decay (declared), and they learn.
  tx, schedule = optim.make_optimizer(
    train_config(learning_rate=1e-2, warmup_steps=0, weight_decay=0.1)
  )
  state = train.init_train_state(cfg, tx, seed=0)
  mask = optim.decay_mask(state.params)
  assert not mask['layers']['residual']['gate'] and mask['layers']['mlp']['up']
  step = jax.jit(
    functools.partial(
      train.train_step, graphdef=nnx.graphdef(model), tx=tx, schedule=schedule
    )
  )
  batch = jax.tree.map(jnp.asarray, toy_batch())
  losses = []
  for _ in range(3):
    state, metrics = step(state, batch)
    losses.append(float(metrics['loss']))
  assert losses[-1] < losses[0]
  gates = state.params['layers']['residual']['gate']
  assert gates.shape == (MODEL['num_layers'], 2) and bool(jnp.all(gates != 1.0))
  nnx.update(model, state.params)
  # Evaluation with the analysis statistics, and the per-sublayer gradient norms.
  metrics = evaluate.evaluate_model(model, [toy_batch(seed=1)], collect_stats=True)
  assert metrics['num_tokens'] == 4 * 8
  assert metrics['stats']['input_rms'].shape == (MODEL['num_layers'], 2)
  norms = statistics.gradient_norms(model, [toy_batch(seed=1)])['grad_norm']
  assert norms.shape == (MODEL['num_layers'], 2) and np.all(norms > 0)
  # Decoding: a prefill and one step equal the full forward pass.
  tokens = jnp.asarray(toy_batch(batch=2, length=6)['inputs'])
  graphdef, params = nnx.split(model)
  decode = jax.jit(
    lambda p, t, c, i: nnx.merge(graphdef, p).decode(t, c, i), static_argnums=3
  )
  prefill, cache = decode(params, tokens[:, :5], model.init_cache(2, 6), 0)
  last, _ = decode(params, tokens[:, 5:], cache, 5)
  full = jax.jit(lambda p, t: nnx.merge(graphdef, p)(t))(params, tokens)
  # float32: the cached attention sums the same terms in another order.
  np.testing.assert_allclose(
    np.concatenate([prefill, last], axis=1), full, atol=1e-5, rtol=1e-5
  )
  # FLOPs: the residual's declared arithmetic is the depth-read term.
  terms = flops.forward_flops_per_token(cfg, seq_len=8)
  assert terms['depth_read'] == 2.0 * 16 * 8
  assert flops.residual_io_per_sublayer(cfg)['total'] == 3.0


# -- the pipeline: a child process with 2 devices --------------------------------------


def run_pipeline_check() -> dict:
  """Two train steps of the toy model, pipelined over 2 stages (2 microbatches) and
  on one device; their losses and parameters."""

  assert jax.device_count() == 2, jax.devices()
  cfg = config_lib.model_config(**MODEL)
  # As test_pipeline.py: a moderate eps keeps Adam's update proportional to g.
  tx, schedule = optim.make_optimizer(
    train_config(learning_rate=1e-2, warmup_steps=0, schedule='constant', eps=1e-3)
  )
  batch = toy_batch()
  out = {}
  for name, mesh_overrides in (
    ('one_device', dict(shape=(1, 1, 1))),
    ('pipelined', dict(stage=2, shape=(1, 1, 1), num_microbatches=2)),
  ):
    mesh_config = sharding.default_mesh_config(**mesh_overrides)
    pipe = pipeline_plan.from_mesh_config(mesh_config)
    pipeline_plan.validate(pipe, cfg, batch_size=4)
    mesh = sharding.make_mesh(mesh_config, jax.devices()[: mesh_config.stage])
    layout = train.make_layout(cfg, tx, mesh, sharding.rules_from_config(mesh_config))
    state = train.create_train_state(cfg, tx, 0, layout)
    step = train.jit_train_step(
      layout,
      graphdef=checkpointing.abstract_model(cfg)[0],
      tx=tx,
      schedule=schedule,
      loss_fn=pipeline.make_loss_fn(pipe),
    )
    losses = []
    for _ in range(2):
      state, metrics = step(state, layout.to_global(batch))
      losses.append(float(metrics['loss']))
    out[name] = dict(
      losses=losses,
      params=[
        np.asarray(x).tolist() for x in jax.tree.leaves(jax.device_get(state.params))
      ],
    )
  return out


def test_a_registered_residual_runs_under_the_pipeline():
  result, stop = start_children(os.path.abspath(__file__), ['pipeline'], child_env(2))
  try:
    out, _ = result('pipeline')
  finally:
    stop()
  one, piped = out['one_device'], out['pipelined']
  # As in test_pipeline.py: float32 sums per microbatch in another order differ by a
  # few ulps; a microbatch lost or a stage out of order changes the loss by percents.
  np.testing.assert_allclose(piped['losses'], one['losses'], rtol=1e-5)
  # Parameters move by <= lr = 1e-2 a step; rounding of g reaches them scaled by
  # lr / eps = 10, and they are O(1) (ulp 1.2e-7).
  for a, b in zip(piped['params'], one['params']):
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)


if __name__ == '__main__':
  print(json.dumps(run_pipeline_check() if sys.argv[1] == 'pipeline' else {}))
