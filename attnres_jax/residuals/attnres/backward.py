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
segments in reverse: Phase 1 is recomputed (or, with the Phase 1 kernel, its results
kept from the forward pass: `model.phase1_backward`) and differentiated once per
segment (its cotangents summed over the segment's sublayers), Phase 2 once per
sublayer.
Contract: gradients equal plain autodiff of the same schedule (tests/residuals/test_memory.py).

The same backward runs a pipeline chunk (`pipeline.py`): layers in the middle of the
model, resumed from the carry the chunk received (buffer and inverse RMS), whose
cotangents it returns (tests/parallel/test_pipeline.py).
"""

from __future__ import annotations

import contextlib
import types

import jax
import jax.numpy as jnp
from flax import nnx

from attnres_jax.residuals.attnres import depth
from attnres_jax.kernels import depth_pallas
from attnres_jax.kernels import pallas_mesh
from attnres_jax.nn import sharding
from attnres_jax.nn import stack as stack_lib
from attnres_jax.residuals.attnres import schedule as attnres_schedule
from attnres_jax.residuals.attnres.float_residuals import keeping_float_residuals


def make_stack(residual):
  """fn(graphdef, layer_state, start, positions_BT, segment_offset=None) -> (buffer,
  inverse RMS) after the layers of `layer_state` ([n, ...]); `residual` is an
  `attnres.AttnResResidual` (two-phase reads). `start`: the embedding [B, T, D] (all
  layers, `segment_offset` None), or the carry a pipeline chunk received (a
  `DepthCarry`, the chunk starting on a block boundary at model segment
  `segment_offset`, which may be traced); then its cotangent is the carry's."""
  cfg = residual.cfg
  eps = cfg.attn_res_eps

  def run(graphdef, layer_state, start, positions_BT, segment_offset=None):
    resumed = segment_offset is not None
    num_layers = jax.tree.leaves(layer_state)[0].shape[0]
    if resumed and (2 * num_layers) % residual.block_size:
      raise ValueError(f'A chunk of {num_layers} layers does not cover whole blocks.')
    stack_cfg = types.SimpleNamespace(
      num_layers=num_layers, remat=cfg.remat, scan_layers=cfg.scan_layers
    )
    carry_type = type(start)
    halves = [stack_lib.sublayer_halves(graphdef, w) for w in stack_lib.SUBLAYERS]

    def sublayer(which, state, h_BTD, positions_BT):
      """The whole sublayer (remat='layer' reruns it): its norm, then its body."""
      norm, body = halves[which]
      return body(state, norm(state, h_BTD), positions_BT)

    keeps_partial = residual.block_size > 1  # Full: a sublayer's own slot starts empty
    # With the Phase 1 kernel: the buffer and Phase 1's cotangent of it have the
    # kernel's layout (tokens on the lanes), Phase 1's cotangent is summed into the
    # carried one by its backward kernel (`depth_pallas.cotangent_into`: width on the
    # lanes, in place), and slot 0 is sliced once, outside the reverse scan. For
    # Block the separate sum read the carried [K, B, T, D] cotangent twice and wrote
    # it once a segment (bench/aot.py d1024 v5p:2x2x1, block:4/bf16/pallas, data /
    # FSDP: HBM 70.6 -> 69.9 / 65.5 -> 64.7 GB, cycles 1.053x -> 1.030x / 1.094x ->
    # 1.067x the standard's, the estimate unchanged, temp +0.05-0.06 GiB; with the
    # kernel's sum but slot 0 sliced in the scan, a relayout copy of the buffer took
    # the sum's place). Each
    # segment's slots are sliced from the final buffer inside the reverse scan, as
    # without the kernel: sliced once before it, all of them at once, that copy cost
    # more than the per-segment slices (d1024 v5p:2x2x1 full/bf16/pallas: 51.60 ->
    # 51.14 ms, temp 12.56 -> 12.06 GiB). Not for Block's pipeline chunks: there it
    # measured slower (bench/pipeline.py v5p:2x2x1 P=2 M=4 remat, block:4/bf16/pallas:
    # V=1 78.02 -> 79.8 ms, temp 4.87 -> 5.05 GiB; V=2 74.26 -> 75.0 ms).
    kernel_layout = cfg.depth_kernel == 'pallas' and not (keeps_partial and resumed)
    # Full's pipeline chunks also pin their carried cotangent width-minor per segment:
    # under the stages' vmap the compiler held it tokens-minor in the reverse scan and
    # copied it to and from the kernel's layout every trip (bench/pipeline.py v5p,
    # P=2 V=1, full/bf16/pallas: 93.60 -> 91.60 ms). Block's got slower pinned
    # (block:4/bf16/pallas V=2: 74.89 -> 78.90 ms).
    pin_chunk_cotangent = kernel_layout and not keeps_partial
    recompute_sublayers = cfg.remat == 'layer'
    # What the Phase 1 kernels' cost estimates charge a call in the scan over the full
    # segments (`first`, their num_valid, traced there): the mean of `first` over the
    # scan's segments, exactly the slots the kernels load on average. A tail segment's
    # `first` is a Python int, charged itself. Not for a chunk (its offset is traced).
    num_full = num_layers // residual.segment_layers
    expected_valid = None
    if cfg.depth_kernel == 'pallas' and not resumed and num_full:
      firsts = [residual.first_local_slot(s) for s in range(num_full)]
      expected_valid = sum(firsts) / num_full
    # Phase 1's results kept from the forward pass for the backward's merges and the
    # kernel's VJP, rather than computed again (`attnres_schedule.keeps_phase1`).
    keeps_phase1 = expected_valid is not None and attnres_schedule.keeps_phase1(
      cfg.phase1_backward, expected_valid, 2 * residual.segment_layers
    )
    phase1_costs = lambda: (
      contextlib.nullcontext()
      if expected_valid is None
      else depth_pallas.expected_valid(expected_valid)
    )

    def run_segments(layer_state, start, segment_offset, positions_BT, **kwargs):
      """The stack's layers from `start` (resumed at `segment_offset` for a chunk),
      the kernels charged as stated above."""
      runner = stack_lib.Resumed(residual, segment_offset) if resumed else residual
      with phase1_costs():
        return stack_lib.run_layers(
          runner,
          graphdef,
          layer_state,
          start,
          positions_BT,
          cfg=stack_cfg,
          index_layers=True,
          **kwargs,
        )

    def body_vjp(which, state_k, h_BTD, positions_BT):
      """A sublayer's output and the VJP of its body (after the PreNorm), the part
      kept for the backward: the norm's input is the read's output, which the
      backward recomputes anyway, so the norm is rerun there from it rather than its
      float32 input kept (bench/aot.py d1024 v5p:2x2x1, block:4/bf16/pallas: temp
      12.98 -> 11.48 GiB, 48.50 -> 47.89 ms)."""
      apply = lambda s, normed: halves[which][1](s, normed, positions_BT)
      if cfg.remat == 'sublayer':  # the closure keeps the normed input alone
        apply = jax.checkpoint(apply)
      else:
        apply = keeping_float_residuals(apply)
      return jax.vjp(apply, state_k, halves[which][0](state_k, h_BTD))

    def sublayer_backward(which, state_j, h_BTD, saved_vjp, d_out_BTD, positions_BT):
      """(the layer state's cotangents, the input's) of one sublayer: through its
      kept body VJP and the norm rerun, or (remat='layer', none kept) all rerun."""
      if saved_vjp is None:
        apply = lambda s, h: sublayer(which, s, h, positions_BT)
        d_state, d_h_BTD = jax.vjp(apply, state_j, h_BTD)[1](d_out_BTD)
        return [d_state], d_h_BTD
      _, norm_vjp = jax.vjp(halves[which][0], state_j, h_BTD)
      d_state_body, d_normed_BTD = saved_vjp(d_out_BTD)
      d_state_norm, d_h_BTD = norm_vjp(d_normed_BTD)
      return [d_state_body, d_state_norm], d_h_BTD

    def forward(layer_state, start, segment_offset, positions_BT):
      def apply_sublayer(
        which, layer_in_segment, state_k, h_BTD, inner, extra, per_layer
      ):
        del extra
        index, num_valid = residual.local_index(layer_in_segment, which)
        # The partial sum in its own slot, kept where the sublayer reads it (Block, not
        # first in its block; the first reads no slot of its block, which is zero).
        reads_own = keeps_partial and num_valid > index
        partial_BTD = inner.local_JBTD[index] if reads_own else None
        phase1_kept = per_layer[which] if keeps_phase1 else None
        if recompute_sublayers:
          out_BTD = sublayer(which, state_k, h_BTD, positions_BT)
          return out_BTD, (partial_BTD, None, phase1_kept)
        out_BTD, saved_vjp = body_vjp(which, state_k, h_BTD, positions_BT)
        return out_BTD, (partial_BTD, saved_vjp, phase1_kept)

      carry, (full_ys, tail_ys) = run_segments(
        layer_state, start, segment_offset, positions_BT, apply_sublayer=apply_sublayer
      )
      buffer_KBTD = carry.buffer_KBTD
      saved = tuple(
        None if ys is None else tuple(y[0] for y in ys) for ys in (full_ys, tail_ys)
      )
      # Resumed: what the chunk received of the inverse RMS (Phase 1 read it).
      inv_rms_in_KBT = start.inv_rms_KBT if resumed else None
      residuals = (layer_state, buffer_KBTD, inv_rms_in_KBT, segment_offset)
      return (carry if resumed else buffer_KBTD), (*residuals, positions_BT, saved)

    def segment_backward(
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
      resumed, the received inverse RMS' cotangent). `received`: None, or (the
      received inverse RMS, its cotangent so far, the chunk's first slot).
      `embedding_BTD`: slot 0 of the final buffer if the caller sliced it (outside
      the segments' scan), else None. `mean_valid`: what the Phase 1 kernels' cost
      estimates charge for a traced `first` (the mean over the scan's segments)."""
      num_layers = len(layer_states)
      first = residual.first_local_slot(segment)
      num_local = residual.local_slots(num_layers)

      # Phase 1's results as the forward pass kept them, else computed again here.
      kept = [tuple(s[2] for s in saved_j) for saved_j in saved] if keeps_phase1 else None

      def phase1(buffer_KBTD, layer_states, *inv_rms_in_KBT):
        params = stack_lib.stacked_residual_params(graphdef, layer_states)
        inv_rms_KBT = None  # from the buffer, as the forward computed it
        if inv_rms_in_KBT:  # the received slots' as the forward read them
          received_K = jnp.arange(buffer_KBTD.shape[0]) < received[2]
          inv_rms_KBT = jnp.where(
            received_K[:, None, None],
            inv_rms_in_KBT[0],
            depth.rms_inverse(buffer_KBTD, eps),
          )
        return residual.phase1(buffer_KBTD, params, first, inv_rms_KBT, kept=kept)

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
      if not kernel_layout:  # there, Phase 1's VJP zeroes them
        d_buffer_KBTD = jax.lax.dynamic_update_slice_in_dim(
          d_buffer_KBTD, jnp.zeros_like(d_local_JBTD), first, 0
        )
      # Each slot's cotangent apart, width-minor: a sublayer's read adds to the slots
      # it read alone. As one [J, ...] array every read's add wrote all J slots; apart
      # with no layout pinned, the compiler laid them tokens-minor and relayouted the
      # carried cotangent around the fused Phase 1 backward every segment (bench/aot.py
      # d1024 v5p:2x2x1, full/bf16/pallas: 53.84 ms; 54.28 apart; 52.78 pinned).
      d_slots = [pallas_mesh.width_minor(d_local_JBTD[s]) for s in range(num_local)]
      d_layer_states, d_stats = [None] * num_layers, [None] * num_layers
      d_embedding_sum_BTD = None  # the first sublayer's read (see AttnResResidual.merge)
      for j in reversed(range(num_layers)):
        state_j, d_stats_j = layer_states[j], [None, None]
        for which in reversed(stack_lib.SUBLAYERS):
          index, num_valid = residual.local_index(j, which)
          partial_BTD, saved_vjp, _ = saved[j][which]
          # The local slots as this sublayer read them: earlier ones complete, its own
          # holding the partial sum it saw (when not read, Full or first in its block,
          # left as it is: its weight is zero).
          view_JBTD = (
            local_JBTD if partial_BTD is None else local_JBTD.at[index].set(partial_BTD)
          )
          view_JBTD = view_JBTD[:num_valid] if num_valid else None  # the slots read

          def read(stats_mine, view_JBTD, state_j, embedding_BTD, j=j, which=which):
            params = nnx.merge(graphdef, state_j).residual
            return residual.merge(
              stats_mine,
              view_JBTD,
              params.query[...][which],
              params.gain[...][which],
              j,
              which,
              first,
              embedding_BTD,
              num_local=num_local,
            )

          mine = stats[j][which]
          h_BTD, read_vjp = jax.vjp(read, mine, view_JBTD, state_j, embedding_BTD)
          # The write's cotangent, in the dtype of the sublayer's output.
          d_states, d_h_BTD = sublayer_backward(
            which,
            state_j,
            h_BTD,
            saved_vjp,
            d_slots[index].astype(h_BTD.dtype),
            positions_BT,
          )
          d_stats_j[which], d_view_JBTD, d_state_read, d_embedding_BTD = read_vjp(d_h_BTD)
          d_embedding_sum_BTD = (
            d_embedding_BTD
            if d_embedding_sum_BTD is None
            else d_embedding_sum_BTD + d_embedding_BTD
          )
          # Slot `index` before the write is the partial sum: its cotangent passes
          # through the write unchanged and gains the read's.
          for s in range(num_valid):
            d_slots[s] = pallas_mesh.width_minor(d_slots[s] + d_view_JBTD[s])
          for d in d_states + [d_state_read]:
            d_layer_states[j] = (
              d
              if d_layer_states[j] is None
              else jax.tree.map(jnp.add, d_layer_states[j], d)
            )
        d_stats[j] = tuple(d_stats_j)  # as Phase 1 returned them: nothing stacked
        if cfg.backward_layer_barrier:
          # Layer j's gradients (its weight-gradient matmuls) complete before layer
          # j - 1's backward starts: left free, the compiler interleaves the two and
          # holds both layers' temporaries at once.
          d_slots, d_layer_states[j] = jax.lax.optimization_barrier(
            (d_slots, d_layer_states[j])
          )
      with (
        depth_pallas.cotangent_into(  # the kernel sums all into the carry, in place
          d_buffer_KBTD, num_zeroed=num_local, d_first_BTD=d_embedding_sum_BTD
        )
        if kernel_layout  # and zeroes the segment's slots
        else contextlib.nullcontext()
      ):
        d_buffer_phase1, d_states_phase1, *d_inv_rms_phase1 = phase1_vjp(d_stats)
      d_layer_states = jax.tree.map(jnp.add, tuple(d_layer_states), d_states_phase1)
      if kernel_layout:  # the carry, Phase 1's and the embedding's, summed in place
        d_buffer_KBTD = d_buffer_phase1
      else:
        d_buffer_KBTD = d_buffer_KBTD + d_buffer_phase1
        d_embedding_BTD = d_embedding_sum_BTD.astype(d_buffer_KBTD.dtype)
        if keeps_partial:  # Block: zero-padded to the carry, in the same sum (one
          # pass, no slot update; bench/aot.py d1024 v5p-8: 0.2 GB less). Full
          # without the kernel: the slot update (the padded sum moved 0.4 GB more).
          d_buffer_KBTD = d_buffer_KBTD + jnp.pad(
            d_embedding_BTD[None], [(0, d_buffer_KBTD.shape[0] - 1)] + [(0, 0)] * 3
          )
        else:
          d_buffer_KBTD = d_buffer_KBTD.at[0].add(d_embedding_BTD)
      d_buffer_KBTD = sharding.constrain(d_buffer_KBTD, sharding.DEPTH_BUFFER)
      d_inv_rms_KBT = received[1] + d_inv_rms_phase1[0] if received else None
      return d_buffer_KBTD, d_layer_states, d_inv_rms_KBT

    def through_written_inv_rms(buffer_KBTD, d_carry, chunk_first):
      """Resumed: the output carry's cotangents split into the buffer's (the chunk's
      slots also get their inverse RMS's, computed from them) and the received
      inverse RMS' (the slots the chunk passes on unchanged)."""
      d_buffer_KBTD, d_inv_rms_KBT = d_carry
      num_written = residual.local_slots(num_layers)
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

    def backward(residuals, d_out):
      layer_state, buffer_KBTD, inv_rms_in_KBT, segment_offset = residuals[:4]
      positions_BT, (full_saved, tail_saved) = residuals[4:]
      offset = segment_offset if resumed else 0
      d_buffer_KBTD, d_inv_rms_KBT, chunk_first = d_out, None, None
      if resumed:
        chunk_first = residual.first_local_slot(offset)
        d_buffer_KBTD, d_inv_rms_KBT = through_written_inv_rms(
          buffer_KBTD, d_out, chunk_first
        )
      received = lambda d_inv_rms_KBT: (
        (inv_rms_in_KBT, d_inv_rms_KBT, chunk_first) if resumed else None
      )
      size = residual.segment_layers
      num_full = num_layers // size
      # The full segments index their layers in the whole stack (no grouped copy).
      _, tail_states = stack_lib.group_segments(layer_state, num_layers, size)
      d_full = d_tail = None
      # With `kernel_layout`, slot 0 sliced once, outside the reverse scan: sliced
      # in it, every trip relayouted it (d1024 v5p:2x2x1 full/bf16/pallas: 52.2 ms,
      # against 51.14).
      embedding_BTD = buffer_KBTD[0] if kernel_layout else None
      if tail_states is not None:
        d_buffer_KBTD, d_tail, d_inv_rms_KBT = segment_backward(
          buffer_KBTD,
          d_buffer_KBTD,
          received(d_inv_rms_KBT),
          tail_states,
          offset + num_full,
          tail_saved,
          positions_BT,
          embedding_BTD,
        )
      if num_full:

        def body(d_carry, xs):
          index, saved = xs
          d_buffer_KBTD, d_states, d_inv_rms_KBT = segment_backward(
            buffer_KBTD,
            d_carry[0],
            received(d_carry[1]),
            stack_lib.index_segment_layers(layer_state, index, size),
            offset + index,
            saved,
            positions_BT,
            embedding_BTD,
            expected_valid,
          )
          d_segment = jax.tree.map(  # [G, ...], in the parameters' dtype
            lambda x, *d: jnp.stack(d).astype(x.dtype), layer_state, *d_states
          )
          if resumed:  # the scan's output (below)
            if pin_chunk_cotangent:  # see above
              d_buffer_KBTD = pallas_mesh.width_minor(
                d_buffer_KBTD, sharding.DEPTH_BUFFER
              )
            return (d_buffer_KBTD, d_inv_rms_KBT, None), d_segment
          # Written in place into the gradients of all layers [L, ...]: as the scan's
          # output, [segments, G, ...], the optimizer's fusions would not see through
          # the reshape (bench/aot.py, d1024 v5p-8: they wrote the moments in that
          # layout and read them back). A pipeline chunk's go to the schedule's sum,
          # not to the optimizer, and the stages' vmap batches the in-place write as a
          # scatter of all [L, ...] per segment: there, the scan's output
          # (bench/pipeline.py v5p, Block S=4 at P=2 V=1: 81.5 -> 81.1 ms).
          d_layers = jax.tree.map(
            lambda d_all, d: jax.lax.dynamic_update_slice_in_dim(
              d_all, d, index * size, 0
            ),
            d_carry[2],
            d_segment,
          )
          return (d_buffer_KBTD, d_inv_rms_KBT, d_layers), None

        zeros = jax.tree.map(lambda x: jnp.zeros_like(x[: num_full * size]), layer_state)
        (d_buffer_KBTD, d_inv_rms_KBT, d_full), d_ys = jax.lax.scan(
          body,
          (d_buffer_KBTD, d_inv_rms_KBT, None if resumed else zeros),
          (jnp.arange(num_full), full_saved),
          reverse=True,
        )
        if resumed:  # [segments, G, ...] -> [L, ...]
          d_full = jax.tree.map(lambda y: y.reshape(-1, *y.shape[2:]), d_ys)
      if d_tail is not None:
        d_tail = jax.tree.map(lambda *y: jnp.stack(y), *d_tail)
      parts = [d for d in (d_full, d_tail) if d is not None]
      d_layer_state = (
        parts[0]
        if len(parts) == 1
        else jax.tree.map(lambda *y: jnp.concatenate(y), *parts)
      )
      d_layer_state = jax.tree.map(
        lambda d, x: d.astype(x.dtype), d_layer_state, layer_state
      )
      if resumed:  # the received carry's cotangent
        d_start = carry_type(d_buffer_KBTD.astype(buffer_KBTD.dtype), d_inv_rms_KBT)
      else:  # the embedding's, in its own dtype (the buffer may store another)
        d_start = d_buffer_KBTD[0].astype(start.dtype)
      return d_layer_state, d_start, None, None

    @jax.custom_vjp
    def after_layers(layer_state, start, segment_offset, positions_BT):
      carry, _ = run_segments(layer_state, start, segment_offset, positions_BT)
      return carry if resumed else carry.buffer_KBTD

    after_layers.defvjp(forward, backward)
    out = after_layers(layer_state, start, segment_offset, positions_BT)
    if resumed:
      return out
    # The final read takes each slot's inverse RMS from the carry; computing it here,
    # outside the custom VJP, lets autodiff carry its cotangent into the buffer.
    return out, depth.rms_inverse(out, eps)

  return run
