"""Held-out metrics over a whole evaluation split: loss, bits per byte, perplexity.

Sums over every batch the iterator yields (not a sample): the negative log-likelihood
of all targets with weight > 0 (padding and document starts have weight 0), the
weights (tokens) and the UTF-8 bytes of text those targets cover (batch['bytes'];
without it, one byte per weighted token, as for the byte tokenizer). Then

  loss           = NLL / tokens              nats per token
  perplexity     = exp(loss)                 per token
  bits_per_byte  = NLL / bytes / ln 2        bits per byte of the evaluated text

Bits per byte compare across tokenizers; loss and perplexity only within one. With
byte tokens, bytes == tokens and bits_per_byte = loss / ln 2.
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


def metrics_from_sums(total_nll: float, total_weight: float,
                      total_bytes: float | None = None) -> dict[str, float]:
  """loss (nats per token), bits_per_byte and perplexity (per token) from the summed
  NLL, weights (tokens) and text bytes (default: one byte per token)."""
  if total_weight <= 0:
    raise ValueError('The evaluation batches have no target with weight > 0.')
  total_bytes = total_weight if total_bytes is None else total_bytes
  if total_bytes <= 0:
    raise ValueError('The evaluated targets cover no text bytes.')
  loss = total_nll / total_weight
  return {
      'loss': loss,
      'bits_per_byte': total_nll / total_bytes / math.log(2),
      'perplexity': math.exp(loss) if loss < 700 else math.inf,
  }


def evaluate(model: nnx.Module, batches: Iterable[Batch]) -> dict[str, float]:
  """Held-out metrics over every batch of `batches` (see the module docstring).

  Returns loss (nats per token), bits_per_byte, perplexity (per token), num_tokens
  (summed weights), num_bytes (summed text bytes) and num_batches. The per-batch sums
  stay on device until the end and are added in float64 on the host.
  """
  graph, state = split_model(model)
  sums, num_bytes = [], 0
  for batch in batches:
    sums.append(_eval_step(graph, state, jnp.asarray(batch['inputs']),
                           jnp.asarray(batch['targets']),
                           jnp.asarray(batch['weights'])))
    # Without per-token byte counts, every weighted target is one byte.
    counts = batch['bytes'] if 'bytes' in batch else batch['weights']
    num_bytes += float(np.sum(counts, dtype=np.float64))
  if not sums:
    raise ValueError('No evaluation batches.')
  nll, weight = (np.asarray(jax.device_get(x), np.float64) for x in zip(*sums))
  total_nll, total_weight = float(nll.sum()), float(weight.sum())
  metrics = metrics_from_sums(total_nll, total_weight, num_bytes)
  metrics.update(num_tokens=total_weight, num_bytes=num_bytes, num_batches=len(sums))
  return metrics
