"""The linear-memory backward pass of the AttnRes block schedule.

Plain autodiff of the segment scan keeps the whole depth buffer once per segment (it
is in the carry and Phase 1 reads it), so memory grows with depth squared. But the
buffer is append-only: a segment only writes its own slots, which are zero before it
and final after it, so every segment's view of the buffer can be rebuilt from the
final one. This custom VJP keeps the final buffer once, plus per sublayer what plain
autodiff would keep of the sublayer after its PreNorm (its VJP closure; the layer
parameters in it are forwarded by the scans, not copied) and, for Block, the running
partial sum the sublayer read. The sublayer's input is not kept: the backward
recomputes the read anyway, and reruns the norm from it. The backward pass runs the
segments in reverse (`backward_segment.py`): Phase 1 is recomputed (or, with the
Phase 1 kernel, its results kept from the forward pass: `choices.keeps_phase1`) and
differentiated once per segment (its cotangents summed over the segment's
sublayers), Phase 2 once per sublayer.
Contract: gradients equal plain autodiff of the same schedule
(tests/residuals/test_memory.py).

The same backward runs a pipeline chunk (`parallel/pipeline.py`): layers in the
middle of the model, resumed from the carry the chunk received (buffer and inverse
RMS), whose cotangents it returns (tests/parallel/test_pipeline.py).
"""

from __future__ import annotations

import contextlib
import functools
import types
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from attnres_jax.kernels import depth_pallas
from attnres_jax.kernels import pallas_mesh
from attnres_jax.nn import sharding
from attnres_jax.nn import stack as stack_lib
from attnres_jax.residuals.attnres import backward_segment
from attnres_jax.residuals.attnres import choices
from attnres_jax.residuals.attnres import depth


class StackPlan(NamedTuple):
  """What one call of the stack fixes at trace time, shared by its forward and
  backward passes (`plan`)."""

  residual: Any  # the AttnResResidual (two-phase reads)
  graphdef: Any  # of one layer
  num_layers: int
  resumed: bool  # a pipeline chunk, resumed from a received carry
  carry_type: type  # of `start`
  start_dtype: Any  # the embedding's (None for a chunk)
  stack_cfg: Any  # what `stack_lib.run_layers` reads of the config
  halves: list  # per sublayer: (its PreNorm, its body) as pure functions
  keeps_partial: bool  # Block: a sublayer's own slot holds a partial sum
  kernel_layout: bool  # the buffer's cotangent summed by the Phase 1 kernel
  pin_chunk_cotangent: bool  # a chunk's carried cotangent pinned width-minor
  recompute_sublayers: bool  # remat='layer': no sublayer VJP kept
  expected_valid: float | None  # the Phase 1 kernels' charge for a traced `first`
  keeps_phase1: bool  # Phase 1's results kept from the forward pass


def make_stack(residual):
  """fn(graphdef, layer_state, start, positions_BT, segment_offset=None) -> (buffer,
  inverse RMS) after the layers of `layer_state` ([n, ...]); `residual` is an
  `AttnResResidual` (two-phase reads). `start`: the embedding [B, T, D] (all
  layers, `segment_offset` None), or the carry a pipeline chunk received (a
  `DepthCarry`, the chunk starting on a block boundary at model segment
  `segment_offset`, which may be traced); then its cotangent is the carry's."""
  return functools.partial(_run, residual)


def _run(residual, graphdef, layer_state, start, positions_BT, segment_offset=None):
  plan = _plan(residual, graphdef, layer_state, start, segment_offset is not None)
  after_layers = jax.custom_vjp(functools.partial(_after_layers, plan))
  after_layers.defvjp(
    functools.partial(_forward, plan), functools.partial(_backward, plan)
  )
  out = after_layers(layer_state, start, segment_offset, positions_BT)
  if plan.resumed:
    return out
  # The final read takes each slot's inverse RMS from the carry; computing it here,
  # outside the custom VJP, lets autodiff carry its cotangent into the buffer.
  return out, depth.rms_inverse(out, residual.cfg.attn_res_eps)


