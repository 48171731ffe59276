"""Depth aggregation for Attention Residuals, as pure functions of arrays.

Everything here is the paper's method (arXiv 2603.15031; `docs/method.md`):

    logit_{i->l} = w_l . RMSNorm_g(v_i)      (no 1/sqrt(d), no temperature)
    alpha_{i->l} = softmax_i(logit_{i->l})
    h_l          = sum_i alpha_{i->l} v_i

computed in float32 whatever the dtype of the sources, with the key gain folded
into the query (w . (g * k) == (w * g) . k).

Block bookkeeping. Sublayers are numbered l = 0 .. L-1 (every attention and every MLP
is one). With `block_size` sublayers per block, the model keeps one buffer of
num_blocks + 1 slots: slot 0 holds the token embedding, slot n the (running) sum of the
outputs of block n. Sublayer l adds its output to slot `l // block_size + 1`, and reads
the first `num_valid_sources(l, block_size)` slots: the completed blocks, plus the
running partial sum of its own block unless it is the block's first sublayer.
block_size = 1 is Full AttnRes (slot i + 1 holds the raw output of sublayer i);
block_size >= L leaves a single block.

Shape letters, used in array-name suffixes throughout the package:
  B batch, T tokens (length), D model width, V vocabulary,
  N attention heads, H attention head width (models/transformer.py),
  K depth sources (slots of the depth buffer: num_blocks + 1),
  Q depth queries read together in Phase 1 (the sublayers of one schedule segment),
  J local slots (the depth slots written inside one schedule segment),
  L layers, G layers of one schedule segment.
Scalar counts are spelled out (block_size, num_blocks), never a bare letter.

The backward rules of the reads whose VJP is written out live in `depth_vjp.py`, the
paper's ablations of the read in `ablations.py`; `method.py` states the same method
in a few lines of plain jnp, the reference every read here is tested against.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from attnres_jax.nn.ops import lead, rms_inverse
from attnres_jax.residuals.attnres import depth_vjp
from attnres_jax.residuals.attnres.ablations import (  # the read's variants, re-exported
  attn_res_read_variant as attn_res_read_variant,
)


def num_blocks(num_sublayers: int, block_size: int) -> int:
  """N: the number of (possibly partial) blocks of `block_size` sublayers."""
  return math.ceil(num_sublayers / block_size)


def num_slots(num_sublayers: int, block_size: int) -> int:
  """Buffer slots: the embedding plus one per block."""
  return num_blocks(num_sublayers, block_size) + 1


def output_slot(sublayer, block_size: int):
  """The buffer slot that sublayer `sublayer` (0-based) adds its output to."""
  return sublayer // block_size + 1


def num_valid_sources(sublayer, block_size: int):
  """How many leading buffer slots sublayer `sublayer` reads.

  The completed blocks b_0 .. b_{n-1} (b_0 = embedding), plus the partial sum of its
  own block when it is not the block's first sublayer. Works on ints and traced ints.
  """
  completed = sublayer // block_size + 1
  return completed + (sublayer % block_size != 0)


def valid_mask(num_sources: int, num_valid) -> jax.Array | None:
  """Boolean [K] mask of the first `num_valid` sources (None when all are valid)."""
  if num_valid is None:
    return None
  return jnp.arange(num_sources) < num_valid


def _folded_query(query_D, gain_D):
  return query_D.astype(jnp.float32) * gain_D.astype(jnp.float32)


def _source_logits(sources_KBTD, folded_query_D, eps, inv_rms_KBT=None):
  """(dots, inverse RMS) per source, float32 [K, B, T]; logit = dot * inverse RMS.

  Two reductions over D instead of materialising the normalised keys. Contractions
  over the (small) source axis are written as multiply-and-reduce throughout: XLA
  fuses them into one pass over the buffer, where an einsum becomes a batched matmul
  of tiny matrices (2.2x slower for a [17, 8, 256, 256] read on CPU).
  """
  dots_KBT = jnp.sum(
    sources_KBTD.astype(jnp.float32) * lead(folded_query_D, sources_KBTD.ndim), axis=-1
  )
  if inv_rms_KBT is None:
    inv_rms_KBT = rms_inverse(sources_KBTD, eps)
  return dots_KBT, inv_rms_KBT


def read_parts(buffer_KBTD, query_D, gain_D, *, eps, num_valid=None, inv_rms_KBT=None):
  """The one-shot depth read over `buffer[:num_valid]`.

  `inv_rms_KBT`, the buffer's per-slot inverse RMS if already known, saves a pass.
  Returns (h_BTD in the buffer's dtype, float32 statistics: weights [K, B, T], dots,
  inverse RMS).
  """
  folded_query_D = _folded_query(query_D, gain_D)
  dots_KBT, inv_rms_KBT = _source_logits(buffer_KBTD, folded_query_D, eps, inv_rms_KBT)
  logits_KBT = dots_KBT * inv_rms_KBT
  mask_K = valid_mask(buffer_KBTD.shape[0], num_valid)
  if mask_K is not None:
    logits_KBT = jnp.where(mask_K[:, None, None], logits_KBT, -jnp.inf)
  weights_KBT = jax.nn.softmax(logits_KBT, axis=0)
  h_BTD = jnp.sum(weights_KBT[..., None] * buffer_KBTD.astype(jnp.float32), axis=0)
  return h_BTD.astype(buffer_KBTD.dtype), (weights_KBT, dots_KBT, inv_rms_KBT)


def attn_res_read(
  sources_KBTD: jax.Array,
  query_D: jax.Array,
  gain_D: jax.Array,
  *,
  eps: float,
  num_valid=None,
) -> tuple[jax.Array, jax.Array]:
  """One AttnRes depth read: softmax attention of one pseudo-query over depth sources.

  Args:
    sources_KBTD: the values v_s (raw sublayer outputs or block sums), any float dtype.
    query_D: the learned pseudo-query w_l.
    gain_D: the key RMSNorm gain g_l.
    eps: the key RMSNorm epsilon.
    num_valid: read only the first `num_valid` sources (int or traced int); the rest
      get weight exactly zero. None reads all of them.

  Returns:
    h_BTD: the weighted sum of the sources, cast back to the sources' dtype.
    weights_KBT: the float32 depth-attention weights (zero on invalid sources).
  """
  h_BTD, (weights_KBT, _, _) = read_parts(
    sources_KBTD, query_D, gain_D, eps=eps, num_valid=num_valid
  )
  return h_BTD, weights_KBT


# -- two-phase computation (paper, Algorithm 1) ---------------------------------------
#
# The queries of a block are parameters, known before the block runs. Phase 1 reads
# the completed sources once for all of them; Phase 2 merges, per sublayer, the few
# sources written since (the running partial sum, and for Full the segment's earlier
# outputs) by online softmax. The result equals the one-shot read over all sources.
# The running maxima are stop-gradient: the read is invariant to them, so gradients
# through them cancel exactly and need not be computed.


def phase1(
  buffer_KBTD,
  queries_QD,
  gains_QD,
  *,
  eps,
  num_valid,
  inv_rms_KBT=None,
  out_dtype=jnp.float32,
  prefixes=None,
):
  """Phase 1: all Q queries against the first `num_valid` sources at once.

  The sources are normalised once for all queries and every query carries its own
  gain. Returns, per query, its online-softmax statistics (max logit [B, T], sum of
  exponentials [B, T], both float32; the unnormalised output [B, T, D] accumulated in
  float32 and stored in `out_dtype`: bfloat16 halves its traffic, with float32's range
  and the stored buffer's rounding, 2^-9 relative), a tuple of Q such tuples. The
  outputs stay apart: stacked, they (and their cotangents) would be written once more
  to a [Q, B, T, D] array and read back by each query's Phase 2.

  What is read: for a Python-int `num_valid`, the valid slots alone (a static slice).
  For a traced one, the whole buffer, masked, unless `prefixes` (static, ascending,
  the last the whole buffer) are given: then the shortest prefix that holds the valid
  slots, picked by `lax.switch` (`depth_vjp.prefix_read`). The masked read costs every
  slot a pass over D, written or not, and an early segment of a deep Full model has
  only a few of its 65 slots written.
  """
  folded_QD = queries_QD.astype(jnp.float32) * gains_QD.astype(jnp.float32)
  num_sources = buffer_KBTD.shape[0]
  if num_valid is not None and not isinstance(num_valid, jax.Array):
    length = min(int(num_valid), num_sources)  # static: the valid slots alone
    given = None if inv_rms_KBT is None else inv_rms_KBT[:length]
    return _phase1_stats(
      buffer_KBTD[:length], folded_QD, given, None, eps=eps, out_dtype=out_dtype
    )[0]
  if prefixes is None or num_valid is None or tuple(prefixes) == (num_sources,):
    return _phase1_stats(
      buffer_KBTD, folded_QD, inv_rms_KBT, num_valid, eps=eps, out_dtype=out_dtype
    )[0]
  prefixes = tuple(int(n) for n in prefixes)
  if list(prefixes) != sorted(set(prefixes)) or prefixes[0] < 1:
    raise ValueError(f'prefixes must be ascending positive lengths, got {prefixes}.')
  if prefixes[-1] != num_sources:  # then every num_valid has a branch
    raise ValueError(f'The last prefix must be the whole buffer ({num_sources} slots).')
  return _read_prefix(
    buffer_KBTD,
    folded_QD,
    inv_rms_KBT,
    num_valid,
    prefixes,
    float(eps),
    jnp.dtype(out_dtype),
  )


def _phase1_stats(buffer_KBTD, folded_QD, inv_rms_KBT, num_valid, *, eps, out_dtype):
  """Phase 1 over the whole of `buffer_KBTD` (masked past a traced `num_valid`):
  (per-query statistics as `phase1` returns them, (exponentials [Q, K, B, T], dots
  [Q, K, B, T], inverse RMS [K, B, T]) for a written-out backward)."""
  if inv_rms_KBT is None:
    inv_rms_KBT = rms_inverse(buffer_KBTD, eps)
  dots_QKBT = jnp.einsum(
    'kbtd,qd->qkbt', buffer_KBTD, folded_QD, preferred_element_type=jnp.float32
  )
  logits_QKBT = dots_QKBT * inv_rms_KBT[None]
  mask_K = valid_mask(buffer_KBTD.shape[0], num_valid)
  if mask_K is not None:
    logits_QKBT = jnp.where(mask_K[None, :, None, None], logits_QKBT, -jnp.inf)
  max_QBT = jax.lax.stop_gradient(jnp.max(logits_QKBT, axis=1))
  exp_QKBT = jnp.exp(logits_QKBT - max_QBT[:, None])
  sum_QBT = jnp.sum(exp_QKBT, axis=1)
  # A contraction, not multiply-and-reduce: XLA:CPU materialises the [Q, K, B, T, D]
  # product of the latter (and of its gradient) when Q > 1. One contraction per query:
  # batched over (b, t), one 'qkbt,kbtd->qbtd' contraction comes out as [B, T, Q, D],
  # and the TPU compiler copies it to [Q, B, T, D] forward and backward (float32);
  # each query's own contraction comes out in its consumer's layout.
  stats = tuple(
    (
      max_QBT[q],
      sum_QBT[q],
      jnp.einsum(
        'kbt,kbtd->btd', exp_QKBT[q], buffer_KBTD, preferred_element_type=jnp.float32
      ).astype(out_dtype),
    )
    for q in range(folded_QD.shape[0])
  )
  return stats, (exp_QKBT, dots_QKBT, inv_rms_KBT)


# Phase 1 over the shortest static prefix that holds the valid slots, with its VJP
# written out (`depth_vjp.prefix_read` builds it around the Phase 1 above).
_read_prefix = depth_vjp.prefix_read(_phase1_stats)


def phase2(
  phase1_stats,
  local_JBTD,
  valid_J,
  query_D,
  gain_D,
  *,
  eps,
  local_inv_rms_JBT=None,
  num_written=None,
  num_local=None,
):
  """Phase 2: one sublayer merges its Phase 1 statistics with the J local sources
  (those of `valid_J` only) by online softmax. Returns h in the local sources' dtype.
  `num_local` (static): J, where `local_JBTD` holds only the first slots (those read);
  the merge is chosen as for J.
  `num_written` (static): only the first local slots can be valid, and the merge's
  forward reduces over those alone (Full's sublayers read 1 to J - 1 of a segment's J
  slots; masked, each empty slot still cost a pass over D: bench/aot.py d1024
  v5p:2x2x1, full/pallas 55.94 -> 55.27 ms, temp unchanged).

  At least one source must be valid across both phases (Phase 1 always has the
  embedding). With several local sources (Full) the VJP is written out
  (`depth_vjp.merge_bwd`): autodiff of the merge left the TPU compiler float32
  [B, T, D] intermediates to write and read back (`bench/aot.py`, d1024 v5p:2x2x1,
  full/pallas: 111.4 -> 109.8 GB a step). With one (Block) autodiff's fuses as well
  or better (block:4/pallas 91.03 vs 91.09 GB, block:8/pallas 90.89 vs 91.0 GB), so
  it stays.
  """
  max_BT, sum_BT, out_BTD = phase1_stats
  folded_D = _folded_query(query_D, gain_D)
  if (num_local or local_JBTD.shape[0]) > 1:
    written = local_JBTD.shape[0] if num_written is None else num_written
    return _merge(
      *phase1_stats, local_JBTD, valid_J, folded_D, local_inv_rms_JBT, float(eps), written
    )
  old_scale_BT, local_weights_JBT, _, _, total_BT = _online_softmax_step(
    max_BT, sum_BT, local_JBTD, valid_J, folded_D, local_inv_rms_JBT, eps
  )
  h_BTD = out_BTD.astype(jnp.float32) * old_scale_BT[..., None] + slot_sum(
    local_weights_JBT, local_JBTD
  )
  return (h_BTD / total_BT[..., None]).astype(local_JBTD.dtype)


def slot_sum(weights_JBT, slots_JBTD):
  """sum_j weights_j slots_j, float32 [B, T, D], as J scaled adds (J: a segment's few
  local slots). Elementwise, XLA fuses it into the merge that consumes it; written as
  a reduction over the slot axis, the TPU compiler gave it a fusion of its own whose
  float32 [B, T, D] result went through memory once per sublayer."""
  total_BTD = weights_JBT[0][..., None] * slots_JBTD[0].astype(jnp.float32)
  for j in range(1, slots_JBTD.shape[0]):
    total_BTD += weights_JBT[j][..., None] * slots_JBTD[j].astype(jnp.float32)
  return total_BTD


def phase1_read(phase1_stats, dtype):
  """Phase 2 with no valid local source: Phase 1's read as it stands (out / sum),
  the value `phase2` gives then (no local weight, the old scale exactly one)."""
  _, sum_BT, out_BTD = phase1_stats
  return (out_BTD.astype(jnp.float32) / sum_BT[..., None]).astype(dtype)


def _online_softmax_step(
  max_BT, sum_BT, local_JBTD, valid_J, folded_D, local_inv_rms_JBT, eps
):
  """One online-softmax step over the local sources, per token: the old statistics'
  scale s = exp(m - m') (m' the new maximum, stop-gradient), each local source's
  unnormalised weight w_j = exp(logit_j - m') (0 where not valid), its dot and inverse
  RMS, and the new total s * sum + sum_j w_j."""
  dots_JBT, inv_rms_JBT = _source_logits(local_JBTD, folded_D, eps, local_inv_rms_JBT)
  logits_JBT = jnp.where(valid_J[:, None, None], dots_JBT * inv_rms_JBT, -jnp.inf)
  new_max_BT = jax.lax.stop_gradient(jnp.maximum(max_BT, jnp.max(logits_JBT, axis=0)))
  old_scale_BT = jnp.exp(max_BT - new_max_BT)
  local_weights_JBT = jnp.exp(logits_JBT - new_max_BT[None])
  total_BT = sum_BT * old_scale_BT + jnp.sum(local_weights_JBT, axis=0)
  return old_scale_BT, local_weights_JBT, dots_JBT, inv_rms_JBT, total_BT


def _merge_parts(max_BT, sum_BT, local_JBTD, valid_J, folded_D, local_inv_rms_JBT, eps):
  """Per token: the old statistics' scale c = s / total (s = exp(m - m')), each local
  source's weight alpha_j = w_j / total, its dot and inverse RMS, and the total."""
  scale_BT, weights_JBT, dots_JBT, inv_rms_JBT, total_BT = _online_softmax_step(
    max_BT, sum_BT, local_JBTD, valid_J, folded_D, local_inv_rms_JBT, eps
  )
  inv_total_BT = 1 / total_BT
  return (
    scale_BT * inv_total_BT,
    weights_JBT * inv_total_BT[None],
    dots_JBT,
    inv_rms_JBT,
    total_BT,
  )


