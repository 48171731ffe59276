"""The optimiser and the train step: the weight-decay mask, the step against a direct
AdamW computation, gradient accumulation, learning-rate schedules."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from attnres_jax.training import optim
from attnres_jax.training import step as train_lib
from attnres_jax.models.transformer import Transformer
from configs import default as default_config

from conftest import train_config as _train_config


def _decayed(name: str) -> bool:
  """The decay rule, restated: norm gains, embeddings (by default) and the AttnRes
  queries and gains (the residual's parameters) are not decayed."""
  *parents, own = name.split('/')
  if own in ('scale', 'embedding'):
    return False
  return not ({'residual', 'final_residual'} & set(parents) and own in ('query', 'gain'))


@functools.cache
def _params():
  """(model, graphdef, pure-dict params) of a tiny model with an untied head."""
  cfg = default_config.get_config('tiny').model
  cfg.tie_embeddings = False  # a ConfigDict: the model turns it into a ModelConfig
  model = Transformer(cfg, rngs=nnx.Rngs(0))
  graphdef, state = nnx.split(model)
  return model, graphdef, nnx.to_pure_dict(state)


def _leaf_names(tree) -> dict[str, object]:
  """'layers/attention/query' -> leaf."""
  return {
    '/'.join(k.key for k in path): leaf
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree)
  }


@pytest.mark.parametrize('decay_embeddings', [False, True])
def test_weight_decay_mask_excludes_exactly_norms_queries_gains(decay_embeddings):
  _, _, params = _params()
  mask = _leaf_names(optim.decay_mask(params, decay_embeddings=decay_embeddings))
  not_decayed = {path for path, decayed in mask.items() if not decayed}
  expected = {
    'final_norm/scale',
    'final_residual/query',
    'final_residual/gain',
    'layers/residual/query',
    'layers/residual/gain',
    'layers/attention_norm/scale',
    'layers/mlp_norm/scale',
  }
  if not decay_embeddings:
    expected.add('embedding')
  assert not_decayed == expected
  assert {p for p, decayed in mask.items() if decayed} >= {
    'lm_head',
    'layers/attention/query',
    'layers/attention/key',
    'layers/attention/value',
    'layers/attention/out',
    'layers/mlp/gate',
    'layers/mlp/up',
    'layers/mlp/down',
  }
  # The mask reaches the optimizer: with zero gradients only decayed weights move.
  tc = _train_config(
    warmup_steps=0, schedule='constant', decay_embeddings=decay_embeddings
  )
  tx, _ = optim.make_optimizer(tc)
  zeros = jax.tree.map(jnp.zeros_like, params)
  updates, _ = jax.jit(tx.update)(zeros, tx.init(params), params)
  moved = {p for p, u in _leaf_names(updates).items() if np.any(u != 0)}
  assert moved == set(mask) - expected


