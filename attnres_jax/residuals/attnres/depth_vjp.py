"""The hand-written backward rules of the depth reads in `depth.py`.

Two reads have their VJP written out, where autodiff would keep or move more than
the read needs (each rule's docstring says what it computes, `docs/method.md` why):

- Phase 1 over a prefix of the buffer (`prefix_read`, a `lax.switch` over static
  prefixes): plain autodiff of a switch keeps every branch's residuals; this
  rule keeps only per-token values (no D axis) and reads and writes the chosen
  prefix alone.
- Phase 2's merge of several local sources (`depth._merge`, Full AttnRes): autodiff
  left the TPU compiler float32 [B, T, D] intermediates to write and read back.

The merge's forward rule stays with the reads in `depth.py` (it is the read, returning
what the backward needs) and is paired there with `merge_bwd`; the prefix read's is
built here around `depth`'s Phase 1. Shape letters as in `depth.py`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from attnres_jax.nn.ops import lead


def prefix_index(prefixes, num_valid):
  """The branch of a prefix read: the shortest of `prefixes` holding `num_valid`."""
  return jnp.sum(jnp.asarray(prefixes[:-1]) < num_valid).astype(jnp.int32)


def pad_slots(x, num_slots, axis):
  """`x` zero-padded along `axis` to `num_slots`."""
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, num_slots - x.shape[axis])
  return jnp.pad(x, widths)


def prefix_read(phase1_stats):
  """Phase 1 over the shortest of static `prefixes` that holds `num_valid` slots, with
  its VJP written out: a function of (buffer_KBTD, folded_QD, inv_rms_KBT, num_valid,
  prefixes, eps, out_dtype) that returns `depth.phase1`'s statistics. `phase1_stats`
  is Phase 1 over a whole buffer (`depth._phase1_stats`), handed in because `depth`
  imports this module."""

  @functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
  def read_prefix(buffer_KBTD, folded_QD, inv_rms_KBT, num_valid, prefixes, eps, dtype):
    # Forward alone: the branches keep nothing for a backward.
    args = (buffer_KBTD, folded_QD, inv_rms_KBT, num_valid, prefixes, eps, dtype)
    return _switch_reads(phase1_stats, *args, keep=False)

  def read_prefix_fwd(
    buffer_KBTD, folded_QD, inv_rms_KBT, num_valid, prefixes, eps, dtype
  ):
    args = (buffer_KBTD, folded_QD, inv_rms_KBT, num_valid, prefixes, eps, dtype)
    stats, per_token = _switch_reads(phase1_stats, *args, keep=True)
    return stats, (buffer_KBTD, folded_QD, inv_rms_KBT, num_valid, per_token)

  read_prefix.defvjp(read_prefix_fwd, read_prefix_bwd)
  return read_prefix


def _switch_reads(
  phase1_stats,
  buffer_KBTD,
  folded_QD,
  inv_rms_KBT,
  num_valid,
  prefixes,
  eps,
  out_dtype,
  *,
  keep,
):
  """The statistics, and with `keep` the per-token values the backward needs,
  zero-padded to K (no D axis: small), so that every branch outputs the same shapes."""
  num_sources = buffer_KBTD.shape[0]

  def branch(length):
    def read(buffer_KBTD, folded_QD, inv_rms_KBT, num_valid):
      given = None if inv_rms_KBT is None else inv_rms_KBT[:length]
      stats, per_token = phase1_stats(
        buffer_KBTD[:length], folded_QD, given, num_valid, eps=eps, out_dtype=out_dtype
      )
      if not keep:
        return stats
      exp_QKBT, dots_QKBT, inv_rms_used_KBT = per_token
      return stats, (
        pad_slots(exp_QKBT, num_sources, 1),
        pad_slots(dots_QKBT, num_sources, 1),
        pad_slots(inv_rms_used_KBT, num_sources, 0),
      )

    return read

  return jax.lax.switch(
    prefix_index(prefixes, num_valid),
    [branch(length) for length in prefixes],
    buffer_KBTD,
    folded_QD,
    inv_rms_KBT,
    num_valid,
  )


def _prefix_backward(inv_rms_given, length, num_sources, dim):
  """The backward of Phase 1 over the first `length` slots (one `lax.switch` branch)."""

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
    if not inv_rms_given:  # r = rsqrt(mean v^2 + eps): dr/dv = -(r^3 / D) v
      shrink_KBT = inv_rms_used_KBT**3 * d_inv_rms_KBT / dim
      d_values_KBTD -= shrink_KBT[..., None] * values_KBTD.astype(jnp.float32)
    d_folded_QD = jnp.einsum(
      'qkbt,kbtd->qd', d_dots_QKBT, values_KBTD, preferred_element_type=jnp.float32
    )
    d_buffer_KBTD = pad_slots(d_values_KBTD.astype(buffer_KBTD.dtype), num_sources, 0)
    return d_buffer_KBTD, d_folded_QD, pad_slots(d_inv_rms_KBT, num_sources, 0)

  return backward


def read_prefix_bwd(prefixes, eps, out_dtype, saved, d_stats):
  """With e = exp(logit - max) (zero on masked slots), dot = <v, f>, r the inverse
  RMS, logit = dot r, and for query q the cotangents ds_q (of its sum) and do_q (of
  its output; the max is stop-gradient): de_qk = ds_q + <do_q, v_k>, dl_qk = e_qk
  de_qk, dv_k = sum_q (e_qk do_q + dl_qk r_k f_q) - (r_k^3 / D) dr_k v_k (the last
  term when r is computed from v), dr_k = sum_q dl_qk dot_qk, df_q = sum_k dl_qk r_k
  v_k. Reads and writes the chosen prefix alone; the rest of dv is zero. (Summed
  into a carried cotangent inside the branch instead, as the kernel's VJP does, it
  measured faster on the TPU compiler's estimate but slower on CPU and with more
  temporary memory.)"""
  buffer_KBTD, folded_QD, inv_rms_KBT, num_valid, per_token = saved
  del eps, out_dtype
  num_sources, dim = buffer_KBTD.shape[0], buffer_KBTD.shape[-1]
  d_sums = [d_sum_BT for _, d_sum_BT, _ in d_stats]
  d_outs = [d_out_BTD.astype(jnp.float32) for _, _, d_out_BTD in d_stats]
  given = inv_rms_KBT is not None
  d_buffer_KBTD, d_folded_QD, d_inv_rms_KBT = jax.lax.switch(
    prefix_index(prefixes, num_valid),
    [_prefix_backward(given, length, num_sources, dim) for length in prefixes],
    buffer_KBTD,
    folded_QD,
    per_token,
    d_sums,
    d_outs,
  )
  return d_buffer_KBTD, d_folded_QD, d_inv_rms_KBT if given else None, None


def merge_bwd(eps, num_written, saved, d_h_BTD):
  """h = c o + sum_j alpha_j v_j (c = s / total, alpha_j = w_j / total). With g = dh:
  <g, h> = c <g, o> + sum_j alpha_j <g, v_j> (reductions over D of g against the
  inputs; h is not rebuilt), dl_j = alpha_j (<g, v_j> - <g, h>), do = c g,
  d sum = -c <g, h>, d max = c (<g, o> - sum <g, h>) (through s; the new max is
  stop-gradient), dv_j = alpha_j g + dl_j r_j f - (r_j^3 / D) dl_j dot_j v_j (the last
  term when r is computed here; a given r gets dl_j dot_j), df = sum dl_j r_j v_j.
  Over all J slots (alpha, dot and r zero-padded past the written ones)."""
  del eps
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
