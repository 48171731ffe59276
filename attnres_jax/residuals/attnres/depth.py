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
  N attention heads, H attention head width (model.py),
  K depth sources (slots of the depth buffer: num_blocks + 1),
  Q depth queries read together in Phase 1 (the sublayers of one schedule segment),
  J local slots (the depth slots written inside one schedule segment),
  L layers, G layers of one schedule segment.
Scalar counts are spelled out (block_size, num_blocks), never a bare letter.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from attnres_jax.nn.ops import lead, rms_inverse


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
  slots, picked by `lax.switch` (`_read_prefix`). The masked read costs every slot a
  pass over D, written or not, and an early segment of a deep Full model has only a
  few of its 65 slots written.
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


def _prefix_index(prefixes, num_valid):
  """The branch of `_read_prefix`: the shortest prefix holding `num_valid` slots."""
  return jnp.sum(jnp.asarray(prefixes[:-1]) < num_valid).astype(jnp.int32)


def _pad_slots(x, num_slots, axis):
  """`x` zero-padded along `axis` to `num_slots`."""
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, num_slots - x.shape[axis])
  return jnp.pad(x, widths)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _read_prefix(
  buffer_KBTD, folded_QD, inv_rms_KBT, num_valid, prefixes, eps, out_dtype
):
  """Phase 1 statistics over the shortest of `prefixes` that holds `num_valid`
  (forward alone: the branches keep nothing for a backward)."""
  return _switch_reads(
    buffer_KBTD, folded_QD, inv_rms_KBT, num_valid, prefixes, eps, out_dtype, False
  )


def _read_prefix_fwd(
  buffer_KBTD, folded_QD, inv_rms_KBT, num_valid, prefixes, eps, out_dtype
):
  stats, per_token = _switch_reads(
    buffer_KBTD, folded_QD, inv_rms_KBT, num_valid, prefixes, eps, out_dtype, True
  )
  return stats, (buffer_KBTD, folded_QD, inv_rms_KBT, num_valid, per_token)


def _switch_reads(
  buffer_KBTD, folded_QD, inv_rms_KBT, num_valid, prefixes, eps, out_dtype, keep
):
  """The statistics, and with `keep` the per-token values the backward needs,
  zero-padded to K (no D axis: small), so that every branch outputs the same shapes."""
  num_sources = buffer_KBTD.shape[0]

  def branch(length):
    def read(buffer_KBTD, folded_QD, inv_rms_KBT, num_valid):
      given = None if inv_rms_KBT is None else inv_rms_KBT[:length]
      stats, per_token = _phase1_stats(
        buffer_KBTD[:length],
        folded_QD,
        given,
        num_valid,
        eps=eps,
        out_dtype=out_dtype,
      )
      if not keep:
        return stats
      exp_QKBT, dots_QKBT, inv_rms_used_KBT = per_token
      return stats, (
        _pad_slots(exp_QKBT, num_sources, 1),
        _pad_slots(dots_QKBT, num_sources, 1),
        _pad_slots(inv_rms_used_KBT, num_sources, 0),
      )

    return read

  return jax.lax.switch(
    _prefix_index(prefixes, num_valid),
    [branch(length) for length in prefixes],
    buffer_KBTD,
    folded_QD,
    inv_rms_KBT,
    num_valid,
  )


