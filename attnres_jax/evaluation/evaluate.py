"""The one evaluation path: held-out loss, bits per byte, perplexity and, in the same
forward pass, the depth statistics of the analysis.

Training (`train.py`), `eval.py`, the analysis, the notebooks and the benchmarks all
call `eval_sums` on each batch (jitted however the caller places its arrays) and
`evaluate` to add the sums up. Over every batch given (not a sample) it sums the
negative log-likelihood of all targets with weight > 0 (padding and document starts
have weight 0), the weights (tokens) and the UTF-8 bytes of text those targets cover
(batch['bytes']; without it, one byte per weighted token, as for the byte tokenizer).
Then

  loss           = NLL / tokens              nats per token
  perplexity     = exp(loss)                 per token
  bits_per_byte  = NLL / bytes / ln 2        bits per byte of the evaluated text

Bits per byte compare across tokenizers; loss and perplexity only within one. With
byte tokens, bytes == tokens and bits_per_byte = loss / ln 2.

The statistics (`collect_stats=True`) are means over the same weighted tokens: each
batch's token-weighted means times its weight, summed, divided by the total weight.
They are computed with the one-shot depth read (the reference), which gives the
depth weights of every read; its loss equals the two-phase loss to float32 rounding.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

Batch = Mapping[str, Any]
LN2 = math.log(2.0)
STATS_PREFIX = 'stats/'


def bits_per_byte(nats: float, num_bytes: float) -> float:
  """Bits per byte of text coded with `nats` of negative log-likelihood."""
  return nats / num_bytes / LN2


def loss_sums(params, batch: Batch, *, graphdef) -> tuple[jax.Array, jax.Array]:
  """(sum of weighted token cross-entropies in nats, sum of weights) of a batch: the
  loss training differentiates and evaluation reports."""
  logits_BTV = nnx.merge(graphdef, params)(batch['inputs'])
  return _weighted_nll(logits_BTV, batch)


def _weighted_nll(logits_BTV, batch: Batch) -> tuple[jax.Array, jax.Array]:
  nll_BT = optax.softmax_cross_entropy_with_integer_labels(
    logits_BTV.astype(jnp.float32), batch['targets']
  )
  weights_BT = batch['weights'].astype(jnp.float32)
  return jnp.sum(nll_BT * weights_BT), jnp.sum(weights_BT)


def eval_sums(
  params, batch: Batch, *, graphdef, collect_stats: bool = False
) -> dict[str, jax.Array]:
  """The sums `evaluate` adds up for one batch: nll, tokens, bytes and, with
  `collect_stats`, 'stats/<name>': each statistic's token-weighted sum."""
  model = nnx.merge(graphdef, params)
  weights_BT = batch['weights'].astype(jnp.float32)
  if collect_stats:
    logits_BTV, stats = model(
      batch['inputs'], collect_stats=True, stats_weights_BT=weights_BT
    )
  else:
    logits_BTV, stats = model(batch['inputs']), {}
  nll, tokens = _weighted_nll(logits_BTV, batch)
  # Without per-target byte counts, every weighted target is one byte (byte tokens).
  num_bytes = (
    jnp.sum(batch['bytes'].astype(jnp.float32) * (weights_BT > 0))
    if 'bytes' in batch
    else tokens
  )
  sums = {'nll': nll, 'tokens': tokens, 'bytes': num_bytes}
  sums.update({STATS_PREFIX + name: value * tokens for name, value in stats.items()})
  return sums


def metrics_from_sums(
  total_nll: float, total_weight: float, total_bytes: float | None = None
) -> dict[str, float]:
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
    'bits_per_byte': bits_per_byte(total_nll, total_bytes),
    'perplexity': math.exp(loss) if loss < 700 else math.inf,
  }


def evaluate(
  eval_fn: Callable[[Any, Batch], Mapping[str, jax.Array]],
  params,
  batches: Iterable[Batch],
  *,
  to_device: Callable[[Batch], Batch] | None = None,
  max_batches: int | None = None,
) -> dict[str, Any]:
  """Held-out metrics over every batch of `batches` (at most `max_batches`).

  `eval_fn(params, batch)` is `eval_sums`, jitted by the caller (sharded in training);
  `to_device` places a host batch (default: `jnp.asarray` on every array).
  Returns loss (nats per token), bits_per_byte, perplexity (per token), num_tokens
  (summed weights), num_bytes (summed text bytes), num_batches and, when `eval_fn`
  collects them, 'stats': the statistics (float64 arrays, means over the tokens) with
  their 'num_tokens'. The per-batch sums stay on device until the end (batches are
  dispatched ahead) and are added in float64 on the host.
  """
  to_device = to_device or functools.partial(jax.tree.map, jnp.asarray)
  per_batch = []
  for i, batch in enumerate(batches):
    if max_batches is not None and i >= max_batches:
      break
    per_batch.append(eval_fn(params, to_device(batch)))
  if not per_batch:
    raise ValueError('No evaluation batches.')
  totals = jax.tree.map(
    lambda *xs: sum(np.asarray(x, np.float64) for x in xs), *jax.device_get(per_batch)
  )
  num_tokens, num_bytes = float(totals['tokens']), float(totals['bytes'])
  result: dict[str, Any] = metrics_from_sums(float(totals['nll']), num_tokens, num_bytes)
  result.update(num_tokens=num_tokens, num_bytes=num_bytes, num_batches=len(per_batch))
  stats = {
    name[len(STATS_PREFIX) :]: value / num_tokens
    for name, value in totals.items()
    if name.startswith(STATS_PREFIX)
  }
  if stats:
    stats['num_tokens'] = np.asarray(num_tokens, np.float64)
    result['stats'] = stats
  return result


def evaluate_model(
  model: nnx.Module,
  batches: Iterable[Batch],
  *,
  collect_stats: bool = False,
  max_batches: int | None = None,
) -> dict[str, Any]:
  """`evaluate` for a model in memory on the default device (notebooks, tests)."""
  graphdef, params = nnx.split(model)
  eval_fn = jax.jit(
    functools.partial(eval_sums, graphdef=graphdef, collect_stats=collect_stats)
  )
  return evaluate(eval_fn, params, batches, max_batches=max_batches)
