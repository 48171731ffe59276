"""Attention Residuals (arXiv 2603.15031), the method as the paper states it.

Read this module first. It is the whole method in plain jnp: Python lists of sources,
one loop over the sublayers, no buffer, no scan, no hand-written gradient. The rest of
the package computes the same numbers faster (`depth.py`: the reads on a buffer of
slots; `schedule.py` and `residual.py`: the block schedule inside the layer scan;
`backward.py`: a backward pass whose memory is linear in depth; the Pallas kernel in
`attnres_jax/kernels/`), and `tests/residuals/test_method.py` checks each of them
against this module.

A PreNorm Transformer is a stack of L sublayers f_0 .. f_{L-1} (every attention and
every MLP is one, each with its RMSNorm inside). A standard residual feeds sublayer l
with h_l = v_0 + sum_{i<l} f_i(h_i). AttnRes feeds it a softmax-weighted sum of
*sources* instead, with a learned pseudo-query w_l and key gain g_l per read:

    logit_i = w_l . RMSNorm_{g_l}(v_i)      (no 1/sqrt(d), no temperature)
    h_l     = sum_i softmax_i(logit_i) v_i

Full AttnRes reads the embedding and every earlier sublayer output; Block AttnRes
reads block sums. A final read (its own query and gain) feeds the final norm and the
head. The queries start at zero, so at initialisation every read is a mean.

Shapes: B batch, T tokens, D width, K sources of one read, Q queries of one block,
J sources written since its Phase 1, R reads of a model (its L sublayers, then the
final read).
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax
import jax.numpy as jnp

Sublayer = Callable[[jax.Array], jax.Array]  # f_l: h_BTD -> v_BTD


# -- the one-shot read ----------------------------------------------------------------


def rms_norm(v_BTD, gain_D, eps):
  """RMSNorm_g(v) = g * v / sqrt(mean(v^2) + eps), in float32."""
  v_BTD = v_BTD.astype(jnp.float32)
  inv_rms_BT1 = jax.lax.rsqrt(jnp.mean(v_BTD * v_BTD, axis=-1, keepdims=True) + eps)
  return gain_D.astype(jnp.float32)[None, None] * v_BTD * inv_rms_BT1


def logits(sources, query_D, gain_D, eps):
  """logit_i = w . RMSNorm_g(v_i) for each source v_i: float32 [K, B, T]."""
  query_11D = query_D.astype(jnp.float32)[None, None]
  return jnp.stack([jnp.sum(query_11D * rms_norm(v, gain_D, eps), -1) for v in sources])


def weighted_sum(weights_KBT, sources):
  """sum_i weights_i v_i in float32."""
  return sum(
    w_BT[..., None] * v_BTD.astype(jnp.float32)
    for w_BT, v_BTD in zip(weights_KBT, sources)
  )


def read(sources, query_D, gain_D, *, eps):
  """The AttnRes read h = sum_i softmax_i(w . RMSNorm_g(v_i)) v_i of a list of [B, T, D]
  sources: float32 arithmetic whatever their dtype, the result cast back to it."""
  weights_KBT = jax.nn.softmax(logits(sources, query_D, gain_D, eps), axis=0)
  return weighted_sum(weights_KBT, sources).astype(sources[0].dtype)


# -- Full and Block AttnRes: which sources each read sees -----------------------------


def full_attnres(
  sublayers: Sequence[Sublayer], embedding_BTD, queries_RD, gains_RD, *, eps
):
  """Full AttnRes: sublayer l reads [v_0, v_1, .., v_l], the embedding v_0 and the raw
  outputs v_{i+1} = f_i(h_i) of every earlier sublayer; the final read reads all of
  them. Row l of `queries_RD` and `gains_RD` is sublayer l's read, row L the final
  read's. Returns the final read's h (for the final norm and the head)."""
  sources = [embedding_BTD]
  for l, sublayer in enumerate(sublayers):
    h_BTD = read(sources, queries_RD[l], gains_RD[l], eps=eps)
    sources.append(sublayer(h_BTD))
  return read(sources, queries_RD[-1], gains_RD[-1], eps=eps)


def block_attnres(
  sublayers: Sequence[Sublayer], embedding_BTD, queries_RD, gains_RD, *, block_size, eps
):
  """Block AttnRes: the sublayers form blocks of `block_size` consecutive ones (the
  last may be shorter). The sources are b_0 = the embedding, the sums b_1 .. b_{n-1}
  of the completed blocks, and the partial sum b_n^i of the current block's first i
  outputs, which the block's first sublayer (l % block_size == 0) does not have yet.
  The final read sees every block, the last as it stands. `block_size=1` is Full
  AttnRes; `block_size >= L` leaves one block. Arguments as `full_attnres`."""
  blocks, partial_BTD = [embedding_BTD], None
  for l, sublayer in enumerate(sublayers):
    if l > 0 and l % block_size == 0:  # a block boundary: the partial sum is b_n
      blocks, partial_BTD = blocks + [partial_BTD], None
    sources = blocks if partial_BTD is None else blocks + [partial_BTD]
    v_BTD = sublayer(read(sources, queries_RD[l], gains_RD[l], eps=eps))
    partial_BTD = v_BTD if partial_BTD is None else partial_BTD + v_BTD
  return read(blocks + [partial_BTD], queries_RD[-1], gains_RD[-1], eps=eps)


# -- the two-phase block schedule (the paper's Algorithm 1) ---------------------------
#
# The queries are parameters, known before a block runs, so the completed blocks can
# be read once for all of a block's queries (Phase 1), keeping each query's softmax
# unnormalised; each sublayer then adds the one source written since, its block's
# partial sum, by online softmax (Phase 2). The result is the one-shot read.


def phase1(completed, queries_QD, gains_QD, *, eps):
  """Every query of a block against the completed sources. Per query, float32: the
  maximum logit m [B, T], the sum of exponentials s = sum_i e^{logit_i - m} [B, T] and
  the unnormalised output o = sum_i e^{logit_i - m} v_i [B, T, D]."""
  stats = []
  for query_D, gain_D in zip(queries_QD, gains_QD):
    logits_KBT = logits(completed, query_D, gain_D, eps)
    max_BT = jnp.max(logits_KBT, axis=0)
    exp_KBT = jnp.exp(logits_KBT - max_BT[None])
    stats.append((max_BT, jnp.sum(exp_KBT, axis=0), weighted_sum(exp_KBT, completed)))
  return stats


def phase2(stats, new_sources, query_D, gain_D, *, eps, dtype):
  """One sublayer's read: its Phase 1 statistics (m, s, o) merged with the sources
  written since (none, or the partial sum) by online softmax. With m' the new maximum:

      h = (o e^{m - m'} + sum_j e^{logit_j - m'} v_j)
          / (s e^{m - m'} + sum_j e^{logit_j - m'})
  """
  max_BT, sum_BT, out_BTD = stats
  if not new_sources:
    return (out_BTD / sum_BT[..., None]).astype(dtype)
  logits_JBT = logits(new_sources, query_D, gain_D, eps)
  new_max_BT = jnp.maximum(max_BT, jnp.max(logits_JBT, axis=0))
  old_scale_BT = jnp.exp(max_BT - new_max_BT)
  exp_JBT = jnp.exp(logits_JBT - new_max_BT[None])
  total_BT = sum_BT * old_scale_BT + jnp.sum(exp_JBT, axis=0)
  h_BTD = out_BTD * old_scale_BT[..., None] + weighted_sum(exp_JBT, new_sources)
  return (h_BTD / total_BT[..., None]).astype(dtype)


def block_attnres_two_phase(
  sublayers: Sequence[Sublayer], embedding_BTD, queries_RD, gains_RD, *, block_size, eps
):
  """`block_attnres` computed by the two-phase schedule: Phase 1 once per block over
  the completed blocks, for all of the block's queries; Phase 2 per sublayer."""
  blocks, partial_BTD = [embedding_BTD], None
  num_sublayers = len(sublayers)
  for l, sublayer in enumerate(sublayers):
    position = l % block_size
    if position == 0:  # a new block: b_n completes, and Phase 1 reads b_0 .. b_{n-1}
      if l > 0:
        blocks, partial_BTD = blocks + [partial_BTD], None
      block_end = min(l + block_size, num_sublayers)
      block_stats = phase1(
        blocks, queries_RD[l:block_end], gains_RD[l:block_end], eps=eps
      )
    new_sources = [] if partial_BTD is None else [partial_BTD]
    h_BTD = phase2(
      block_stats[position],
      new_sources,
      queries_RD[l],
      gains_RD[l],
      eps=eps,
      dtype=embedding_BTD.dtype,
    )
    v_BTD = sublayer(h_BTD)
    partial_BTD = v_BTD if partial_BTD is None else partial_BTD + v_BTD
  return read(blocks + [partial_BTD], queries_RD[-1], gains_RD[-1], eps=eps)
