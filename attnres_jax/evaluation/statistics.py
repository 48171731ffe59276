"""The paper's analysis statistics of a model, as arrays (`evaluation/plots.py` draws
them).

* Depth-attention weights (paper Fig. 8): sublayer (rows) by source (columns),
  averaged over held-out tokens, for the pre-attention reads, the pre-MLP reads and
  the final read. Sources are buffer slots: slot 0 = token embedding, slot n = block n
  (Full: slot i + 1 = the output of sublayer i).
* Magnitudes across depth (paper Fig. 5): mean over tokens of the RMS of each
  sublayer's raw output and of the hidden state it reads.
* Entropy (nats) of each sublayer's depth weights, mean over tokens.
  (These three come from the evaluation pass itself: `evaluate.eval_sums` with
  `collect_stats=True`, weighted by the token weights, so padding never counts.)
* Gradient norm per sublayer (paper Fig. 5): the L2 norm of the gradient of the
  held-out loss (token-weighted mean over the batches given) with respect to each
  sublayer's parameters: attention = attention_norm + attention + row 0 of the
  layer's residual parameters (AttnRes query and gain), MLP = mlp_norm + mlp + row 1.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from attnres_jax import config as config_lib
from attnres_jax import residuals
from attnres_jax.evaluation import evaluate as evaluate_lib
from attnres_jax.residuals.attnres import depth
from attnres_jax.residuals.attnres import residual as attnres

Batch = Mapping[str, np.ndarray]


# -- depth bookkeeping for the AttnRes depth-weight figures --------------------------


def valid_source_mask(cfg) -> tuple[np.ndarray, np.ndarray]:
  """Which slots each sublayer reads: bool [num_layers, 2, num_slots], and the final
  read's bool [num_slots] (all slots)."""
  num_sub = config_lib.num_sublayers(cfg)
  size = attnres.block_size_of(cfg)
  slots = depth.num_slots(num_sub, size)
  counts = np.array([depth.num_valid_sources(l, size) for l in range(num_sub)])
  mask = np.arange(slots)[None, :] < counts[:, None]
  return mask.reshape(cfg.num_layers, 2, slots), np.ones(slots, bool)


def source_labels(cfg) -> list[str]:
  """Column labels: 'emb', then the sublayer outputs (Full: 'A0', 'M0', ...) or the
  blocks ('B1', 'B2', ...)."""
  num_sub = config_lib.num_sublayers(cfg)
  size = attnres.block_size_of(cfg)
  if size == 1:
    return ['emb'] + [f'{"AM"[i % 2]}{i // 2}' for i in range(num_sub)]
  return ['emb'] + [f'B{n}' for n in range(1, depth.num_blocks(num_sub, size) + 1)]


def sublayer_labels(cfg) -> list[str]:
  return [f'{"AM"[i % 2]}{i // 2}' for i in range(config_lib.num_sublayers(cfg))]


def mode_name(cfg) -> str:
  return residuals.make(cfg).label


# -- gradient norms -------------------------------------------------------------------


@functools.partial(jax.jit, static_argnums=0)
def _grad_sums(graphdef, params, batch):
  return jax.grad(
    lambda p: evaluate_lib.loss_sums(p, batch, graphdef=graphdef), has_aux=True
  )(params)


def sublayer_grad_norms(layer_grads: Mapping[str, Any]) -> np.ndarray:
  """L2 norms [num_layers, 2] of the per-sublayer parts of the stacked layer grads."""
  g = layer_grads
  groups = (('attention_norm', 'attention'), ('mlp_norm', 'mlp'))
  rows = []
  for which, names in enumerate(groups):
    squares = sum(
      np.sum(np.square(np.asarray(x, np.float64)).reshape(x.shape[0], -1), axis=1)
      for name in names
      for x in jax.tree.leaves(g[name])
    )
    # The residual's parameters hold one row per sublayer: [num_layers, 2, ...]
    # (the contract of `Residual.layer_params`).
    for x in jax.tree.leaves(g.get('residual')):
      if x.ndim < 2 or x.shape[1] != 2:
        raise ValueError(
          f'A residual layer parameter of shape {x.shape} has no row per '
          'sublayer ([num_layers, 2, ...]): see Residual.layer_params.'
        )
      row = np.asarray(x, np.float64)[:, which]
      squares = squares + np.sum(np.square(row).reshape(row.shape[0], -1), axis=1)
    rows.append(np.sqrt(squares))
  return np.stack(rows, axis=1)


def gradient_norms(
  model: nnx.Module, batches: Iterable[Batch], *, max_batches: int | None = None
) -> dict[str, np.ndarray]:
  """Per-sublayer gradient norms [num_layers, 2] of the held-out loss.

  The loss is the token-weighted mean NLL over the first `max_batches` batches.
  """
  graphdef, params = nnx.split(model)
  total, weight, count = None, None, 0
  for batch in batches:
    if max_batches is not None and count >= max_batches:
      break
    batch = {k: jnp.asarray(batch[k]) for k in ('inputs', 'targets', 'weights')}
    grads, w = _grad_sums(graphdef, params, batch)
    grads = nnx.to_pure_dict(grads)['layers']
    total = grads if total is None else jax.tree.map(jnp.add, total, grads)
    weight = w if weight is None else weight + w
    count += 1
  weight = 0.0 if weight is None else float(weight)
  if weight <= 0:
    raise ValueError('No batches with weight > 0 for the gradient norms.')
  mean_grads = jax.tree.map(lambda x: np.asarray(x, np.float64) / weight, total)
  return {
    'grad_norm': sublayer_grad_norms(mean_grads),
    'grad_tokens': np.asarray(weight, np.float64),
  }
