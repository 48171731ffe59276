"""Depth aggregation for Attention Residuals, as pure functions of arrays.

Everything here is the paper's method (arXiv 2603.15031, see README):

    logit_{i->l} = w_l . RMSNorm_g(v_i)      (no 1/sqrt(d), no temperature)
    alpha_{i->l} = softmax_i(logit_{i->l})
    h_l          = sum_i alpha_{i->l} v_i

computed in float32 whatever the dtype of the sources, with the key gain folded
into the query (w . (g * k) == (w * g) . k).

Block bookkeeping. Sublayers are numbered l = 0 .. L-1 (every attention and every MLP
is one). With S sublayers per block, the model keeps one buffer of N + 1 slots,
N = ceil(L / S): slot 0 holds the token embedding, slot n the (running) sum of the
outputs of block n. Sublayer l adds its output to slot `l // S + 1`, and reads the
first `num_valid_sources(l, S)` slots: the completed blocks, plus the running partial
sum of its own block unless it is the block's first sublayer. S = 1 is Full AttnRes
(slot i + 1 holds the raw output of sublayer i); S >= L leaves a single block.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp


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


def rms_inverse(x: jax.Array, eps: float) -> jax.Array:
  """1 / RMS(x) over the last axis, in float32."""
  x = x.astype(jnp.float32)
  return jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1) + eps)


def valid_mask(num_sources: int, num_valid) -> jax.Array | None:
  """Boolean [S] mask of the first `num_valid` sources (None when all are valid)."""
  if num_valid is None:
    return None
  return jnp.arange(num_sources) < num_valid


def _folded_query(query_D, gain_D):
  return query_D.astype(jnp.float32) * gain_D.astype(jnp.float32)


def _source_logits(sources_SBTD, folded_query_D, eps, inv_rms_SBT=None):
  """(dots, inverse RMS) per source, float32 [S, B, T]; logit = dot * inverse RMS.

  Two reductions over D instead of materialising the normalised keys. Contractions
  over the (small) source axis are written as multiply-and-reduce throughout: XLA
  fuses them into one pass over the buffer, where an einsum becomes a batched matmul
  of tiny matrices (2.2x slower for a [17, 8, 256, 256] read on CPU).
  """
  dots_SBT = jnp.sum(sources_SBTD.astype(jnp.float32) * folded_query_D, axis=-1)
  if inv_rms_SBT is None:
    inv_rms_SBT = rms_inverse(sources_SBTD, eps)
  return dots_SBT, inv_rms_SBT


def read_parts(buffer_SBTD, query_D, gain_D, *, eps, num_valid=None, partial_BTD=None,
               partial_valid=None, inv_rms_SBT=None):
  """The depth read over `buffer[:num_valid]` plus, optionally, one more source.

  The extra `partial_BTD` (a Block's running partial sum held outside the buffer)
  joins the same softmax when `partial_valid` (bool, may be traced) is true.
  `inv_rms_SBT`, the buffer's per-slot inverse RMS if already known, saves a pass.

  Returns (h_BTD in the buffer's dtype, statistics): the statistics are float32
  (weights [S (+1), B, T], dots, inverse RMS) that `read_parts_backward` reuses.
  """
  folded_query_D = _folded_query(query_D, gain_D)
  dots_SBT, inv_rms_SBT = _source_logits(buffer_SBTD, folded_query_D, eps, inv_rms_SBT)
  logits_SBT = dots_SBT * inv_rms_SBT
  mask_S = valid_mask(buffer_SBTD.shape[0], num_valid)
  if mask_S is not None:
    logits_SBT = jnp.where(mask_S[:, None, None], logits_SBT, -jnp.inf)
  if partial_BTD is not None:
    dots_1BT, inv_rms_1BT = _source_logits(partial_BTD[None], folded_query_D, eps)
    partial_logit_1BT = jnp.where(partial_valid, dots_1BT * inv_rms_1BT, -jnp.inf)
    logits_SBT = jnp.concatenate([logits_SBT, partial_logit_1BT])
    dots_SBT = jnp.concatenate([dots_SBT, dots_1BT])
    inv_rms_SBT = jnp.concatenate([inv_rms_SBT, inv_rms_1BT])
  weights_SBT = jax.nn.softmax(logits_SBT, axis=0)
  num_buffer = buffer_SBTD.shape[0]
  h_BTD = jnp.sum(weights_SBT[:num_buffer, ..., None]
                  * buffer_SBTD.astype(jnp.float32), axis=0)
  if partial_BTD is not None:
    h_BTD += weights_SBT[num_buffer][..., None] * partial_BTD.astype(jnp.float32)
  return h_BTD.astype(buffer_SBTD.dtype), (weights_SBT, dots_SBT, inv_rms_SBT)


def read_parts_backward(buffer_SBTD, query_D, gain_D, statistics, d_h_BTD,
                        partial_BTD=None):
  """The VJP of `read_parts` by hand, from its saved statistics.

  One fused expression per source tensor instead of autodiff's several buffer-sized
  temporaries (the backward pass of the AttnRes stack runs this once per sublayer).
  With u = query * gain, logit_s = inv_s (v_s . u), inv_s = (mean(v_s^2) + eps)^-1/2:

    dlogit_s = w_s (dh . v_s - sum_k w_k dh . v_k)
    dv_s     = w_s dh + dlogit_s (inv_s u - (v_s . u) inv_s^3 v_s / D)
    du       = sum_s dlogit_s inv_s v_s        (summed over tokens)

  Returns (d_buffer, d_partial or None, d_query, d_gain).
  """
  weights_SBT, dots_SBT, inv_rms_SBT = statistics
  folded_query_D = _folded_query(query_D, gain_D)
  d_h_BTD = d_h_BTD.astype(jnp.float32)
  dim = buffer_SBTD.shape[-1]
  num_buffer = buffer_SBTD.shape[0]
  sources = [(buffer_SBTD, slice(0, num_buffer))]
  if partial_BTD is not None:
    sources.append((partial_BTD[None], slice(num_buffer, num_buffer + 1)))
  value_grads_SBT = jnp.concatenate([
      jnp.sum(v.astype(jnp.float32) * d_h_BTD, axis=-1) for v, _ in sources])
  mean_grad_BT = jnp.sum(weights_SBT * value_grads_SBT, axis=0)
  d_logits_SBT = weights_SBT * (value_grads_SBT - mean_grad_BT)
  d_query_key_D = jnp.zeros_like(folded_query_D)
  d_sources = []
  for v, part in sources:
    w, dl, dots, inv = (x[part][..., None] for x in (
        weights_SBT, d_logits_SBT, dots_SBT, inv_rms_SBT))
    v32 = v.astype(jnp.float32)
    d_sources.append((w * d_h_BTD + dl * inv * folded_query_D
                      - (dl * dots * inv ** 3 / dim) * v32).astype(v.dtype))
    d_query_key_D += jnp.sum(dl * inv * v32, axis=(0, 1, 2))
  d_partial = d_sources[1][0] if partial_BTD is not None else None
  return (d_sources[0], d_partial, d_query_key_D * gain_D.astype(jnp.float32),
          d_query_key_D * query_D.astype(jnp.float32))


def attn_res_read(
    sources_SBTD: jax.Array,
    query_D: jax.Array,
    gain_D: jax.Array,
    *,
    eps: float,
    num_valid=None,
) -> tuple[jax.Array, jax.Array]:
  """One AttnRes depth read: softmax attention of one pseudo-query over depth sources.

  Args:
    sources_SBTD: the values v_s (raw sublayer outputs or block sums), any float dtype.
    query_D: the learned pseudo-query w_l.
    gain_D: the key RMSNorm gain g_l.
    eps: the key RMSNorm epsilon.
    num_valid: read only the first `num_valid` sources (int or traced int); the rest
      get weight exactly zero. None reads all of them.

  Returns:
    h_BTD: the weighted sum of the sources, cast back to the sources' dtype.
    weights_SBT: the float32 depth-attention weights (zero on invalid sources).
  """
  h_BTD, (weights_SBT, _, _) = read_parts(sources_SBTD, query_D, gain_D, eps=eps,
                                          num_valid=num_valid)
  return h_BTD, weights_SBT


# -- two-phase computation (paper, Algorithm 1) ---------------------------------------


def block_phase1(buffer_SBTD, queries_QD, gains_QD, *, eps, num_valid,
                 inv_rms_SBT=None):
  """Phase 1: all Q queries of a block against its completed sources at once.

  The sources `buffer[:num_valid]` are normalised once for the whole block and every
  query carries its own gain. Returns the float32 online-softmax statistics per query:
  max logit [Q, B, T], sum of exponentials [Q, B, T], unnormalised output [Q, B, T, D].
  """
  folded_QD = queries_QD.astype(jnp.float32) * gains_QD.astype(jnp.float32)
  if inv_rms_SBT is None:
    inv_rms_SBT = rms_inverse(buffer_SBTD, eps)
  logits_QSBT = jnp.einsum('sbtd,qd->qsbt', buffer_SBTD, folded_QD,
                           preferred_element_type=jnp.float32) * inv_rms_SBT
  mask_S = valid_mask(buffer_SBTD.shape[0], num_valid)
  if mask_S is not None:
    logits_QSBT = jnp.where(mask_S[None, :, None, None], logits_QSBT, -jnp.inf)
  max_QBT = jnp.max(logits_QSBT, axis=1)
  exp_QSBT = jnp.exp(logits_QSBT - max_QBT[:, None])
  out_QBTD = jnp.sum(exp_QSBT[..., None] * buffer_SBTD.astype(jnp.float32)[None],
                     axis=1)
  return max_QBT, jnp.sum(exp_QSBT, axis=1), out_QBTD


def block_phase2(phase1_stats, partial_BTD, query_D, gain_D, *, eps, partial_valid):
  """Phase 2: one sublayer merges its phase-1 statistics with the running partial sum
  of its block by online softmax. Returns h in the partial sum's dtype."""
  max_BT, sum_BT, out_BTD = phase1_stats
  dots_1BT, inv_rms_1BT = _source_logits(partial_BTD[None], _folded_query(query_D, gain_D),
                                         eps)
  partial_logit_BT = jnp.where(partial_valid, (dots_1BT * inv_rms_1BT)[0], -jnp.inf)
  new_max_BT = jnp.maximum(max_BT, partial_logit_BT)
  old_scale_BT = jnp.exp(max_BT - new_max_BT)
  partial_weight_BT = jnp.exp(partial_logit_BT - new_max_BT)  # 0 when not valid
  total_BT = sum_BT * old_scale_BT + partial_weight_BT
  h_BTD = (out_BTD * old_scale_BT[..., None]
           + partial_weight_BT[..., None] * partial_BTD.astype(jnp.float32))
  return (h_BTD / total_BT[..., None]).astype(partial_BTD.dtype)


# -- the paper's ablations (Section 5) as variants of the same read ------------------


def window_mask(num_sources: int, num_valid, window: int) -> jax.Array:
  """The embedding plus the last `window` valid sources (window 0: all valid ones)."""
  index_S = jnp.arange(num_sources)
  mask_S = index_S < num_valid
  if window:
    mask_S &= (index_S == 0) | (index_S >= num_valid - window)
  return mask_S


def attn_res_read_variant(
    sources_SBTD: jax.Array,
    query: jax.Array,
    gain_D: jax.Array,
    *,
    eps: float,
    num_valid,
    normalizer: str = 'softmax',
    key_norm: bool = True,
    window: int = 0,
    num_heads: int = 1,
    mixing_weights_S: jax.Array | None = None,
    inv_rms_SBT: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
  """The depth read with the paper's ablations; the defaults compute `attn_res_read`.

  Args:
    query: [D], or [B, T, D] for an input-dependent query.
    normalizer: 'softmax' over sources, or an independent 'sigmoid' per source.
    key_norm: False drops the key RMSNorm (logit = query . v).
    window: > 0 reads only the embedding and the last `window` valid sources.
    num_heads: > 1 splits the channels into groups, each with its own depth weights
      (and its own key RMSNorm over its channels).
    mixing_weights_S: DenseFormer-style learned scalars used directly as the weights
      (no query, no normalisation: input independent).
    inv_rms_SBT: the sources' inverse RMS when the caller keeps it (one head only).

  Returns (h_BTD, weights_SBT), the weights averaged over heads.
  """
  num_sources, batch, length, dim = sources_SBTD.shape
  mask_S = window_mask(num_sources, num_valid, window)
  values_SBTD = sources_SBTD.astype(jnp.float32)
  if mixing_weights_S is not None:
    weights_S = jnp.where(mask_S, mixing_weights_S.astype(jnp.float32), 0.0)
    h_BTD = jnp.sum(weights_S[:, None, None, None] * values_SBTD, axis=0)
    weights_SBT = jnp.broadcast_to(weights_S[:, None, None], (num_sources, batch, length))
    return h_BTD.astype(sources_SBTD.dtype), weights_SBT
  # With one head the channel axis stays whole: a trailing heads axis of size 1 makes
  # XLA:CPU's reductions several times slower.
  if num_heads == 1:
    split = lambda x: x
    merge = lambda x: x
  else:
    split = lambda x: x.reshape(*x.shape[:-1], num_heads, dim // num_heads)
    merge = lambda x: x.reshape(*x.shape[:-2], dim)
  values = split(values_SBTD)
  folded = split(query.astype(jnp.float32) * gain_D.astype(jnp.float32))
  logits = jnp.sum(values * folded, axis=-1)  # [S, B, T] or [S, B, T, H]
  if key_norm:
    if inv_rms_SBT is None or num_heads > 1:
      inv_rms_SBT = jax.lax.rsqrt(jnp.mean(jnp.square(values), axis=-1) + eps)
    logits *= inv_rms_SBT
  mask = mask_S.reshape((num_sources,) + (1,) * (logits.ndim - 1))
  if normalizer == 'softmax':
    weights = jax.nn.softmax(jnp.where(mask, logits, -jnp.inf), axis=0)
  else:
    weights = jnp.where(mask, jax.nn.sigmoid(logits), 0.0)
  h_BTD = merge(jnp.sum(weights[..., None] * values, axis=0))
  weights_SBT = weights if num_heads == 1 else jnp.mean(weights, axis=-1)
  return h_BTD.astype(sources_SBTD.dtype), weights_SBT