def _batch(batch_size=4, seq_len=16, seed=0):
  rng = np.random.default_rng(seed)
  tokens = rng.integers(1, 256, (batch_size, seq_len + 1)).astype(np.int32)
  weights = np.ones((batch_size, seq_len), np.float32)
  weights[0, seq_len // 2 :] = 0  # padding, as in eval batches
  return {'inputs': tokens[:, :-1], 'targets': tokens[:, 1:], 'weights': weights}


def test_train_step_matches_direct_adamw_computation():
  model, graphdef, params = _params()
  # Adam's first step, g / (|g| + eps), amplifies float32 differences in tiny gradient
  # components (different summation orders) by up to 1 / eps: keep eps moderate.
  lr, wd, clip, eps = 1e-2, 0.1, 0.5, 1e-3
  tc = _train_config(
    learning_rate=lr,
    warmup_steps=0,
    schedule='constant',
    weight_decay=wd,
    grad_clip=clip,
    eps=eps,
  )
  tx, schedule = optim.make_optimizer(tc)
  state = train_lib.TrainState(
    step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params)
  )
  batch = _batch()
  step = jax.jit(
    functools.partial(train_lib.train_step, graphdef=graphdef, tx=tx, schedule=schedule)
  )
  new_state, metrics = step(state, batch)

  # Independently: mean cross-entropy over weighted tokens, by log_softmax and nnx.grad.
  def loss_fn(m):
    log_probs = jax.nn.log_softmax(m(batch['inputs']), axis=-1)
    nll = -jnp.take_along_axis(log_probs, batch['targets'][..., None], axis=-1)[..., 0]
    return jnp.sum(nll * batch['weights']) / jnp.sum(batch['weights'])

  loss, grads = nnx.jit(nnx.value_and_grad(loss_fn))(model)
  grads = {
    k: np.asarray(v, np.float64)
    for k, v in _leaf_names(nnx.to_pure_dict(nnx.state(grads))).items()
  }
  norm = math.sqrt(sum(np.sum(g**2) for g in grads.values()))
  # Adam's first step, bias-corrected: m = g, v = g^2, so the step is g / (|g| + eps).
  scale = min(1.0, clip / norm)
  expected = {}
  for name, p in _leaf_names(params).items():
    g = grads[name] * scale
    decay = wd * np.asarray(p) if _decayed(name) else 0.0
    expected[name] = np.asarray(p) - lr * (g / (np.abs(g) + eps) + decay)

  # The same mean NLL by two compiled programs: a float32 sum of n = 56 weighted positive
  # terms is within (n - 1) u of exact in any order (u = 2^-24), so the two differ by at
  # most 2 (n - 1) u = 6.6e-6 relative, plus a few ulp per token from the two fusions'
  # logits; a wrong mask or normalisation moves it by a percent or more.
  assert float(metrics['loss']) == pytest.approx(float(loss), rel=1e-5)
  assert float(metrics['grad_norm']) == pytest.approx(norm, rel=1e-5)
  assert float(metrics['tokens']) == batch['weights'].sum()
  assert float(metrics['learning_rate']) == pytest.approx(lr)
  assert int(new_state.step) == 1
  got = _leaf_names(new_state.params)
  for name in expected:
    np.testing.assert_allclose(
      got[name], expected[name], rtol=1e-5, atol=lr * 1e-4, err_msg=name
    )
  # An untrained model's logits have about unit variance (tied-init scale, final
  # RMSNorm), so the loss is about ln 256 + 1/2 (E logsumexp of N(0, 1) logits).
  assert abs(float(loss) - (math.log(256) + 0.5)) < 0.3


def test_gradient_accumulation_equals_whole_batch():
  _, graphdef, params = _params()
  tx, schedule = optim.make_optimizer(_train_config(warmup_steps=0, schedule='constant'))
  state = train_lib.TrainState(
    step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params)
  )
  batch = _batch(batch_size=8)
  results = [
    jax.jit(
      functools.partial(
        train_lib.train_step,
        graphdef=graphdef,
        tx=tx,
        schedule=schedule,
        grad_accum_steps=k,
      )
    )(state, batch)
    for k in (1, 4)
  ]
  (state1, metrics1), (state4, metrics4) = results
  for key in metrics1:
    np.testing.assert_allclose(metrics4[key], metrics1[key], rtol=1e-5)
  jax.tree.map(
    functools.partial(np.testing.assert_allclose, rtol=1e-4, atol=1e-6),
    state4.params,
    state1.params,
  )


@pytest.mark.parametrize('name', ['cosine', 'wsd', 'constant'])
def test_learning_rate_schedules(name):
  tc = _train_config(
    num_steps=100,
    warmup_steps=10,
    schedule=name,
    learning_rate=1.0,
    min_lr_ratio=0.1,
    decay_fraction=0.2,
  )
  lrs = np.array([float(optim.learning_rate_schedule(tc)(s)) for s in range(101)])
  np.testing.assert_allclose(lrs[:11], np.linspace(0, 1, 11), atol=1e-6)  # warmup
  assert lrs.max() == pytest.approx(1.0)
  end = {'cosine': 0.1, 'wsd': 0.1, 'constant': 1.0}[name]
  assert lrs[100] == pytest.approx(end, abs=1e-6)
  if name == 'wsd':
    np.testing.assert_allclose(lrs[10:81], 1.0)  # stable until the last 20%
    assert np.all(np.diff(lrs[80:]) < 0)
