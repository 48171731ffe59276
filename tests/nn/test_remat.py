"""Remat policies by name (nn/remat.py): each computes the loss and gradients of
'none', and 'minimal' keeps the matmul outputs it names, not the attention scores."""

import functools
import logging

import chex
import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax._src.ad_checkpoint import saved_residuals

from attnres_jax import config as config_lib
from attnres_jax.models import transformer as model_lib
from attnres_jax.nn import remat as remat_lib
from conftest import DEFAULT_EMITTERS

TINY = dict(d_model=32, num_layers=2, num_heads=2, mlp_dim=64)
BATCH, SEQ = 2, 16


def loss_fn(**fields):
  """(loss of the tiny model with `fields` as a function of its state, the state)."""
  cfg = config_lib.model_config(**TINY, **fields)
  graphdef, state = nnx.split(model_lib.Transformer(cfg, rngs=nnx.Rngs(0)))
  tokens = jax.random.randint(jax.random.key(1), (BATCH, SEQ), 0, 256)

  def loss(state):
    logits = nnx.merge(graphdef, state)(tokens)
    return -jnp.mean(jax.nn.log_softmax(logits)[..., 0])

  return loss, state


@functools.cache
def loss_and_grads(residual, policy):
  loss, state = loss_fn(residual=residual, remat=policy)
  return jax.jit(jax.value_and_grad(loss), compiler_options=DEFAULT_EMITTERS)(state)


@pytest.mark.parametrize(
  'residual, policy',
  [
    ('standard', 'minimal'),
    ('standard', 'sublayer'),
    ('standard', 'layer'),
    ('standard', 'offload'),
    ('block', 'minimal'),  # AttnRes's own backward applies it per sublayer body
  ],
)
def test_every_policy_computes_the_loss_and_gradients_of_none(residual, policy):
  """The rerun computes the same operations on the same values: bit for bit on the
  CPU."""
  chex.assert_trees_all_equal(
    loss_and_grads(residual, policy), loss_and_grads(residual, 'none')
  )


def named(residuals):
  return sorted(
    source.split("'")[1] for _, source in residuals if source.startswith('named')
  )


def test_minimal_keeps_the_named_matmul_outputs_and_not_the_scores():
  """Unrolled layers, so that each kept value shows where it comes from: 'minimal'
  keeps q, k, v, the attention's output and the MLP's two hidden projections of each
  layer, and no [..., T, T] array (the scores and probabilities, which 'none'
  keeps)."""
  scores = lambda aval: aval.shape[-2:] == (SEQ, SEQ)
  kept = {}
  for policy in ('none', 'minimal'):
    loss, state = loss_fn(residual='standard', remat=policy, scan_layers=False)
    kept[policy] = saved_residuals(loss, state)
  assert named(kept['minimal']) == sorted(remat_lib.MATMUL_OUTPUTS * TINY['num_layers'])
  assert not any(scores(aval) for aval, _ in kept['minimal'])
  assert any(scores(aval) for aval, _ in kept['none'])
  size = lambda residuals: sum(aval.size for aval, _ in residuals)
  assert size(kept['minimal']) < size(kept['none'])


def test_minimal_keeps_the_splash_kernels_residuals():
  """With splash attention, 'minimal' keeps the kernel's output and log-sum-exp (its
  residuals, named inside it) of each layer: the backward does not rerun the forward
  kernel. Shown as outputs of the kernel: [B, N, T padded to 128] statistics."""
  loss, state = loss_fn(
    residual='standard', remat='minimal', scan_layers=False, attention='splash'
  )
  statistics = [
    aval
    for aval, source in saved_residuals(loss, state)
    if '_splash_attention' in source and aval.shape == (BATCH, TINY['num_heads'], 128)
  ]
  assert len(statistics) == TINY['num_layers']


def test_offload_off_the_tpu_runs_minimal_said_once(monkeypatch, caplog):
  monkeypatch.setattr(remat_lib, '_SAID', set())
  identity = lambda x: jnp.sin(remat_lib.name(x * 2.0, 'query'))
  with caplog.at_level(logging.WARNING):
    for _ in range(2):
      offloaded = saved_residuals(remat_lib.sublayer('offload', identity), jnp.ones(4))
  minimal = saved_residuals(remat_lib.sublayer('minimal', identity), jnp.ones(4))
  assert named(offloaded) == named(minimal) == ['query']
  said = [r.getMessage() for r in caplog.records if 'TPUs only' in r.getMessage()]
  assert len(said) == 1, said


def test_an_unknown_policy_is_one_clear_error():
  with pytest.raises(ValueError, match=r"remat must be one of \('none', 'minimal'"):
    config_lib.model_config(remat='selective')
