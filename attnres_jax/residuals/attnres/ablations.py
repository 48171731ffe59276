"""The paper's ablations (Section 5) as variants of the depth read.

`attn_res_read_variant` with its defaults computes `depth.attn_res_read`; each option
changes one part of the read as the paper's ablation does. Shape letters as in
`depth.py`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from attnres_jax.nn.ops import lead


def window_mask(num_sources: int, num_valid, window: int) -> jax.Array:
  """The embedding plus the last `window` valid sources (window 0: all valid ones)."""
  index_K = jnp.arange(num_sources)
  mask_K = index_K < num_valid
  if window:
    mask_K &= (index_K == 0) | (index_K >= num_valid - window)
  return mask_K


def attn_res_read_variant(
  sources_KBTD: jax.Array,
  query: jax.Array,
  gain_D: jax.Array,
  *,
  eps: float,
  num_valid,
  normalizer: str = 'softmax',
  key_norm: bool = True,
  window: int = 0,
  num_heads: int = 1,
  mixing_weights_K: jax.Array | None = None,
  inv_rms_KBT: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
  """The depth read with the paper's ablations; the defaults compute `attn_res_read`.

  Args:
    query: [D], or [B, T, D] for an input-dependent query.
    normalizer: 'softmax' over sources, or an independent 'sigmoid' per source.
    key_norm: False drops the key RMSNorm (logit = query . v).
    window: > 0 reads only the embedding and the last `window` valid sources.
    num_heads: > 1 splits the channels into groups, each with its own depth weights
      (and its own key RMSNorm over its channels).
    mixing_weights_K: DenseFormer-style learned scalars used directly as the weights
      (no query, no normalisation: input independent).
    inv_rms_KBT: the sources' inverse RMS when the caller keeps it (one head only).

  Returns (h_BTD, weights_KBT), the weights averaged over heads.
  """
  num_sources, batch, length, dim = sources_KBTD.shape
  mask_K = window_mask(num_sources, num_valid, window)
  values_KBTD = sources_KBTD.astype(jnp.float32)
  if mixing_weights_K is not None:
    weights_K = jnp.where(mask_K, mixing_weights_K.astype(jnp.float32), 0.0)
    h_BTD = jnp.sum(weights_K[:, None, None, None] * values_KBTD, axis=0)
    weights_KBT = jnp.broadcast_to(weights_K[:, None, None], (num_sources, batch, length))
    return h_BTD.astype(sources_KBTD.dtype), weights_KBT
  # With one head the channel axis stays whole: a trailing heads axis of size 1 makes
  # XLA:CPU's reductions several times slower.
  if num_heads == 1:
    split = lambda x: x
    merge = lambda x: x
  else:
    split = lambda x: x.reshape(*x.shape[:-1], num_heads, dim // num_heads)
    merge = lambda x: x.reshape(*x.shape[:-2], dim)
  values = split(values_KBTD)
  query = query.astype(jnp.float32)
  folded = split(query * lead(gain_D.astype(jnp.float32), query.ndim))
  logits = jnp.sum(values * lead(folded, values.ndim), axis=-1)  # [K, B, T(, heads)]
  if key_norm:
    if inv_rms_KBT is None or num_heads > 1:
      inv_rms_KBT = jax.lax.rsqrt(jnp.mean(jnp.square(values), axis=-1) + eps)
    logits *= inv_rms_KBT
  mask = mask_K.reshape((num_sources,) + (1,) * (logits.ndim - 1))
  if normalizer == 'softmax':
    weights = jax.nn.softmax(jnp.where(mask, logits, -jnp.inf), axis=0)
  else:
    weights = jnp.where(mask, jax.nn.sigmoid(logits), 0.0)
  h_BTD = merge(jnp.sum(weights[..., None] * values, axis=0))
  weights_KBT = weights if num_heads == 1 else jnp.mean(weights, axis=-1)
  return h_BTD.astype(sources_KBTD.dtype), weights_KBT