def _read_prefix_bwd(prefixes, eps, out_dtype, saved, d_stats):
  """With e = exp(logit - max) (zero on masked slots), dot = <v, f>, r the inverse
  RMS, logit = dot r, and for query q the cotangents ds_q (of its sum) and do_q (of
  its output; the max is stop-gradient): de_qk = ds_q + <do_q, v_k>, dl_qk = e_qk
  de_qk, dv_k = sum_q (e_qk do_q + dl_qk r_k f_q) - (r_k^3 / D) dr_k v_k (the last
  term when r is computed from v), dr_k = sum_q dl_qk dot_qk, df_q = sum_k dl_qk r_k
  v_k. Reads and writes the chosen prefix alone; the rest of dv is zero. (Summed
  into a carried cotangent inside the branch instead, as the kernel's VJP does, it
  measured faster on the TPU compiler's estimate but slower on CPU and with more
  temp: docs/results.md, eighteenth pass.)"""
  buffer_KBTD, folded_QD, inv_rms_KBT, num_valid, per_token = saved
  del eps, out_dtype
  num_sources, dim = buffer_KBTD.shape[0], buffer_KBTD.shape[-1]
  d_sums = [d_sum_BT for _, d_sum_BT, _ in d_stats]
  d_outs = [d_out_BTD.astype(jnp.float32) for _, _, d_out_BTD in d_stats]

  def branch(length):
    def backward(buffer_KBTD, folded_QD, per_token, d_sums, d_outs):
      values_KBTD = buffer_KBTD[:length]
      exp_QKBT, dots_QKBT, inv_rms_used_KBT = (
        per_token[0][:, :length],
        per_token[1][:, :length],
        per_token[2][:length],
      )
      d_exp_QKBT = jnp.stack(
        [
          d_sums[q][None]
          + jnp.einsum(
            'btd,kbtd->kbt', d_outs[q], values_KBTD, preferred_element_type=jnp.float32
          )
          for q in range(len(d_outs))
        ]
      )
      d_logits_QKBT = exp_QKBT * d_exp_QKBT
      d_dots_QKBT = d_logits_QKBT * inv_rms_used_KBT[None]
      d_inv_rms_KBT = jnp.sum(d_logits_QKBT * dots_QKBT, axis=0)
      d_values_KBTD = jnp.einsum(
        'qkbt,qd->kbtd', d_dots_QKBT, folded_QD, preferred_element_type=jnp.float32
      )
      for q in range(len(d_outs)):  # elementwise: fused into one pass over the slots
        d_values_KBTD += exp_QKBT[q][..., None] * d_outs[q][None]
      if inv_rms_KBT is None:  # r = rsqrt(mean v^2 + eps): dr/dv = -(r^3 / D) v
        shrink_KBT = inv_rms_used_KBT**3 * d_inv_rms_KBT / dim
        d_values_KBTD -= shrink_KBT[..., None] * values_KBTD.astype(jnp.float32)
      d_folded_QD = jnp.einsum(
        'qkbt,kbtd->qd', d_dots_QKBT, values_KBTD, preferred_element_type=jnp.float32
      )
      d_buffer_KBTD = _pad_slots(d_values_KBTD.astype(buffer_KBTD.dtype), num_sources, 0)
      return d_buffer_KBTD, d_folded_QD, _pad_slots(d_inv_rms_KBT, num_sources, 0)

    return backward

  d_buffer_KBTD, d_folded_QD, d_inv_rms_KBT = jax.lax.switch(
    _prefix_index(prefixes, num_valid),
    [branch(length) for length in prefixes],
    buffer_KBTD,
    folded_QD,
    per_token,
    d_sums,
    d_outs,
  )
  return (
    d_buffer_KBTD,
    d_folded_QD,
    None if inv_rms_KBT is None else d_inv_rms_KBT,
    None,
  )