def _plan(residual, graphdef, layer_state, start, resumed) -> StackPlan:
  cfg = residual.cfg
  num_layers = jax.tree.leaves(layer_state)[0].shape[0]
  if resumed and (residual.sublayers_per_layer * num_layers) % residual.block_size:
    raise ValueError(f'A chunk of {num_layers} layers does not cover whole blocks.')
  keeps_partial = residual.block_size > 1  # Full: a sublayer's own slot starts empty
  kernel = residual.kernel == 'pallas'
  # With the Phase 1 kernel: the buffer and Phase 1's cotangent of it have the
  # kernel's layout (tokens on the lanes), Phase 1's cotangent is summed into the
  # carried one by its backward kernel (`depth_pallas.cotangent_into`: width on the
  # lanes, in place), and slot 0 is sliced once, outside the reverse scan. For Block
  # the separate sum read the carried [K, B, T, D] cotangent twice and wrote it once a
  # segment (bench/aot.py d1024 v5p:2x2x1, block:4/bf16/pallas, data / FSDP: HBM
  # 70.6 -> 69.9 / 65.5 -> 64.7 GB, cycles 1.053x -> 1.030x / 1.094x -> 1.067x the
  # standard's, the estimate unchanged, temp +0.05-0.06 GiB; with the kernel's sum but
  # slot 0 sliced in the scan, a relayout copy of the buffer took the sum's place).
  # Each segment's slots are sliced from the final buffer inside the reverse scan, as
  # without the kernel: sliced once before it, all of them at once, that copy cost
  # more than the per-segment slices (d1024 v5p:2x2x1 full/bf16/pallas: 51.60 ->
  # 51.14 ms, temp 12.56 -> 12.06 GiB). Not for Block's pipeline chunks: there it
  # measured slower (bench/pipeline.py v5p:2x2x1 P=2 M=4 remat, block:4/bf16/pallas:
  # V=1 78.02 -> 79.8 ms, temp 4.87 -> 5.05 GiB; V=2 74.26 -> 75.0 ms).
  kernel_layout = kernel and not (keeps_partial and resumed)
  # What the Phase 1 kernels' cost estimates charge a call in the scan over the full
  # segments (`first`, their num_valid, traced there): the mean of `first` over the
  # scan's segments, exactly the slots the kernels load on average. A tail segment's
  # `first` is a Python int, charged itself. Not for a chunk (its offset is traced).
  num_full = num_layers // residual.segment_layers
  expected_valid = None
  if kernel and not resumed and num_full:
    firsts = [residual.first_local_slot(s) for s in range(num_full)]
    expected_valid = sum(firsts) / num_full
  keeps_phase1 = expected_valid is not None and (
    choices.keeps_phase1(
      expected_valid, residual.sublayers_per_layer * residual.segment_layers
    )
    if residual.keep_phase1 is None
    else residual.keep_phase1
  )
  return StackPlan(
    residual=residual,
    graphdef=graphdef,
    num_layers=num_layers,
    resumed=resumed,
    carry_type=type(start),
    start_dtype=None if resumed else start.dtype,
    stack_cfg=types.SimpleNamespace(
      num_layers=num_layers, remat=cfg.remat, scan_layers=cfg.scan_layers
    ),
    halves=[
      stack_lib.sublayer_halves(graphdef, w) for w in range(residual.sublayers_per_layer)
    ],
    keeps_partial=keeps_partial,
    kernel_layout=kernel_layout,
    # Full's pipeline chunks also pin their carried cotangent width-minor per
    # segment: under the stages' vmap the compiler held it tokens-minor in the
    # reverse scan and copied it to and from the kernel's layout every trip
    # (bench/pipeline.py v5p, P=2 V=1, full/bf16/pallas: 93.60 -> 91.60 ms). Block's
    # got slower pinned (block:4/bf16/pallas V=2: 74.89 -> 78.90 ms).
    pin_chunk_cotangent=kernel_layout and not keeps_partial,
    recompute_sublayers=cfg.remat == 'layer',
    expected_valid=expected_valid,
    keeps_phase1=keeps_phase1,
  )


def _run_segments(plan, layer_state, start, segment_offset, positions_BT, **kwargs):
  """The stack's layers from `start` (resumed at `segment_offset` for a chunk), the
  Phase 1 kernels charged `plan.expected_valid` slots a call in the scan."""
  residual = plan.residual
  runner = stack_lib.Resumed(residual, segment_offset) if plan.resumed else residual
  with (
    contextlib.nullcontext()
    if plan.expected_valid is None
    else depth_pallas.expected_valid(plan.expected_valid)
  ):
    return stack_lib.run_layers(
      runner,
      plan.graphdef,
      layer_state,
      start,
      positions_BT,
      cfg=plan.stack_cfg,
      index_layers=True,
      **kwargs,
    )


def _after_layers(plan, layer_state, start, segment_offset, positions_BT):
  carry, _ = _run_segments(plan, layer_state, start, segment_offset, positions_BT)
  return carry if plan.resumed else carry.buffer_KBTD


