"""One segment of the linear-memory AttnRes backward pass (`backward.py`): each
sublayer's VJP kept from the forward pass, and the cotangents through a segment:
Phase 1 recomputed (or its kept results) and differentiated once, Phase 2 and the
sublayer once per sublayer, in reverse. `plan` is the `backward.StackPlan` of the
stack being differentiated.
"""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from attnres_jax.kernels import depth_pallas
from attnres_jax.kernels import pallas_mesh
from attnres_jax.nn import remat as remat_lib
from attnres_jax.nn import sharding
from attnres_jax.nn import stack as stack_lib
from attnres_jax.residuals.attnres import depth
from attnres_jax.residuals.attnres import phases
from attnres_jax.residuals.attnres.float_residuals import keeping_float_residuals


def sublayer(plan, which, state, h_BTD, positions_BT):
  """The whole sublayer (remat='layer' reruns it): its norm, then its body."""
  norm, body = plan.halves[which]
  return body(state, norm(state, h_BTD), positions_BT)


def body_vjp(plan, which, state_k, h_BTD, positions_BT):
  """A sublayer's output and the VJP of its body (after the PreNorm), the part kept
  for the backward: the norm's input is the read's output, which the backward
  recomputes anyway, so the norm is rerun there from it rather than its float32
  input kept (bench/aot.py d1024 v5p:2x2x1, block:4/bf16/pallas: temp 12.98 -> 11.48
  GiB, 48.50 -> 47.89 ms)."""
  norm, body = plan.halves[which]
  apply = lambda s, normed: body(s, normed, positions_BT)
  if plan.residual.cfg.remat in ('sublayer', 'minimal', 'offload'):  # nn/remat.py
    apply = remat_lib.sublayer(plan.residual.cfg.remat, apply)
  else:
    apply = keeping_float_residuals(apply)
  return jax.vjp(apply, state_k, norm(state_k, h_BTD))


def sublayer_backward(plan, which, state_j, h_BTD, saved_vjp, d_out_BTD, positions_BT):
  """(the layer state's cotangents, the input's) of one sublayer: through its kept
  body VJP and the norm rerun, or (remat='layer', none kept) all rerun."""
  if saved_vjp is None:
    apply = lambda s, h: sublayer(plan, which, s, h, positions_BT)
    d_state, d_h_BTD = jax.vjp(apply, state_j, h_BTD)[1](d_out_BTD)
    return [d_state], d_h_BTD
  _, norm_vjp = jax.vjp(plan.halves[which][0], state_j, h_BTD)
  d_state_body, d_normed_BTD = saved_vjp(d_out_BTD)
  d_state_norm, d_h_BTD = norm_vjp(d_normed_BTD)
  return [d_state_body, d_state_norm], d_h_BTD


def _phase1(plan, first, received, kept, buffer_KBTD, layer_states, *inv_rms_in_KBT):
  """A segment's Phase 1, from the final buffer: every slot before `first` is final
  there. The inverse RMS: computed from the buffer as the forward did, or (resumed)
  the received slots' as the forward read them."""
  params = stack_lib.stacked_residual_params(plan.graphdef, layer_states)
  inv_rms_KBT = None
  if inv_rms_in_KBT:
    received_K = jnp.arange(buffer_KBTD.shape[0]) < received[2]
    inv_rms_KBT = jnp.where(
      received_K[:, None, None],
      inv_rms_in_KBT[0],
      depth.rms_inverse(buffer_KBTD, plan.residual.cfg.attn_res_eps),
    )
  return phases.phase1(plan.residual, buffer_KBTD, params, first, inv_rms_KBT, kept=kept)


def _merge(plan, first, num_local, j, which, stats_mine, view_JBTD, state_j, emb_BTD):
  """Phase 2 of sublayer `which` of the segment's layer `j`, as the forward ran it."""
  params = nnx.merge(plan.graphdef, state_j).residual
  return phases.merge(
    plan.residual,
    stats_mine,
    view_JBTD,
    params.query[...][which],
    params.gain[...][which],
    j,
    which,
    first,
    emb_BTD,
    num_local=num_local,
  )


