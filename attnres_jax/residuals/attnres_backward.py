"""The linear-memory backward pass of the AttnRes block schedule.

Plain autodiff of the segment scan keeps the whole depth buffer once per segment (it
is in the carry and Phase 1 reads it), so memory grows with depth squared. But the
buffer is append-only: a segment only writes its own slots, which are zero before it
and final after it, so every segment's view of the buffer can be rebuilt from the
final one. This custom VJP keeps the final buffer once, plus per sublayer what plain
autodiff would keep of the sublayer itself (its VJP closure; the layer parameters in
it are forwarded by the scans, not copied) and, for Block, the running partial sum
the sublayer read. The backward pass runs the segments in reverse: Phase 1 is
recomputed and differentiated once per segment (its cotangents summed over the
segment's sublayers), Phase 2 once per sublayer. Contract: gradients equal plain
autodiff of the same schedule (tests/test_memory.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from attnres_jax import depth
from attnres_jax import sharding
from attnres_jax import stack as stack_lib


def _saveable(primitive, *avals, **params) -> bool:
  """What the sublayer's VJP closure keeps: everything computed from a float value,
  as plain autodiff keeps it. Values computed from integers and booleans alone (the
  causal mask from iotas, position indices) are recomputed in the backward pass:
  plain autodiff of a scan saves such loop-invariant values once, but a closure that
  this backward's scan returns would stack them once per segment (for attention, a
  boolean [B, N, T, T] mask per layer)."""
  del primitive, params
  return any(jnp.issubdtype(aval.dtype, jnp.inexact) for aval in avals)


def keeping_float_residuals(fn):
  """`fn` whose VJP keeps what `_saveable` allows and recomputes the rest."""
  return jax.checkpoint(fn, policy=_saveable, prevent_cse=False)


def make_stack(residual):
  """fn(graphdef, layer_state, x_BTD, positions_BT) -> the residual's final (buffer,
  inverse RMS); `residual` is an `attnres.AttnResResidual` (two-phase reads)."""
  cfg = residual.cfg
  eps = cfg.attn_res_eps

  def run(graphdef, layer_state, x_BTD, positions_BT):
    """The final buffer and its inverse RMS after all layers."""
    functions = [
      stack_lib.sublayer_function(graphdef, which, cfg.remat == 'sublayer')
      for which in stack_lib.SUBLAYERS
    ]
    keeps_partial = residual.block_size > 1  # Full: a sublayer's own slot starts empty
    recompute_sublayers = cfg.remat == 'layer'

    def sublayer_vjp(which, state_k, h_BTD, positions_BT):
      apply = lambda s, h: functions[which](s, h, positions_BT)
      if cfg.remat == 'none':  # under remat the closure keeps its own (less)
        apply = keeping_float_residuals(apply)
      return jax.vjp(apply, state_k, h_BTD)

    def forward(layer_state, x_BTD, positions_BT):
      def apply_sublayer(which, layer_in_segment, state_k, h_BTD, inner, extra):
        del extra
        index, _ = residual.local_index(layer_in_segment, which)
        partial_BTD = inner.local_JBTD[index] if keeps_partial else None
        if recompute_sublayers:
          return functions[which](state_k, h_BTD, positions_BT), (partial_BTD, None)
        out_BTD, vjp_fn = sublayer_vjp(which, state_k, h_BTD, positions_BT)
        return out_BTD, (partial_BTD, vjp_fn)

      carry, (full_ys, tail_ys) = stack_lib.run_layers(
        residual,
        graphdef,
        layer_state,
        x_BTD,
        positions_BT,
        cfg=cfg,
        apply_sublayer=apply_sublayer,
      )
      buffer_KBTD = carry.buffer_KBTD
      saved = tuple(
        None if ys is None else tuple(y[0] for y in ys) for ys in (full_ys, tail_ys)
      )
      return buffer_KBTD, (layer_state, buffer_KBTD, positions_BT, saved)

    def segment_backward(
      buffer_KBTD, d_buffer_KBTD, layer_states, segment, saved, positions_BT
    ):
      """Cotangents through one segment: (d_buffer before it, d_layer_states)."""
      num_layers = len(layer_states)
      first = residual.first_local_slot(segment)
      num_local = residual.local_slots(num_layers)

      def phase1(buffer_KBTD, layer_states):
        params = stack_lib.stacked_residual_params(graphdef, layer_states)
        return residual.phase1(buffer_KBTD, params, first)

      stats, phase1_vjp = jax.vjp(phase1, buffer_KBTD, layer_states)
      # The segment's slots: final values, and the cotangent they got after it ended.
      local_JBTD = jax.lax.dynamic_slice_in_dim(buffer_KBTD, first, num_local, 0)
      d_local_JBTD = jax.lax.dynamic_slice_in_dim(d_buffer_KBTD, first, num_local, 0)
      d_buffer_KBTD = jax.lax.dynamic_update_slice_in_dim(
        d_buffer_KBTD, jnp.zeros_like(d_local_JBTD), first, 0
      )
      d_layer_states, d_stats = [None] * num_layers, [None] * num_layers
      d_embedding_sum_BTD = None  # the first sublayer's read (see AttnResResidual.merge)
      for j in reversed(range(num_layers)):
        state_j, d_stats_j = layer_states[j], [None, None]
        for which in reversed(stack_lib.SUBLAYERS):
          index, _ = residual.local_index(j, which)
          partial_BTD, vjp_fn = saved[j][which]
          # The local slots as this sublayer read them: earlier ones complete, its own
          # holding the partial sum it saw (Full: empty, and not read).
          view_JBTD = (
            local_JBTD if partial_BTD is None else local_JBTD.at[index].set(partial_BTD)
          )

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
            )

          mine = stats[j][which]
          h_BTD, read_vjp = jax.vjp(read, mine, view_JBTD, state_j, buffer_KBTD[0])
          if vjp_fn is None:
            _, vjp_fn = sublayer_vjp(which, state_j, h_BTD, positions_BT)
          # The write's cotangent, in the dtype of the sublayer's output.
          d_state_f, d_h_BTD = vjp_fn(d_local_JBTD[index].astype(h_BTD.dtype))
          d_stats_j[which], d_view_JBTD, d_state_read, d_embedding_BTD = read_vjp(d_h_BTD)
          d_embedding_sum_BTD = (
            d_embedding_BTD
            if d_embedding_sum_BTD is None
            else d_embedding_sum_BTD + d_embedding_BTD
          )
          # Slot `index` before the write is the partial sum: its cotangent passes
          # through the write unchanged and gains the read's.
          d_local_JBTD = sharding.constrain(
            d_local_JBTD + d_view_JBTD, sharding.DEPTH_BUFFER
          )
          for d in (d_state_f, d_state_read):
            d_layer_states[j] = (
              d
              if d_layer_states[j] is None
              else jax.tree.map(jnp.add, d_layer_states[j], d)
            )
        d_stats[j] = tuple(d_stats_j)  # as Phase 1 returned them: nothing stacked
      d_buffer_phase1, d_states_phase1 = phase1_vjp(d_stats)
      d_layer_states = jax.tree.map(jnp.add, tuple(d_layer_states), d_states_phase1)
      d_buffer_KBTD = d_buffer_KBTD + d_buffer_phase1
      d_buffer_KBTD = sharding.constrain(
        d_buffer_KBTD.at[0].add(d_embedding_sum_BTD.astype(d_buffer_KBTD.dtype)),
        sharding.DEPTH_BUFFER,
      )
      return d_buffer_KBTD, d_layer_states

    def backward(residuals, d_buffer_KBTD):
      layer_state, buffer_KBTD, positions_BT, (full_saved, tail_saved) = residuals
      size = residual.segment_layers
      num_full = cfg.num_layers // size
      full_states, tail_states = stack_lib.group_segments(
        layer_state, cfg.num_layers, size
      )
      d_full = d_tail = None
      if tail_states is not None:
        d_buffer_KBTD, d_tail = segment_backward(
          buffer_KBTD, d_buffer_KBTD, tail_states, num_full, tail_saved, positions_BT
        )
      if full_states is not None:

        def body(d_buffer_KBTD, xs):
          grouped_states, segment, saved = xs
          d_buffer_KBTD, d_states = segment_backward(
            buffer_KBTD,
            d_buffer_KBTD,
            stack_lib.segment_layers_of(grouped_states, size),
            segment,
            saved,
            positions_BT,
          )
          # Stacked over the segment's layers: the scan writes them in the grouped
          # layout, which is the stacked one [L, ...] reshaped (no copy to regroup).
          return d_buffer_KBTD, jax.tree.map(lambda *d: jnp.stack(d), *d_states)

        d_buffer_KBTD, d_full = jax.lax.scan(
          body,
          d_buffer_KBTD,
          (full_states, jnp.arange(num_full), full_saved),
          reverse=True,
        )
      d_layer_state = stack_lib.ungroup_layers((d_full, d_tail))
      d_layer_state = jax.tree.map(
        lambda d, x: d.astype(x.dtype), d_layer_state, layer_state
      )
      # The embedding's cotangent in its own dtype (the buffer may store another).
      return d_layer_state, d_buffer_KBTD[0].astype(x_BTD.dtype), None

    @jax.custom_vjp
    def buffer_after_layers(layer_state, x_BTD, positions_BT):
      carry, _ = stack_lib.run_layers(
        residual, graphdef, layer_state, x_BTD, positions_BT, cfg=cfg
      )
      return carry.buffer_KBTD

    buffer_after_layers.defvjp(forward, backward)
    buffer_KBTD = buffer_after_layers(layer_state, x_BTD, positions_BT)
    # The final read takes each slot's inverse RMS from the carry; computing it here,
    # outside the custom VJP, lets autodiff carry its cotangent into the buffer.
    return buffer_KBTD, depth.rms_inverse(buffer_KBTD, eps)

  return run