def _written(num_written, local_JBTD, local_inv_rms_JBT):
  """The first `num_written` local slots and their given inverse RMS (or None)."""
  if local_inv_rms_JBT is not None:
    local_inv_rms_JBT = local_inv_rms_JBT[:num_written]
  return local_JBTD[:num_written], local_inv_rms_JBT


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8))
def _merge(*args):
  """h of `_merge_fwd`'s arguments (eps and num_written static)."""
  return _merge_fwd(*args)[0]


def _merge_fwd(
  max_BT,
  sum_BT,
  out_BTD,
  local_JBTD,
  valid_J,
  folded_D,
  local_inv_rms_JBT,
  eps,
  num_written,
):
  # Only the written slots enter the reductions. The slots are kept whole for the
  # backward pass (a kept slice is a copy), which runs over all J with the per-token
  # values zero-padded: reducing over the written slots there too, or padding its
  # [J, B, T, D] result, took more temporary memory (bench/aot.py, full/pallas).
  written_NBTD, written_inv_rms_NBT = _written(num_written, local_JBTD, local_inv_rms_JBT)
  scale_BT, alpha_JBT, dots_JBT, inv_rms_JBT, total_BT = _merge_parts(
    max_BT,
    sum_BT,
    written_NBTD,
    valid_J[:num_written],
    folded_D,
    written_inv_rms_NBT,
    eps,
  )
  h_BTD = out_BTD.astype(jnp.float32) * scale_BT[..., None] + slot_sum(
    alpha_JBT, written_NBTD
  )
  saved = (sum_BT, out_BTD, local_JBTD, folded_D, local_inv_rms_JBT)
  return h_BTD.astype(local_JBTD.dtype), saved + (
    scale_BT,
    alpha_JBT,
    dots_JBT,
    inv_rms_JBT,
    total_BT,
  )


_merge.defvjp(_merge_fwd, depth_vjp.merge_bwd)
