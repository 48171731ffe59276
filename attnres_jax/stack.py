"""Applying the stacked Transformer layers: scan or unrolled loop, remat, and the
linear-memory backward pass of the AttnRes source buffer.

The depth state that travels between layers is the residual stream [B, T, D]
('standard') or the AttnRes buffer [N + 1, B, T, D] ('full', 'block'; see `depth.py`).

Why a custom backward pass: when the whole buffer is in the scan carry and every layer
reads it, autodiff saves one copy of the buffer per layer, so memory grows as L^2. But
the buffer is append-only (a slot is only ever added to by the sublayers of its own
block, and read-only afterwards), so each layer's view of it can be rebuilt from the
final buffer plus, for Block, the running partial sum of the current block. The custom
VJP below keeps the final buffer once, saves each sublayer's ordinary residuals (as
plain autodiff would, minus the buffer), and recomputes the cheap depth reads in a
reverse scan. Memory is then linear in depth. Gradients equal plain autodiff (tests).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from attnres_jax import config as config_lib
from attnres_jax import depth

SUBLAYERS = (0, 1)  # attention, MLP


def _sublayer_function(graphdef, which: int, remat: bool):
  """f(layer_state, h, positions) -> raw output of one sublayer, as a pure function."""

  def apply(layer_state, h_BTD, positions_BT):
    return nnx.merge(graphdef, layer_state).sublayer(which, h_BTD, positions_BT)

  return jax.checkpoint(apply) if remat else apply


def _read(graphdef, cfg, layer_state, buffer_SBTD, which, sublayer):
  """The depth read that forms the input of `sublayer` (global 0-based index)."""
  layer = nnx.merge(graphdef, layer_state)
  return depth.attn_res_read(
      buffer_SBTD, layer.depth_query[...][which], layer.depth_gain[...][which],
      eps=cfg.attn_res_eps,
      num_valid=depth.num_valid_sources(sublayer, config_lib.effective_block_size(cfg)))


def _add_to_slot(buffer_SBTD, slot, out_BTD):
  updated = jax.lax.dynamic_index_in_dim(buffer_SBTD, slot, 0, keepdims=False) + out_BTD
  return jax.lax.dynamic_update_index_in_dim(buffer_SBTD, updated, slot, 0)


def _token_rms(x_BTD):
  """Mean over tokens of the RMS over features."""
  return jnp.mean(1.0 / depth.rms_inverse(x_BTD, 0.0))


def _layer_step(graphdef, cfg, layer_state, state, layer_index, positions_BT,
                collect_stats, cache=None, cache_index=None):
  """Both sublayers of one layer: read the input, apply f, write the output.

  With a KV cache (decoding) returns (state, new cache) instead of (state, stats).
  """
  standard = cfg.residual == 'standard'
  block_size = config_lib.effective_block_size(cfg)
  stats = []
  for which in SUBLAYERS:
    sublayer = 2 * layer_index + which
    if standard:
      h_BTD = state
    else:
      h_BTD, weights_SBT = _read(graphdef, cfg, layer_state, state, which, sublayer)
    if cache is not None:
      layer = nnx.merge(graphdef, layer_state)
      out_BTD = layer.sublayer(which, h_BTD, positions_BT, cache, cache_index)
      if which == 0:
        out_BTD, cache = out_BTD
    else:
      f = _sublayer_function(graphdef, which, cfg.remat == 'sublayer')
      out_BTD = f(layer_state, h_BTD, positions_BT)
    if standard:
      state = state + out_BTD
    else:
      state = _add_to_slot(state, depth.output_slot(sublayer, block_size), out_BTD)
    if collect_stats:
      entry = {'input_rms': _token_rms(h_BTD), 'output_rms': _token_rms(out_BTD)}
      if not standard:
        entry['depth_weights'] = jnp.mean(weights_SBT, axis=(1, 2))
        plogp = jnp.where(weights_SBT > 0, weights_SBT * jnp.log(weights_SBT), 0.0)
        entry['depth_entropy'] = jnp.mean(-jnp.sum(plogp, axis=0))
      stats.append(entry)
  if cache is not None:
    return state, cache
  if collect_stats:
    stats = jax.tree.map(lambda *xs: jnp.stack(xs), *stats)
  return state, (stats if collect_stats else None)


def _plain_stack(graphdef, cfg, layer_state, state, positions_BT, collect_stats):
  """Scan (or unrolled loop) over layers with ordinary autodiff."""
  step = functools.partial(_layer_step, graphdef, cfg,
                           positions_BT=positions_BT, collect_stats=collect_stats)
  if cfg.remat == 'layer':
    step = jax.checkpoint(step)

  if not cfg.scan_layers:
    per_layer = []
    for k in range(cfg.num_layers):
      state_k = jax.tree.map(lambda x: x[k], layer_state)
      state, stats = step(state_k, state, k)
      per_layer.append(stats)
    if collect_stats:
      return state, jax.tree.map(lambda *xs: jnp.stack(xs), *per_layer)
    return state, None

  def body(carry, xs):
    state_k, k = xs
    return step(state_k, carry, k)

  return jax.lax.scan(body, state, (layer_state, jnp.arange(cfg.num_layers)))


def apply_layers(graphdef, layer_state, state, positions_BT, *, cfg,
                 collect_stats=False):
  """Runs the stacked layers on the depth state; returns (final state, stats or None)."""
  use_linear_memory = (
      cfg.residual != 'standard' and cfg.linear_memory_backward and cfg.scan_layers
      and not collect_stats)
  if use_linear_memory:
    return _linear_memory_stack(graphdef, cfg, layer_state, state, positions_BT), None
  return _plain_stack(graphdef, cfg, layer_state, state, positions_BT, collect_stats)


def apply_layers_cached(graphdef, layer_state, state, positions_BT, cache,
                        cache_index, *, cfg):
  """Decoding: runs the layers with their KV caches; returns (final state, cache)."""

  def body(carry, xs):
    state_k, k, cache_k = xs
    return _layer_step(graphdef, cfg, state_k, carry, k, positions_BT,
                       collect_stats=False, cache=cache_k, cache_index=cache_index)

  return jax.lax.scan(body, state, (layer_state, jnp.arange(cfg.num_layers), cache))


# -- the linear-memory backward pass ------------------------------------------------


def _split_residuals(vjp_fn, known_leaves):
  """Flattens a VJP closure; leaves that are known inputs are referenced, not saved.

  Returns (treedef, spec, saved): spec[i] is ('known', j) for known_leaves[j] or
  ('saved', j) for saved[j].
  """
  leaves, treedef = jax.tree.flatten(vjp_fn)
  known_ids = {id(x): j for j, x in enumerate(known_leaves)}
  spec, saved = [], []
  for leaf in leaves:
    if id(leaf) in known_ids:
      spec.append(('known', known_ids[id(leaf)]))
    else:
      spec.append(('saved', len(saved)))
      saved.append(leaf)
  return treedef, spec, saved


def _join_residuals(treedef, spec, saved, known_leaves):
  leaves = [known_leaves[j] if kind == 'known' else saved[j] for kind, j in spec]
  return jax.tree.unflatten(treedef, leaves)


def _add_depth_grads(d_state, which, d_query_D, d_gain_D):
  """Adds the read's query/gain gradients to row `which` of a layer's gradients."""

  def add(path, leaf):
    names = {getattr(key, 'key', None) for key in path}  # leaves sit under '.value'
    if 'depth_query' in names:
      return leaf.at[which].add(d_query_D.astype(leaf.dtype))
    if 'depth_gain' in names:
      return leaf.at[which].add(d_gain_D.astype(leaf.dtype))
    return leaf

  return jax.tree_util.tree_map_with_path(add, d_state)


def _linear_memory_stack(graphdef, cfg, layer_state, buffer_SBTD, positions_BT):
  block_size = config_lib.effective_block_size(cfg)
  keeps_partial = block_size > 1  # Full: every sublayer starts a fresh slot.
  recompute_sublayers = cfg.remat == 'layer'
  functions = [_sublayer_function(graphdef, which, cfg.remat == 'sublayer')
               for which in SUBLAYERS]
  # Static facts about the VJP closures, recorded while tracing the forward pass and
  # used while tracing the backward pass (both happen within one trace).
  closure_layout = {}

  @jax.custom_vjp
  def stack(layer_state, buffer_SBTD, positions_BT):
    state, _ = _plain_stack(graphdef, cfg, layer_state, buffer_SBTD, positions_BT,
                            collect_stats=False)
    return state

  def forward(layer_state, buffer_SBTD, positions_BT):
    def body(buffer_SBTD, xs):
      state_k, k = xs
      known = jax.tree.leaves(state_k) + [positions_BT]
      saved = []
      for which in SUBLAYERS:
        sublayer = 2 * k + which
        slot = depth.output_slot(sublayer, block_size)
        partial_BTD = (jax.lax.dynamic_index_in_dim(buffer_SBTD, slot, 0, False)
                       if keeps_partial else None)  # Full: nothing to keep.
        h_BTD, _ = _read(graphdef, cfg, state_k, buffer_SBTD, which, sublayer)
        if recompute_sublayers:
          out_BTD = functions[which](state_k, h_BTD, positions_BT)
          residuals = []
        else:
          out_BTD, vjp_fn = jax.vjp(
              lambda s, h, f=functions[which]: f(s, h, positions_BT), state_k, h_BTD)
          treedef, spec, residuals = _split_residuals(vjp_fn, known)
          closure_layout[which] = (treedef, spec)
        saved.append((partial_BTD, residuals))
        buffer_SBTD = _add_to_slot(buffer_SBTD, slot, out_BTD)
      return buffer_SBTD, saved

    final_SBTD, saved = jax.lax.scan(
        body, buffer_SBTD, (layer_state, jnp.arange(cfg.num_layers)))
    return final_SBTD, (layer_state, final_SBTD, positions_BT, saved)

  def backward(residuals, d_final_SBTD):
    layer_state, final_SBTD, positions_BT, saved = residuals

    def body(d_buffer_SBTD, xs):
      state_k, k, saved_k = xs
      known = jax.tree.leaves(state_k) + [positions_BT]
      layer = nnx.merge(graphdef, state_k)
      d_state_k = None
      for which in reversed(SUBLAYERS):
        sublayer = 2 * k + which
        slot = depth.output_slot(sublayer, block_size)
        partial_BTD, sublayer_residuals = saved_k[which]
        # The sublayer read the completed slots [0, slot) of the final buffer, plus
        # (Block) the running partial sum of its block, which lived in `slot`.
        query_D = layer.depth_query[...][which]
        gain_D = layer.depth_gain[...][which]
        read_kwargs = dict(num_valid=slot, partial_BTD=partial_BTD,
                           partial_valid=sublayer % block_size != 0)
        h_BTD, statistics = depth.read_parts(final_SBTD, query_D, gain_D,
                                             eps=cfg.attn_res_eps, **read_kwargs)
        if recompute_sublayers:
          _, sublayer_vjp = jax.vjp(
              lambda s, h, f=functions[which]: f(s, h, positions_BT), state_k, h_BTD)
        else:
          treedef, spec = closure_layout[which]
          sublayer_vjp = _join_residuals(treedef, spec, sublayer_residuals, known)
        d_out_BTD = jax.lax.dynamic_index_in_dim(d_buffer_SBTD, slot, 0, False)
        d_state_f, d_h_BTD = sublayer_vjp(d_out_BTD)
        d_buffer_read, d_partial_BTD, d_query_D, d_gain_D = depth.read_parts_backward(
            final_SBTD, query_D, gain_D, statistics, d_h_BTD, partial_BTD)
        d_buffer_SBTD = d_buffer_SBTD + d_buffer_read
        if d_partial_BTD is not None:
          d_buffer_SBTD = _add_to_slot(d_buffer_SBTD, slot, d_partial_BTD)
        d_state_f = _add_depth_grads(d_state_f, which, d_query_D, d_gain_D)
        d_state_k = d_state_f if d_state_k is None else jax.tree.map(
            jnp.add, d_state_k, d_state_f)
      return d_buffer_SBTD, d_state_k

    d_buffer_SBTD, d_layer_state = jax.lax.scan(
        body, d_final_SBTD, (layer_state, jnp.arange(cfg.num_layers), saved),
        reverse=True)
    return d_layer_state, d_buffer_SBTD, None

  stack.defvjp(forward, backward)
  return stack(layer_state, buffer_SBTD, positions_BT)