def _keep_sublayer(
  plan, positions_BT, which, layer_in_segment, state_k, h_BTD, inner, extra, per_layer
):
  """The forward pass of one sublayer, and what the backward keeps of it: the partial
  sum in its own slot where it reads it (Block, not first in its block; the first
  reads no slot of its block, which is zero), its body's VJP (none with
  remat='layer') and, where kept, its Phase 1 results."""
  del extra
  index, num_valid = plan.residual.local_index(layer_in_segment, which)
  reads_own = plan.keeps_partial and num_valid > index
  partial_BTD = inner.local_JBTD[index] if reads_own else None
  phase1_kept = per_layer[which] if plan.keeps_phase1 else None
  if plan.recompute_sublayers:
    out_BTD = backward_segment.sublayer(plan, which, state_k, h_BTD, positions_BT)
    return out_BTD, (partial_BTD, None, phase1_kept)
  out_BTD, saved_vjp = backward_segment.body_vjp(
    plan, which, state_k, h_BTD, positions_BT
  )
  return out_BTD, (partial_BTD, saved_vjp, phase1_kept)


def _forward(plan, layer_state, start, segment_offset, positions_BT):
  carry, (full_ys, tail_ys) = _run_segments(
    plan,
    layer_state,
    start,
    segment_offset,
    positions_BT,
    apply_sublayer=functools.partial(_keep_sublayer, plan, positions_BT),
  )
  saved = tuple(
    None if ys is None else tuple(y[0] for y in ys) for ys in (full_ys, tail_ys)
  )
  # Resumed: what the chunk received of the inverse RMS (Phase 1 read it).
  inv_rms_in_KBT = start.inv_rms_KBT if plan.resumed else None
  kept = (layer_state, carry.buffer_KBTD, inv_rms_in_KBT, segment_offset)
  return (carry if plan.resumed else carry.buffer_KBTD), (*kept, positions_BT, saved)


class _Inputs(NamedTuple):
  """What the backward pass reads of the forward's, for every segment."""

  layer_state: Any
  buffer_KBTD: jax.Array  # the final buffer
  inv_rms_in_KBT: Any  # resumed: the received inverse RMS
  chunk_first: Any  # resumed: the chunk's first slot
  offset: Any  # the chunk's first segment (0 for the whole stack)
  positions_BT: jax.Array
  embedding_BTD: Any  # slot 0, sliced once outside the scan (kernel layout), or None

  def received(self, d_inv_rms_KBT):
    if self.chunk_first is None:
      return None
    return (self.inv_rms_in_KBT, d_inv_rms_KBT, self.chunk_first)


def _through_written_inv_rms(plan, buffer_KBTD, d_carry, chunk_first):
  """Resumed: the output carry's cotangents split into the buffer's (the chunk's
  slots also get their inverse RMS's, computed from them) and the received inverse
  RMS' (the slots the chunk passes on unchanged)."""
  d_buffer_KBTD, d_inv_rms_KBT = d_carry
  eps = plan.residual.cfg.attn_res_eps
  num_written = plan.residual.local_slots(plan.num_layers)
  written = lambda x: jax.lax.dynamic_slice_in_dim(x, chunk_first, num_written, 0)
  _, rms_vjp = jax.vjp(lambda x: depth.rms_inverse(x, eps), written(buffer_KBTD))
  (d_written_JBTD,) = rms_vjp(written(d_inv_rms_KBT))
  d_buffer_KBTD = jax.lax.dynamic_update_slice_in_dim(
    d_buffer_KBTD,
    written(d_buffer_KBTD) + d_written_JBTD.astype(d_buffer_KBTD.dtype),
    chunk_first,
    0,
  )
  d_inv_rms_KBT = jax.lax.dynamic_update_slice_in_dim(
    d_inv_rms_KBT, jnp.zeros_like(written(d_inv_rms_KBT)), chunk_first, 0
  )
  return d_buffer_KBTD, d_inv_rms_KBT


def _full_segment_step(plan, inputs, d_carry, xs):
  """The reverse scan's body: the cotangents through full segment `index`."""
  index, saved = xs
  layer_state, size = inputs.layer_state, plan.residual.segment_layers
  d_buffer_KBTD, d_states, d_inv_rms_KBT = backward_segment.segment_backward(
    plan,
    inputs.buffer_KBTD,
    d_carry[0],
    inputs.received(d_carry[1]),
    stack_lib.index_segment_layers(layer_state, index, size),
    inputs.offset + index,
    saved,
    inputs.positions_BT,
    inputs.embedding_BTD,
    plan.expected_valid,
  )
  d_segment = jax.tree.map(  # [G, ...], in the parameters' dtype
    lambda x, *d: jnp.stack(d).astype(x.dtype), layer_state, *d_states
  )
  if plan.resumed:  # the scan's output (below)
    if plan.pin_chunk_cotangent:  # see `_plan`
      d_buffer_KBTD = pallas_mesh.width_minor(d_buffer_KBTD, sharding.DEPTH_BUFFER)
    return (d_buffer_KBTD, d_inv_rms_KBT, None), d_segment
  # Written in place into the gradients of all layers [L, ...]: as the scan's output,
  # [segments, G, ...], the optimizer's fusions would not see through the reshape
  # (bench/aot.py, d1024 v5p-8: they wrote the moments in that layout and read them
  # back). A pipeline chunk's go to the schedule's sum, not to the optimizer, and the
  # stages' vmap batches the in-place write as a scatter of all [L, ...] per segment:
  # there, the scan's output (bench/pipeline.py v5p, Block S=4 at P=2 V=1: 81.5 ->
  # 81.1 ms).
  d_layers = jax.tree.map(
    lambda d_all, d: jax.lax.dynamic_update_slice_in_dim(d_all, d, index * size, 0),
    d_carry[2],
    d_segment,
  )
  return (d_buffer_KBTD, d_inv_rms_KBT, d_layers), None


