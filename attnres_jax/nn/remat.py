"""Rematerialisation policies by name (`model.remat`): what the backward pass keeps of
the forward's activations and what it computes again.

  'none'      keep every activation autodiff needs (the most memory, no rerun)
  'minimal'   per sublayer, keep the outputs of its matmuls (named in the model with
              `name`: the q, k, v projections, the attention's output and its
              softmax statistics, the MLP's gate and up projections) and rerun the elementwise work between them (PreNorm,
              rotary embedding, SiLU and gating): no T x T scores are kept
  'sublayer'  per sublayer, keep its input alone and rerun the sublayer
  'layer'     per layer, keep its input alone and rerun the whole layer
  'offload'   as 'minimal', with the kept matmul outputs moved to host memory in the
              forward and back for the backward (TPU); compiled for other devices it
              runs as 'minimal', said once in the log

`sublayer(policy, f)` wraps one sublayer's function; 'layer' is applied by the stack
(`nn/stack.py`) around each layer.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
from absl import logging

from attnres_jax.nn import sharding

REMAT_POLICIES = ('none', 'minimal', 'sublayer', 'layer', 'offload')  # model.remat
# The names of the matmul outputs that 'minimal' keeps: those the backward reads (the
# output projections' results leave the sublayer, into the residual). The splash
# kernel names its own residuals (output and log-sum-exp) ATTENTION_RESIDUALS.
MATMUL_OUTPUTS = (
  'query',
  'key',
  'value',
  'attention',
  'mlp_gate',
  'mlp_up',
)
ATTENTION_RESIDUALS = 'attention_residuals'
KEPT = MATMUL_OUTPUTS + (ATTENTION_RESIDUALS,)
_SAID: set[str] = set()


def name(x: jax.Array, what: str) -> jax.Array:
  """`x` named `what` (one of `MATMUL_OUTPUTS`) for the checkpoint policies."""
  return jax.ad_checkpoint.checkpoint_name(x, what)


def _offload_policy():
  if sharding.compile_platform() == 'tpu':
    return jax.checkpoint_policies.save_and_offload_only_these_names(
      names_which_can_be_saved=(),
      names_which_can_be_offloaded=KEPT,
      offload_src='device',
      offload_dst='pinned_host',
    )
  note = (
    "model.remat='offload' moves activations to host memory on TPUs only: 'minimal' here"
  )
  if note not in _SAID:
    _SAID.add(note)
    logging.warning('%s.', note)
  return jax.checkpoint_policies.save_only_these_names(*KEPT)


def sublayer(policy: str, function: Callable) -> Callable:
  """`function` (one sublayer) as `policy` runs it: checkpointed with what it keeps
  ('minimal', 'offload', 'sublayer'), else itself ('none'; 'layer' is the stack's)."""
  if policy in ('none', 'layer'):
    return function
  if policy == 'sublayer':
    return jax.checkpoint(function)
  if policy == 'minimal':
    return jax.checkpoint(
      function, policy=jax.checkpoint_policies.save_only_these_names(*KEPT)
    )
  if policy == 'offload':
    return jax.checkpoint(function, policy=_offload_policy())
  raise ValueError(f'model.remat must be one of {REMAT_POLICIES}, got {policy!r}.')
