"""The Pallas kernels of AttnRes Phase 1 (`depth_pallas`): one depth slot a step.

Each program of the grid (batch row, tile of T, slot) sees one slot [D, t] of the
buffer (tokens on lanes, channels on sublanes); the slot axis is the innermost and
sequential one. Its BlockSpec clamps the slot index to num_valid - 1, so the steps
past the valid slots keep the block already in VMEM (no DMA) and skip their work
(`pl.when`). Blocks whose index does not depend on the slot (the queries, the
statistics, the outputs and their cotangents) stay in VMEM across a tile's steps.

  forward:   per valid slot k, in float32: dot_qk = f_q . v_k (the MXU, f_q = w_q *
             g_q), r_k = 1 / RMS(v_k) (or the carried r), l_qk = dot_qk r_k; online
             softmax: m_q' = max(m_q, l_qk), a_q = exp(m_q - m_q'),
             e_qk = exp(l_qk - m_q'), s_q = a_q s_q + e_qk, o_q = a_q o_q + e_qk v_k
             (m_q and s_q in the statistics' output blocks, o_q in float32 scratch,
             stored in the output dtype at the last step);
  backward:  given the forward's final max m_q, each slot is independent:
             e_qk = exp(l_qk - m_q) (l_qk recomputed as above),
             dl_qk = e_qk (<do_q, v_k> + ds_q),
             dv_k  = sum_q e_qk do_q + r_k sum_q dl_qk f_q - (r_k^3 / D) dr_k v_k
                     with dr_k = sum_q dl_qk dot_qk (the last term only when r is
                     recomputed; a carried r gets dr as its cotangent instead),
             df_q += sum_tokens dl_qk r_k v_k (accumulated over the slot steps in its
             output block: one partial per (batch row, tile), summed outside).
             The outputs are unnormalised (s_q and o_q apart), so the flash-attention
             delta = <do, o> is not needed: ds_q plays its part.
             Slots past num_valid get zero cotangents (written, not computed).
             Or (`cotangent_into`) dv_k is added to a carried cotangent's slot k
             (width on the lanes: dv_k transposed in VMEM; slot 0 also gets an
             addend), written in place; past num_valid, that carry's next
             `num_zeroed` slots are zeroed, the rest neither read nor written.
             Or (no carry, `width_minor_cotangent`) dv_k is written transposed
             the same way, every slot (zeros past num_valid).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

# What one program's tile may need (blocks double buffered, scratch, temporaries;
# the tile is the largest that fits, at least 128 tokens), and the headroom asked of
# Mosaic above that estimate.
TILE_VMEM_BYTES = 40 * 2**20
HEADROOM_VMEM_BYTES = 16 * 2**20
# The on-chip vector memory the kernels may assume a core has (v5p's 64 MiB; v5e and
# v6e have more): a config whose narrowest tile needs more is refused by validation.
VMEM_BYTES = 64 * 2**20
LANES = 128
SUBLANES = 8


def vmem_bytes(tile, num_queries, dim, itemsize, out_itemsize):
  """On-chip memory of the larger of the two kernels at `tile` tokens, independent
  of the number of slots. Forward: one slot, the Q outputs and the statistics
  (double buffered), the Q float32 accumulators; backward: one slot, the carried
  cotangent's slot in and out and slot 0's float32 addend (`cotangent_into`; the
  slot's own cotangent without it), the Q output cotangents, three statistics, the
  queries and their cotangent (double buffered). Both: about 4 float32 [D, tile]
  temporaries."""
  rows = -(-num_queries // SUBLANES) * SUBLANES  # [Q, tile] pads to 8 sublanes
  slot, outs = dim * tile * itemsize, num_queries * dim * tile * out_itemsize
  stat, rms, folded = rows * tile * 4, SUBLANES * tile * 4, rows * dim * 4
  forward = 2 * (slot + outs + 2 * stat + rms + folded) + 4 * num_queries * dim * tile
  backward = 2 * (3 * slot + dim * tile * 4 + outs + 3 * stat + 2 * rms + 2 * folded)
  return max(forward, backward) + 4 * 4 * dim * tile


def least_vmem_bytes(num_queries, dim, itemsize, out_itemsize):
  """On-chip memory the kernels need at their narrowest tile (128 tokens)."""
  return vmem_bytes(LANES, num_queries, dim, itemsize, out_itemsize)


def choose_tile(length, num_queries, dim, itemsize, out_itemsize):
  """Tokens per program along T (the lane axis): the largest multiple of 128 dividing
  `length` that fits TILE_VMEM_BYTES (at least 128), or all of T when no multiple of
  128 divides it."""
  fits = [
    tile
    for tile in range(LANES, length + 1, LANES)
    if length % tile == 0
    and vmem_bytes(tile, num_queries, dim, itemsize, out_itemsize) <= TILE_VMEM_BYTES
  ]
  if fits:
    return max(fits)
  return LANES if length % LANES == 0 else length


_NT = (((1,), (1,)), ((), ()))  # a . b^T
_TN = (((0,), (0,)), ((), ()))  # a^T . b
_HIGHEST = jax.lax.Precision.HIGHEST


def _logits(folded_QD, v_Dt, rms_ref, eps):
  """(dots [Q, t], inverse RMS [1, t], logits [Q, t]) of one slot, float32."""
  dots_Qt = jax.lax.dot(
    folded_QD, v_Dt, precision=_HIGHEST, preferred_element_type=jnp.float32
  )
  if rms_ref is None:
    dim = v_Dt.shape[0]
    r_1t = jax.lax.rsqrt(jnp.sum(v_Dt * v_Dt, axis=0, keepdims=True) / dim + eps)
  else:
    r_1t = rms_ref[...]
  return dots_Qt, r_1t, dots_Qt * r_1t


def forward_kernel(nv_ref, folded_ref, buf_ref, *refs, num_queries, eps, has_rms):
  """One slot step of the forward: refs are (inverse RMS [1, t] if carried), max and
  sum [Q, t], the Q outputs [D, t], the float32 accumulators [Q, D, t] (scratch)."""
  rms_ref = refs[0] if has_rms else None
  refs = refs[1:] if has_rms else refs
  max_ref, sum_ref, out_refs, acc_ref = refs[0], refs[1], refs[2:-1], refs[-1]
  k, num_slots = pl.program_id(2), pl.num_programs(2)

  @pl.when(k == 0)
  def _():
    max_ref[...] = jnp.full(max_ref.shape, -jnp.inf, jnp.float32)
    sum_ref[...] = jnp.zeros(sum_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

  @pl.when(k < nv_ref[0])
  def _():
    v_Dt = buf_ref[...].astype(jnp.float32)
    _, _, logits_Qt = _logits(folded_ref[...], v_Dt, rms_ref, eps)
    old_Qt = max_ref[...]
    new_Qt = jnp.maximum(old_Qt, logits_Qt)
    scale_Qt = jnp.exp(old_Qt - new_Qt)  # 0 at the first slot (old = -inf)
    e_Qt = jnp.exp(logits_Qt - new_Qt)
    max_ref[...] = new_Qt
    sum_ref[...] = sum_ref[...] * scale_Qt + e_Qt
    for q in range(num_queries):
      acc_ref[q] = acc_ref[q] * scale_Qt[q : q + 1] + e_Qt[q : q + 1] * v_Dt

  @pl.when(k == num_slots - 1)
  def _():
    for q, out_ref in enumerate(out_refs):
      out_ref[...] = acc_ref[q].astype(out_ref.dtype)


def _rows(rows, height):
  """[height, t] from `height` rows [1, t] (sublane selects; no concatenation)."""
  shape = (height, rows[0].shape[1])
  index = jax.lax.broadcasted_iota(jnp.int32, shape, 0)
  out = jnp.zeros(shape, jnp.float32)
  for i, row in enumerate(rows):
    out = jnp.where(index == i, row, out)
  return out


def backward_kernel(
  nv_ref,
  folded_ref,
  buf_ref,
  *refs,
  num_queries,
  eps,
  has_rms,
  into,
  num_zeroed,
  has_first,
  has_carry,
):
  """One slot step of the backward: refs are (inverse RMS [1, t] if carried), the
  forward's max [Q, t], the sum's cotangent [Q, t], the Q outputs' cotangents [D, t],
  (`has_carry`, only with `into`: the carried cotangent's slot [t, D]; and if
  `has_first` what slot 0 also gets [t, D]); then the slot's cotangent [D, t]
  (`into`: the carry's slot [t, D], the same buffer, the sum written; without a
  carry, the slot's own cotangent [t, D]), (its inverse RMS's [1, t]), the
  queries' [Q, D]. `into` zeroes the carry's `num_zeroed` slots from num_valid on."""
  rms_ref = refs[0] if has_rms else None
  refs = refs[1:] if has_rms else refs
  max_ref, dsum_ref, dout_refs = refs[0], refs[1], refs[2 : 2 + num_queries]
  refs = refs[2 + num_queries :]
  carry_ref = refs[0] if has_carry else None
  first_ref = refs[has_carry] if has_first else None
  dbuf_ref, *rest = refs[has_carry + has_first :]
  drms_ref = rest.pop(0) if has_rms else None
  (dfold_ref,) = rest
  k, nv = pl.program_id(2), nv_ref[0]

  @pl.when(k == 0)
  def _():
    dfold_ref[...] = jnp.zeros(dfold_ref.shape, jnp.float32)

  @pl.when(k < nv)
  def _():
    folded_QD = folded_ref[...]
    v_Dt = buf_ref[...].astype(jnp.float32)
    dots_Qt, r_1t, logits_Qt = _logits(folded_QD, v_Dt, rms_ref, eps)
    e_Qt = jnp.exp(logits_Qt - max_ref[...])
    de_rows = [
      jnp.sum(ref[...].astype(jnp.float32) * v_Dt, axis=0, keepdims=True)
      for ref in dout_refs
    ]
    dl_Qt = e_Qt * (dsum_ref[...] + _rows(de_rows, num_queries))
    dlr_Qt = dl_Qt * r_1t
    dv_Dt = jax.lax.dot_general(
      folded_QD, dlr_Qt, _TN, precision=_HIGHEST, preferred_element_type=jnp.float32
    )
    for q, ref in enumerate(dout_refs):
      dv_Dt = dv_Dt + e_Qt[q : q + 1, :] * ref[...].astype(jnp.float32)
    dr_1t = jnp.sum(dl_Qt * dots_Qt, axis=0, keepdims=True)
    if has_rms:
      drms_ref[...] = dr_1t
    else:
      dv_Dt = dv_Dt - (r_1t * r_1t * r_1t * dr_1t / v_Dt.shape[0]) * v_Dt
    if into:  # tokens on the lanes -> width; the sum rounded once
      sum_tD = dv_Dt.T
      if has_carry:
        sum_tD = carry_ref[...].astype(jnp.float32) + sum_tD
      if has_first:
        sum_tD = sum_tD + jnp.where(k == 0, first_ref[...].astype(jnp.float32), 0.0)
      dbuf_ref[...] = sum_tD.astype(dbuf_ref.dtype)
    else:
      dbuf_ref[...] = dv_Dt.astype(dbuf_ref.dtype)
    dfold_ref[...] += jax.lax.dot_general(
      dlr_Qt, v_Dt, _NT, precision=_HIGHEST, preferred_element_type=jnp.float32
    )

  @pl.when(k >= nv)
  def _():  # weight zero: no gradient
    if not has_carry:
      dbuf_ref[...] = jnp.zeros(dbuf_ref.shape, dbuf_ref.dtype)
    if has_rms:
      drms_ref[...] = jnp.zeros(drms_ref.shape, jnp.float32)

  if into and num_zeroed:

    @pl.when((k >= nv) & (k < nv + num_zeroed))
    def _():
      dbuf_ref[...] = jnp.zeros(dbuf_ref.shape, dbuf_ref.dtype)


# -- what the kernels load and compute (their CostEstimates) -------------------------


def forward_cost(tokens, bound, num_queries, dim, isz, osz, has_rms):
  """(flops, transcendentals, HBM bytes) of the forward over `tokens` tokens reading
  `bound` slots each. Per (token, valid slot): the Q dots 2QD, the online softmax 5Q
  (2Q exponentials), the Q accumulators 3QD; the slot's RMS 2D + 2 (a square root)
  unless carried. Bytes: the slots (and their inverse RMS) read, the Q outputs and
  two statistics written, the queries read once."""
  recompute = not has_rms
  elements = tokens * bound  # (token, valid slot) pairs
  return (
    elements * (5 * num_queries * dim + 6 * num_queries + recompute * (2 * dim + 2)),
    elements * (2 * num_queries + recompute),
    elements * (dim * isz + 4 * has_rms)
    + tokens * num_queries * (dim * osz + 8)
    + num_queries * dim * 4,
  )


def backward_cost(tokens, tiles, bound, num_slots, num_queries, dim, sizes, has_rms):
  """(flops, transcendentals, HBM bytes) of the backward over `tokens` tokens (in
  `tiles` programs) reading `bound` slots each; `sizes`: the buffer's and the output
  cotangents' itemsizes, with `cotangent_into` the carry's (None without), the slots
  it zeroes and the itemsize of slot 0's addend (0: none). Per (token, valid slot):
  the dots, the output cotangents' dots, the slot's and the queries' cotangents 2QD
  each, the weighted outputs' cotangents 2QD, 7Q on [Q] vectors (Q exponentials);
  the RMS and its cotangent 4D + 6 unless carried; the carry's add D. Bytes: the
  slots (and their inverse RMS) read, the output cotangents and two statistics read,
  the queries read once, their partial cotangents written once per program; the
  buffer's cotangent written (all K), or the carry read at the valid slots and
  written at those and the zeroed ones, and slot 0's addend read (an add a token
  and channel); the inverse RMS's cotangent written (all K) when carried."""
  isz, osz, csz, num_zeroed, fsz = sizes
  recompute, into = not has_rms, csz is not None
  elements = tokens * bound
  if into:  # the carry read at the valid slots, written there and at the zeroed
    dbuf_bytes = tokens * dim * csz * (bound + min(bound + num_zeroed, num_slots))
  else:
    dbuf_bytes = tokens * dim * isz * num_slots
  return (
    elements
    * (8 * num_queries * dim + 7 * num_queries + recompute * (4 * dim + 6) + into * dim)
    + tokens * dim * (fsz > 0),
    elements * (num_queries + recompute),
    elements * (dim * isz + 4 * has_rms)
    + tokens * num_queries * (dim * osz + 8)
    + num_queries * dim * 4 * (1 + tiles)
    + dbuf_bytes
    + tokens * num_slots * 4 * has_rms
    + tokens * dim * fsz,
  )