class _SegmentView:
  """The backward's running state through one segment's sublayers (in reverse): the
  cotangents of its slots, of its layers' states and of the embedding's reads."""

  def __init__(self, d_slots, num_layers):
    self.d_slots = d_slots
    self.d_layer_states = [None] * num_layers
    self.d_stats = [None] * num_layers
    self.d_embedding_sum_BTD = None  # the first sublayer's read (see phases.merge)


def _sublayer_read_backward(plan, view, ctx, j, which, state_j, saved_j, stats_j):
  """Sublayer `which` of layer `j`: its read recomputed, then the cotangents through
  its sublayer and its read, added into `view`. Returns the cotangent of its Phase 1
  statistics."""
  first, num_local, local_JBTD, embedding_BTD, positions_BT = ctx
  index, num_valid = plan.residual.local_index(j, which)
  partial_BTD, saved_vjp, _ = saved_j[which]
  # The local slots as this sublayer read them: earlier ones complete, its own
  # holding the partial sum it saw (when not read, Full or first in its block, left
  # as it is: its weight is zero).
  view_JBTD = local_JBTD if partial_BTD is None else local_JBTD.at[index].set(partial_BTD)
  view_JBTD = view_JBTD[:num_valid] if num_valid else None  # the slots read
  read = functools.partial(_merge, plan, first, num_local, j, which)
  h_BTD, read_vjp = jax.vjp(read, stats_j[which], view_JBTD, state_j, embedding_BTD)
  # The write's cotangent, in the dtype of the sublayer's output.
  d_states, d_h_BTD = sublayer_backward(
    plan,
    which,
    state_j,
    h_BTD,
    saved_vjp,
    view.d_slots[index].astype(h_BTD.dtype),
    positions_BT,
  )
  d_stats_mine, d_view_JBTD, d_state_read, d_embedding_BTD = read_vjp(d_h_BTD)
  view.d_embedding_sum_BTD = (
    d_embedding_BTD
    if view.d_embedding_sum_BTD is None
    else view.d_embedding_sum_BTD + d_embedding_BTD
  )
  # Slot `index` before the write is the partial sum: its cotangent passes through
  # the write unchanged and gains the read's.
  for s in range(num_valid):
    view.d_slots[s] = pallas_mesh.width_minor(view.d_slots[s] + d_view_JBTD[s])
  for d in d_states + [d_state_read]:
    view.d_layer_states[j] = (
      d
      if view.d_layer_states[j] is None
      else jax.tree.map(jnp.add, view.d_layer_states[j], d)
    )
  return d_stats_mine


def _add_phase1_cotangent(plan, d_buffer_KBTD, d_buffer_phase1, d_embedding_sum_BTD):
  """The carried buffer cotangent plus Phase 1's and the embedding's reads' (without
  the kernel's in-place sum)."""
  d_buffer_KBTD = d_buffer_KBTD + d_buffer_phase1
  d_embedding_BTD = d_embedding_sum_BTD.astype(d_buffer_KBTD.dtype)
  if plan.keeps_partial:  # Block: zero-padded to the carry, in the same sum (one pass,
    # no slot update; bench/aot.py d1024 v5p-8: 0.2 GB less). Full without the
    # kernel: the slot update (the padded sum moved 0.4 GB more).
    return d_buffer_KBTD + jnp.pad(
      d_embedding_BTD[None], [(0, d_buffer_KBTD.shape[0] - 1)] + [(0, 0)] * 3
    )
  return d_buffer_KBTD.at[0].add(d_embedding_BTD)