_read_prefix.defvjp(_read_prefix_fwd, _read_prefix_bwd)


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
  embedding). With several local sources (Full) the VJP is written out (`_merge_bwd`):
  autodiff of the merge left the TPU compiler float32 [B, T, D] intermediates to write
  and read back (`bench/aot.py`, d1024 v5p:2x2x1, full/pallas: 111.4 -> 109.8 GB a
  step). With one (Block) autodiff's fuses as well or better (block:4/pallas 91.03 vs
  91.09 GB, block:8/pallas 90.89 vs 91.0 GB), so it stays.
  """
  max_BT, sum_BT, out_BTD = phase1_stats
  folded_D = _folded_query(query_D, gain_D)
  if (num_local or local_JBTD.shape[0]) > 1:
    return _merge(
      max_BT,
      sum_BT,
      out_BTD,
      local_JBTD,
      valid_J,
      folded_D,
      local_inv_rms_JBT,
      float(eps),
      local_JBTD.shape[0] if num_written is None else num_written,
    )
  dots_JBT, inv_rms_JBT = _source_logits(local_JBTD, folded_D, eps, local_inv_rms_JBT)
  logits_JBT = jnp.where(valid_J[:, None, None], dots_JBT * inv_rms_JBT, -jnp.inf)
  new_max_BT = jax.lax.stop_gradient(jnp.maximum(max_BT, jnp.max(logits_JBT, axis=0)))
  old_scale_BT = jnp.exp(max_BT - new_max_BT)
  local_weights_JBT = jnp.exp(logits_JBT - new_max_BT[None])  # 0 where not valid
  total_BT = sum_BT * old_scale_BT + jnp.sum(local_weights_JBT, axis=0)
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


def _merge_parts(max_BT, sum_BT, local_JBTD, valid_J, folded_D, local_inv_rms_JBT, eps):
  """Per token: the old statistics' scale c = s / total (s = exp(m - m')), each local
  source's weight alpha_j = w_j / total, its dot and inverse RMS, and the total."""
  dots_JBT, inv_rms_JBT = _source_logits(local_JBTD, folded_D, eps, local_inv_rms_JBT)
  logits_JBT = jnp.where(valid_J[:, None, None], dots_JBT * inv_rms_JBT, -jnp.inf)
  new_max_BT = jnp.maximum(max_BT, jnp.max(logits_JBT, axis=0))
  old_scale_BT = jnp.exp(max_BT - new_max_BT)
  local_weights_JBT = jnp.exp(logits_JBT - new_max_BT[None])  # 0 where not valid
  total_BT = sum_BT * old_scale_BT + jnp.sum(local_weights_JBT, axis=0)
  inv_total_BT = 1 / total_BT
  return (
    old_scale_BT * inv_total_BT,
    local_weights_JBT * inv_total_BT[None],
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


def _merge_bwd(eps, num_written, saved, d_h_BTD):
  """h = c o + sum_j alpha_j v_j (c = s / total, alpha_j = w_j / total). With g = dh:
  <g, h> = c <g, o> + sum_j alpha_j <g, v_j> (reductions over D of g against the
  inputs; h is not rebuilt), dl_j = alpha_j (<g, v_j> - <g, h>), do = c g,
  d sum = -c <g, h>, d max = c (<g, o> - sum <g, h>) (through s; the new max is
  stop-gradient), dv_j = alpha_j g + dl_j r_j f - (r_j^3 / D) dl_j dot_j v_j (the last
  term when r is computed here; a given r gets dl_j dot_j), df = sum dl_j r_j v_j.
  Over all J slots (alpha, dot and r zero-padded past the written ones)."""
  sum_BT, out_BTD, local_JBTD, folded_D, local_inv_rms_JBT = saved[:5]
  scale_BT, *per_token = saved[5:9]
  to_all = lambda x: jnp.pad(x, [(0, local_JBTD.shape[0] - num_written), (0, 0), (0, 0)])
  alpha_JBT, dots_JBT, inv_rms_JBT = map(to_all, per_token)
  g_BTD = d_h_BTD.astype(jnp.float32)
  g_out_BT = jnp.sum(g_BTD * out_BTD.astype(jnp.float32), axis=-1)
  g_local_JBT = jnp.sum(g_BTD[None] * local_JBTD.astype(jnp.float32), axis=-1)
  g_h_BT = scale_BT * g_out_BT + jnp.sum(alpha_JBT * g_local_JBT, axis=0)
  d_logits_JBT = alpha_JBT * (g_local_JBT - g_h_BT[None])
  d_max_BT = scale_BT * (g_out_BT - sum_BT * g_h_BT)
  d_sum_BT = -scale_BT * g_h_BT
  d_out_BTD = (g_BTD * scale_BT[..., None]).astype(out_BTD.dtype)
  d_dots_JBT = d_logits_JBT * inv_rms_JBT
  d_inv_rms_JBT = d_logits_JBT * dots_JBT
  coef_JBT = alpha_JBT
  d_local_JBTD = coef_JBT[..., None] * g_BTD[None] + d_dots_JBT[..., None] * lead(
    folded_D, 4
  )
  if local_inv_rms_JBT is None:  # r = rsqrt(mean v^2 + eps): dr/dv = -(r^3 / D) v
    dim = local_JBTD.shape[-1]
    shrink_JBT = inv_rms_JBT**3 * d_inv_rms_JBT / dim
    d_local_JBTD -= shrink_JBT[..., None] * local_JBTD.astype(jnp.float32)
    d_given_rms = None
  else:
    d_given_rms = d_inv_rms_JBT
  d_folded_D = jnp.sum(
    d_dots_JBT[..., None] * local_JBTD.astype(jnp.float32), axis=(0, 1, 2)
  )
  return (
    d_max_BT,
    d_sum_BT,
    d_out_BTD,
    d_local_JBTD.astype(local_JBTD.dtype),
    None,
    d_folded_D,
    d_given_rms,
  )


_merge.defvjp(_merge_fwd, _merge_bwd)


# -- the paper's ablations (Section 5) as variants of the same read ------------------


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
