"""The two-phase read of a schedule segment (`docs/method.md`): Phase 1 reads the
slots completed before the segment once for all its queries, Phase 2 merges each
sublayer's Phase 1 statistics with the segment's own slots; and the final read.
Phase 1 and the final read run through the Pallas kernel (`kernels/depth_pallas.py`)
or XLA (`depth.py`), as `choices.phase1_kernel` picks. `residual` is an
`AttnResResidual`.
"""

from __future__ import annotations

import jax.numpy as jnp

from attnres_jax.kernels import depth_pallas
from attnres_jax.nn import sharding
from attnres_jax.residuals.attnres import choices
from attnres_jax.residuals.attnres import depth


def segment_queries(residual, params, num_layers):
  """The segment's queries and gains, [Q, D] in sublayer order, whole on every
  device (tiny: otherwise a sharded model dimension makes Phase 1 all-reduce its
  [Q, K, B, T] logits instead)."""
  d, n = residual.cfg.d_model, residual.sublayers_per_layer
  whole = lambda x: sharding.constrain(x[...].reshape(n * num_layers, d), (None, None))
  return whole(params.query), whole(params.gain)


def phase1(residual, buffer_KBTD, params, first, inv_rms_KBT=None, kept=None):
  """Phase 1 of a segment (its layers' stacked `params`) against the slots before
  `first`: a list over its G layers of (attention, MLP) pairs of `depth.phase1`'s
  per-query statistics, kept apart (no [G, n, ...] stacks to write and read).
  `kept` (the Phase 1 kernel only): that list as an earlier call on the same
  operands returned it, returned again without rerunning the forward kernel."""
  num_layers = params.query.shape[0]
  queries_QD, gains_QD = segment_queries(residual, params, num_layers)
  if residual.kernel == 'pallas':
    flat = None if kept is None else [stats for layer in kept for stats in layer]
    read, prefixes = depth_pallas.phase1, {'kept': flat}
  else:
    read, prefixes = depth.phase1, {'prefixes': choices.phase1_prefixes(residual)}
  stats = read(
    buffer_KBTD,
    queries_QD,
    gains_QD,
    eps=residual.cfg.attn_res_eps,
    num_valid=first,
    inv_rms_KBT=inv_rms_KBT,
    out_dtype=residual.phase1_dtype,
    **prefixes,
  )
  n = residual.sublayers_per_layer
  return [stats[n * j : n * j + n] for j in range(num_layers)]


def merge(
  residual,
  phase1_stats,
  local_JBTD,
  query_D,
  gain_D,
  layer_in_segment,
  which,
  first,
  embedding_BTD,
  local_inv_rms_JBT=None,
  num_local=None,
):
  """Phase 2 of one sublayer: its Phase 1 statistics merged with the local slots it
  reads (`local_JBTD`: the segment's J slots, or where `num_local` gives J, the ones
  it reads alone, None if none). The model's first sublayer reads the embedding
  alone, whatever its query: it takes it as is, so that its query's gradient is
  exactly zero (through the online softmax it would be two float32 terms that cancel
  only to a few ulps)."""
  _, num_valid = residual.local_index(layer_in_segment, which)
  if num_valid:
    valid_J = jnp.arange(local_JBTD.shape[0]) < num_valid
    h_BTD = depth.phase2(
      phase1_stats,
      local_JBTD,
      valid_J,
      query_D,
      gain_D,
      eps=residual.cfg.attn_res_eps,
      local_inv_rms_JBT=local_inv_rms_JBT,
      num_written=num_valid,
      num_local=num_local,
    )
  else:  # a segment's first sublayer: no local slot to merge
    h_BTD = depth.phase1_read(phase1_stats, embedding_BTD.dtype)
  if layer_in_segment == 0 and which == 0:
    h_BTD = jnp.where(first == 1, embedding_BTD, h_BTD)
  return residual.to_compute(h_BTD)


def final_read_with_kernel(residual, buffer_KBTD, params):
  """The final read through the Phase 1 kernel (one query, every slot): one pass
  over the buffer, and a backward that writes the buffer's cotangent in the layout
  the backward pass carries it (XLA's read swept the buffer twice and its cotangent
  was relayouted: bench/aot.py d1024 v5p:2x2x1 data, full/bf16/pallas 50.68 -> 49.93
  ms)."""
  ((_, sum_BT, out_BTD),) = depth_pallas.phase1(
    buffer_KBTD,
    params.query[...][None],
    params.gain[...][None],
    eps=residual.cfg.attn_res_eps,
    num_valid=residual.num_slots,
    width_minor_cotangent=True,
  )
  return depth.phase1_read((None, sum_BT, out_BTD), buffer_KBTD.dtype)