def segment_backward(
  plan,
  buffer_KBTD,
  d_buffer_KBTD,
  received,
  layer_states,
  segment,
  saved,
  positions_BT,
  embedding_BTD=None,
  mean_valid=None,
):
  """Cotangents through one segment: (d_buffer before it, d_layer_states, and
  resumed, the received inverse RMS' cotangent). `received`: None, or (the received
  inverse RMS, its cotangent so far, the chunk's first slot). `embedding_BTD`: slot 0
  of the final buffer if the caller sliced it (outside the segments' scan), else
  None. `mean_valid`: what the Phase 1 kernels' cost estimates charge for a traced
  `first` (the mean over the scan's segments)."""
  residual = plan.residual
  num_layers = len(layer_states)
  first = residual.first_local_slot(segment)
  num_local = residual.local_slots(num_layers)
  # Phase 1's results as the forward pass kept them, else computed again here.
  kept = (
    [tuple(s[2] for s in saved_j) for saved_j in saved] if plan.keeps_phase1 else None
  )
  phase1 = functools.partial(_phase1, plan, first, received, kept)
  primals = (buffer_KBTD, layer_states) + (received[:1] if received else ())
  with (
    depth_pallas.expected_valid(mean_valid)
    if mean_valid is not None
    else contextlib.nullcontext()
  ):
    stats, phase1_vjp = jax.vjp(phase1, *primals)
  # The segment's slots: final values, and the cotangent they got after it ended.
  local_JBTD = jax.lax.dynamic_slice_in_dim(buffer_KBTD, first, num_local, 0)
  if embedding_BTD is None:
    embedding_BTD = buffer_KBTD[0]
  d_local_JBTD = jax.lax.dynamic_slice_in_dim(d_buffer_KBTD, first, num_local, 0)
  if not plan.kernel_layout:  # there, Phase 1's VJP zeroes them
    d_buffer_KBTD = jax.lax.dynamic_update_slice_in_dim(
      d_buffer_KBTD, jnp.zeros_like(d_local_JBTD), first, 0
    )
  # Each slot's cotangent apart, width-minor: a sublayer's read adds to the slots it
  # read alone. As one [J, ...] array every read's add wrote all J slots; apart with
  # no layout pinned, the compiler laid them tokens-minor and relayouted the carried
  # cotangent around the fused Phase 1 backward every segment (bench/aot.py d1024
  # v5p:2x2x1, full/bf16/pallas: 53.84 ms; 54.28 apart; 52.78 pinned).
  d_slots = [pallas_mesh.width_minor(d_local_JBTD[s]) for s in range(num_local)]
  view = _SegmentView(d_slots, num_layers)
  ctx = (first, num_local, local_JBTD, embedding_BTD, positions_BT)
  for j in reversed(range(num_layers)):
    d_stats_j = [None] * residual.sublayers_per_layer
    for which in reversed(range(residual.sublayers_per_layer)):
      d_stats_j[which] = _sublayer_read_backward(
        plan, view, ctx, j, which, layer_states[j], saved[j], stats[j]
      )
    view.d_stats[j] = tuple(d_stats_j)  # as Phase 1 returned them: nothing stacked
  with (
    depth_pallas.cotangent_into(  # the kernel sums all into the carry, in place
      d_buffer_KBTD, num_zeroed=num_local, d_first_BTD=view.d_embedding_sum_BTD
    )
    if plan.kernel_layout  # and zeroes the segment's slots
    else contextlib.nullcontext()
  ):
    d_buffer_phase1, d_states_phase1, *d_inv_rms_phase1 = phase1_vjp(view.d_stats)
  d_layer_states = jax.tree.map(jnp.add, tuple(view.d_layer_states), d_states_phase1)
  if plan.kernel_layout:  # the carry, Phase 1's and the embedding's, summed in place
    d_buffer_KBTD = d_buffer_phase1
  else:
    d_buffer_KBTD = _add_phase1_cotangent(
      plan, d_buffer_KBTD, d_buffer_phase1, view.d_embedding_sum_BTD
    )
  d_buffer_KBTD = sharding.constrain(d_buffer_KBTD, sharding.DEPTH_BUFFER)
  d_inv_rms_KBT = received[1] + d_inv_rms_phase1[0] if received else None
  return d_buffer_KBTD, d_layer_states, d_inv_rms_KBT