def _full_segments_backward(plan, inputs, d_buffer_KBTD, d_inv_rms_KBT, full_saved):
  """The reverse scan over the full segments: (d_buffer, d_inv_rms, the layers'
  cotangents [full segments' layers, ...])."""
  layer_state = inputs.layer_state
  num_full = plan.num_layers // plan.residual.segment_layers
  size = plan.residual.segment_layers
  zeros = jax.tree.map(lambda x: jnp.zeros_like(x[: num_full * size]), layer_state)
  (d_buffer_KBTD, d_inv_rms_KBT, d_full), d_ys = jax.lax.scan(
    functools.partial(_full_segment_step, plan, inputs),
    (d_buffer_KBTD, d_inv_rms_KBT, None if plan.resumed else zeros),
    (jnp.arange(num_full), full_saved),
    reverse=True,
  )
  if plan.resumed:  # [segments, G, ...] -> [L, ...]
    d_full = jax.tree.map(lambda y: y.reshape(-1, *y.shape[2:]), d_ys)
  return d_buffer_KBTD, d_inv_rms_KBT, d_full


def _backward(plan, kept, d_out):
  layer_state, buffer_KBTD, inv_rms_in_KBT, segment_offset = kept[:4]
  positions_BT, (full_saved, tail_saved) = kept[4:]
  residual = plan.residual
  offset = segment_offset if plan.resumed else 0
  d_buffer_KBTD, d_inv_rms_KBT, chunk_first = d_out, None, None
  if plan.resumed:
    chunk_first = residual.first_local_slot(offset)
    d_buffer_KBTD, d_inv_rms_KBT = _through_written_inv_rms(
      plan, buffer_KBTD, d_out, chunk_first
    )
  size = residual.segment_layers
  num_full = plan.num_layers // size
  # The full segments index their layers in the whole stack (no grouped copy).
  _, tail_states = stack_lib.group_segments(layer_state, plan.num_layers, size)
  # With the kernel layout, slot 0 sliced once, outside the reverse scan: sliced in
  # it, every trip relayouted it (d1024 v5p:2x2x1 full/bf16/pallas: 52.2 ms, against
  # 51.14).
  inputs = _Inputs(
    layer_state,
    buffer_KBTD,
    inv_rms_in_KBT,
    chunk_first,
    offset,
    positions_BT,
    buffer_KBTD[0] if plan.kernel_layout else None,
  )
  d_full = d_tail = None
  if tail_states is not None:
    d_buffer_KBTD, d_tail, d_inv_rms_KBT = backward_segment.segment_backward(
      plan,
      buffer_KBTD,
      d_buffer_KBTD,
      inputs.received(d_inv_rms_KBT),
      tail_states,
      offset + num_full,
      tail_saved,
      positions_BT,
      inputs.embedding_BTD,
    )
  if num_full:
    d_buffer_KBTD, d_inv_rms_KBT, d_full = _full_segments_backward(
      plan, inputs, d_buffer_KBTD, d_inv_rms_KBT, full_saved
    )
  if d_tail is not None:
    d_tail = jax.tree.map(lambda *y: jnp.stack(y), *d_tail)
  parts = [d for d in (d_full, d_tail) if d is not None]
  d_layer_state = (
    parts[0] if len(parts) == 1 else jax.tree.map(lambda *y: jnp.concatenate(y), *parts)
  )
  d_layer_state = jax.tree.map(lambda d, x: d.astype(x.dtype), d_layer_state, layer_state)
  if plan.resumed:  # the received carry's cotangent
    d_start = plan.carry_type(d_buffer_KBTD.astype(buffer_KBTD.dtype), d_inv_rms_KBT)
  else:  # the embedding's, in its own dtype (the buffer may store another)
    d_start = d_buffer_KBTD[0].astype(plan.start_dtype)
  return d_layer_state, d_start, None, None
