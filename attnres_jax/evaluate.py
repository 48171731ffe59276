"""Held-out metrics over a whole evaluation split: loss, bits per byte, perplexity.

Every metric is token weighted: the summed negative log-likelihood of all targets with
weight > 0 (padding and document separators have weight 0), divided by the summed
weights, accumulated over every batch the iterator yields (not a sample). With byte
tokens one token is one byte, so bits per byte = loss / ln 2.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

Batch = Mapping[str, np.ndarray]


class StaticGraph:
  """A model's GraphDef as a hashable static jit argument.

  GraphDefs hold the (unhashable) ConfigDict, so they cannot be static arguments
  themselves. Two models with the same structure and config share one key (their
  GraphDef reprs are equal), so jitted functions compile once per model structure.
  """

  def __init__(self, graphdef):
    self.graphdef = graphdef
    self._key = repr(graphdef)
    self._hash = hash(self._key)

  def __hash__(self):
    return self._hash

  def __eq__(self, other):
    return isinstance(other, StaticGraph) and self._key == other._key


def split_model(model: nnx.Module) -> tuple[StaticGraph, nnx.State]:
  """nnx.split with the GraphDef wrapped as a static jit argument."""
  graphdef, state = nnx.split(model)
  return StaticGraph(graphdef), state


def token_nll(logits_BTV: jax.Array, targets_BT: jax.Array) -> jax.Array:
  """Per-token negative log-likelihood in float32, [B, T]."""
  log_probs_BTV = jax.nn.log_softmax(logits_BTV.astype(jnp.float32), axis=-1)
  return -jnp.take_along_axis(log_probs_BTV, targets_BT[..., None], axis=-1)[..., 0]


@functools.partial(jax.jit, static_argnums=0)
def _eval_step(graph, state, inputs_BT, targets_BT, weights_BT):
  model = nnx.merge(graph.graphdef, state)
  nll_BT = token_nll(model(inputs_BT), targets_BT)
  weights_BT = weights_BT.astype(jnp.float32)
  return jnp.sum(nll_BT * weights_BT), jnp.sum(weights_BT)


def eval_step(model: nnx.Module, batch: Batch) -> tuple[jax.Array, jax.Array]:
  """(summed weighted NLL, summed weights) of one batch; jitted, one compile per shape."""
  graph, state = split_model(model)
  return _eval_step(graph, state, jnp.asarray(batch['inputs']),
                    jnp.asarray(batch['targets']), jnp.asarray(batch['weights']))


def metrics_from_sums(total_nll: float, total_weight: float, *,
                      bytes_per_token: float = 1.0) -> dict[str, float]:
  """loss (nats per token), bits_per_byte and perplexity from summed NLL and weights."""
  if total_weight <= 0:
    raise ValueError('The evaluation batches have no target with weight > 0.')
  loss = total_nll / total_weight
  return {
      'loss': loss,
      'bits_per_byte': loss / math.log(2) / bytes_per_token,
      'perplexity': math.exp(loss) if loss < 700 else math.inf,
  }


def evaluate(model: nnx.Module, batches: Iterable[Batch], *,
             bytes_per_token: float = 1.0) -> dict[str, float]:
  """Token-weighted held-out metrics over every batch of `batches`.

  Returns loss (mean NLL in nats per weighted token), bits_per_byte, perplexity,
  num_tokens (summed weights) and num_batches. The per-batch sums stay on device
  until the end and are added in float64 on the host.
  """
  graph, state = split_model(model)
  sums = []
  for batch in batches:
    sums.append(_eval_step(graph, state, jnp.asarray(batch['inputs']),
                           jnp.asarray(batch['targets']),
                           jnp.asarray(batch['weights'])))
  if not sums:
    raise ValueError('No evaluation batches.')
  nll, weight = (np.asarray(jax.device_get(x), np.float64) for x in zip(*sums))
  total_nll, total_weight = float(nll.sum()), float(weight.sum())
  metrics = metrics_from_sums(total_nll, total_weight, bytes_per_token=bytes_per_token)
  metrics.update(num_tokens=total_weight, num_batches=len(sums))
  return metrics
