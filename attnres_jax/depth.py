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


def depth_logits(
    sources_SBTD: jax.Array, query_D: jax.Array, gain_D: jax.Array, *, eps: float
) -> jax.Array:
  """logit_s = (query * gain) . RMSNorm(source_s), float32, shape [S, B, T]."""
  folded_query_D = (query_D.astype(jnp.float32) * gain_D.astype(jnp.float32))
  # Two reductions over D instead of materialising the normalised keys.
  dots_SBT = jnp.einsum(
      'sbtd,d->sbt', sources_SBTD, folded_query_D,
      preferred_element_type=jnp.float32,
  )
  return dots_SBT * rms_inverse(sources_SBTD, eps)


def valid_mask(num_sources: int, num_valid) -> jax.Array | None:
  """Boolean [S] mask of the first `num_valid` sources (None when all are valid)."""
  if num_valid is None:
    return None
  return jnp.arange(num_sources) < num_valid


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
  logits_SBT = depth_logits(sources_SBTD, query_D, gain_D, eps=eps)
  mask_S = valid_mask(sources_SBTD.shape[0], num_valid)
  if mask_S is not None:
    logits_SBT = jnp.where(mask_S[:, None, None], logits_SBT, -jnp.inf)
  weights_SBT = jax.nn.softmax(logits_SBT, axis=0)
  h_BTD = jnp.einsum(
      'sbt,sbtd->btd', weights_SBT, sources_SBTD,
      preferred_element_type=jnp.float32,
  )
  return h_BTD.astype(sources_SBTD.dtype), weights_SBT
