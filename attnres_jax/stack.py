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

import jax
import jax.numpy as jnp
from flax import nnx

from attnres_jax import config as config_lib
from attnres_jax import depth
from attnres_jax import sharding

SUBLAYERS = (0, 1)  # attention, MLP


def _sublayer_function(graphdef, which: int, remat: bool):
  """f(layer_state, h, positions) -> raw output of one sublayer, as a pure function."""

  def apply(layer_state, h_BTD, positions_BT):
    return nnx.merge(graphdef, layer_state).sublayer(which, h_BTD, positions_BT)

  return jax.checkpoint(apply) if remat else apply


def ablation_params(module, prefix, which=None):
  """(query projection or None, mixing weights or None) of one read of `module`."""
  params = []
  for name in (f'{prefix}_query_proj', f'{prefix}_mix'):
    value = getattr(module, name, None)
    value = None if value is None else value[...]
    params.append(value if value is None or which is None else value[which])
  return params


def read_depth(cfg, buffer_SBTD, num_valid, query_D, gain_D, query_proj_DD=None,
               mixing_S=None, inv_rms_SBT=None):
  """One depth read as configured: the paper's read, or one of its ablations.

  `inv_rms_SBT`: the buffer's per-slot inverse RMS when the caller keeps it.
  """
  if not config_lib.depth_variant_fields(cfg):
    h_BTD, (weights_SBT, _, _) = depth.read_parts(
        buffer_SBTD, query_D, gain_D, eps=cfg.attn_res_eps, num_valid=num_valid,
        inv_rms_SBT=inv_rms_SBT)
    return h_BTD, weights_SBT
  if num_valid is None:
    num_valid = buffer_SBTD.shape[0]
  query = query_D
  if query_proj_DD is not None:  # input-dependent: from the most recent source
    latest_BTD = jax.lax.dynamic_index_in_dim(buffer_SBTD, num_valid - 1, 0, False)
    normed_BTD = latest_BTD.astype(jnp.float32) * depth.rms_inverse(
        latest_BTD, cfg.attn_res_eps)[..., None]
    # Fan-in scaling, as for attention logits: Adam moves every entry of W by ~lr, so
    # an unscaled W x grows ~sqrt(d) times faster than the static query and the depth
    # softmax collapses to one source per token (measured: entropy 0.01-0.05 nats
    # after 300 steps at lr 3e-3, d=128, and 16% worse held-out loss than Full).
    query = query_D.astype(jnp.float32) + (
        normed_BTD @ query_proj_DD.astype(jnp.float32)) * normed_BTD.shape[-1] ** -0.5
  return depth.attn_res_read_variant(
      buffer_SBTD, query, gain_D, eps=cfg.attn_res_eps, num_valid=num_valid,
      normalizer=cfg.depth_normalizer, key_norm=cfg.depth_key_norm,
      window=cfg.depth_window, num_heads=cfg.depth_heads, mixing_weights_S=mixing_S,
      inv_rms_SBT=inv_rms_SBT)


class _DepthState:
  """How sublayers read their inputs from, and write their outputs to, depth.

  The carry is the residual stream ('standard'), or for AttnRes (buffer, the inverse
  RMS of each slot, phase-1 statistics or None unless reads are two-phase). Keeping
  the inverse RMS saves each read a pass over the buffer: a slot's RMS is computed
  once per write instead of once per reader.
  """

  def __init__(self, graphdef, cfg, layer_state, *, one_shot=False):
    self.cfg = cfg
    self.standard = cfg.residual == 'standard'
    self.block_size = config_lib.effective_block_size(cfg)
    self.two_phase = (not self.standard and not one_shot
                      and cfg.depth_read == 'two_phase')
    if self.two_phase:
      # Phase 1 needs the queries of a whole block, which may span several layers.
      layers = nnx.merge(graphdef, layer_state)
      num_sublayers = config_lib.num_sublayers(cfg)
      padding = ((0, depth.num_blocks(num_sublayers, self.block_size) * self.block_size
                  - num_sublayers), (0, 0))
      self.queries_LD = jnp.pad(layers.depth_query[...].reshape(num_sublayers, -1),
                                padding)
      self.gains_LD = jnp.pad(layers.depth_gain[...].reshape(num_sublayers, -1),
                              padding)

  def initial_carry(self, state):
    if self.standard:
      return state
    phase1 = None
    if self.two_phase:
      _, *btd = state.shape
      size = self.block_size
      phase1 = (jnp.zeros((size, *btd[:-1]), jnp.float32),
                jnp.zeros((size, *btd[:-1]), jnp.float32),
                jnp.zeros((size, *btd), jnp.float32))
    inv_rms_SBT = depth.rms_inverse(state, self.cfg.attn_res_eps)
    return state, inv_rms_SBT, phase1

  def final_state(self, carry):
    return carry if self.standard else carry[0]

  def buffer(self, carry):
    return carry[0]

  def read(self, carry, layer, which, sublayer):
    """Returns (h, depth weights or None, carry)."""
    if self.standard:
      return carry, None, carry
    buffer_SBTD, inv_rms_SBT, phase1 = carry
    query_D, gain_D = layer.depth_query[...][which], layer.depth_gain[...][which]
    eps = self.cfg.attn_res_eps
    if not self.two_phase:
      h_BTD, weights_SBT = read_depth(
          self.cfg, buffer_SBTD, depth.num_valid_sources(sublayer, self.block_size),
          query_D, gain_D, *ablation_params(layer, 'depth', which),
          inv_rms_SBT=inv_rms_SBT)
      return h_BTD, weights_SBT, carry
    size = self.block_size
    position = sublayer % size
    slot = depth.output_slot(sublayer, size)

    def run_phase1():
      first = sublayer - position
      take = lambda x: jax.lax.dynamic_slice_in_dim(x, first, size)
      return depth.block_phase1(buffer_SBTD, take(self.queries_LD),
                                take(self.gains_LD), eps=eps, num_valid=slot,
                                inv_rms_SBT=inv_rms_SBT)

    phase1 = jax.lax.cond(position == 0, run_phase1, lambda: phase1)
    mine = jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, position, 0, False),
                        phase1)
    partial_BTD = jax.lax.dynamic_index_in_dim(buffer_SBTD, slot, 0, False)
    h_BTD = depth.block_phase2(mine, partial_BTD, query_D, gain_D, eps=eps,
                               partial_valid=position != 0)
    return h_BTD, None, (buffer_SBTD, inv_rms_SBT, phase1)

  def write(self, carry, sublayer, out_BTD):
    if self.standard:
      return sharding.constrain(carry + out_BTD, sharding.HIDDEN)
    buffer_SBTD, inv_rms_SBT, phase1 = carry
    slot = depth.output_slot(sublayer, self.block_size)
    buffer_SBTD, written_BTD = _add_to_slot(buffer_SBTD, slot, out_BTD)
    inv_rms_SBT = jax.lax.dynamic_update_index_in_dim(
        inv_rms_SBT, depth.rms_inverse(written_BTD, self.cfg.attn_res_eps), slot, 0)
    return (sharding.constrain(buffer_SBTD, sharding.DEPTH_BUFFER), inv_rms_SBT,
            phase1)


def _add_to_slot(buffer_SBTD, slot, out_BTD):
  """(the buffer with `out` added to slot `slot`, that slot's new value)."""
  updated = jax.lax.dynamic_index_in_dim(buffer_SBTD, slot, 0, keepdims=False) + out_BTD
  return jax.lax.dynamic_update_index_in_dim(buffer_SBTD, updated, slot, 0), updated


def _token_rms(x_BTD):
  """Mean over tokens of the RMS over features."""
  return jnp.mean(1.0 / depth.rms_inverse(x_BTD, 0.0))


def _sublayer_stats(h_BTD, out_BTD, weights_SBT):
  entry = {'input_rms': _token_rms(h_BTD), 'output_rms': _token_rms(out_BTD)}
  if weights_SBT is not None:
    entry['depth_weights'] = jnp.mean(weights_SBT, axis=(1, 2))
    plogp = jnp.where(weights_SBT > 0, weights_SBT * jnp.log(weights_SBT), 0.0)
    entry['depth_entropy'] = jnp.mean(-jnp.sum(plogp, axis=0))
  return entry


def _layer_step(graphdef, cfg, depth_state, layer_state, carry, layer_index,
                positions_BT, *, collect_stats=False, apply_sublayer=None):
  """Both sublayers of one layer: read the input, apply f, write the output.

  `apply_sublayer(which, layer_state, h, carry) -> out` replaces the plain sublayer
  call (the linear-memory forward pass records VJP residuals through it).
  Returns (carry, per-sublayer statistics or None).
  """
  layer = nnx.merge(graphdef, layer_state)
  stats = []
  for which in SUBLAYERS:
    sublayer = 2 * layer_index + which
    h_BTD, weights_SBT, carry = depth_state.read(carry, layer, which, sublayer)
    if apply_sublayer is None:
      f = _sublayer_function(graphdef, which, cfg.remat == 'sublayer')
      out_BTD = f(layer_state, h_BTD, positions_BT)
    else:
      out_BTD = apply_sublayer(which, layer_state, h_BTD, carry)
    carry = depth_state.write(carry, sublayer, out_BTD)
    if collect_stats:
      stats.append(_sublayer_stats(h_BTD, out_BTD, weights_SBT))
  if not collect_stats:
    return carry, None
  return carry, jax.tree.map(lambda *xs: jnp.stack(xs), *stats)


def _scan_layers(step, carry, layer_state, num_layers, extra_xs=None, unroll=False):
  """carry, ys = step(layer_state_k, carry, k[, extra_k]) over layers: a scan, or a
  Python loop when `unroll` (debugging, and a reference for the scan)."""
  if unroll:
    per_layer = []
    for k in range(num_layers):
      take = lambda tree: jax.tree.map(lambda x: x[k], tree)
      args = (take(layer_state), carry, k) + (
          (take(extra_xs),) if extra_xs is not None else ())
      carry, ys = step(*args)
      per_layer.append(ys)
    return carry, jax.tree.map(lambda *xs: jnp.stack(xs), *per_layer)

  def body(carry, xs):
    state_k, k, *extra = xs
    return step(state_k, carry, k, *extra)

  xs = (layer_state, jnp.arange(num_layers)) + (
      (extra_xs,) if extra_xs is not None else ())
  return jax.lax.scan(body, carry, xs)


def _plain_stack(graphdef, cfg, layer_state, state, positions_BT, collect_stats):
  """Scan (or unrolled loop) over layers with ordinary autodiff."""
  depth_state = _DepthState(graphdef, cfg, layer_state, one_shot=collect_stats)

  def step(state_k, carry, k):
    return _layer_step(graphdef, cfg, depth_state, state_k, carry, k, positions_BT,
                       collect_stats=collect_stats)

  if cfg.remat == 'layer':
    step = jax.checkpoint(step)
  carry, stats = _scan_layers(step, depth_state.initial_carry(state), layer_state,
                              cfg.num_layers, unroll=not cfg.scan_layers)
  return depth_state.final_state(carry), stats


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
  depth_state = _DepthState(graphdef, cfg, layer_state)

  def step(state_k, carry, k, cache_k):
    updated = {}

    def apply_sublayer(which, layer_state, h_BTD, carry):
      del carry
      layer = nnx.merge(graphdef, layer_state)
      if which == 0:
        out_BTD, updated['cache'] = layer.sublayer(which, h_BTD, positions_BT, cache_k,
                                                   cache_index)
        return out_BTD
      return layer.sublayer(which, h_BTD, positions_BT)

    carry, _ = _layer_step(graphdef, cfg, depth_state, state_k, carry, k, positions_BT,
                           apply_sublayer=apply_sublayer)
    return carry, updated['cache']

  carry, cache = _scan_layers(step, depth_state.initial_carry(state), layer_state,
                              cfg.num_layers, extra_xs=cache)
  return depth_state.final_state(carry), cache


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
    depth_state = _DepthState(graphdef, cfg, layer_state)

    def step(state_k, carry, k):
      known = jax.tree.leaves(state_k) + [positions_BT]
      saved = []

      def apply_sublayer(which, state_k, h_BTD, carry):
        sublayer = 2 * k + which
        slot = depth.output_slot(sublayer, block_size)
        # Block: the partial sum this sublayer saw (Full: always zero, not kept).
        partial_BTD = (jax.lax.dynamic_index_in_dim(depth_state.buffer(carry), slot,
                                                    0, False)
                       if keeps_partial else None)
        if recompute_sublayers:
          out_BTD = functions[which](state_k, h_BTD, positions_BT)
          residuals = []
        else:
          out_BTD, vjp_fn = jax.vjp(
              lambda s, h, f=functions[which]: f(s, h, positions_BT), state_k, h_BTD)
          treedef, spec, residuals = _split_residuals(vjp_fn, known)
          closure_layout[which] = (treedef, spec)
        saved.append((partial_BTD, residuals))
        return out_BTD

      carry, _ = _layer_step(graphdef, cfg, depth_state, state_k, carry, k,
                             positions_BT, apply_sublayer=apply_sublayer)
      return carry, saved

    carry, saved = _scan_layers(step, depth_state.initial_carry(buffer_SBTD),
                                layer_state, cfg.num_layers)
    final_SBTD, final_inv_rms_SBT = carry[0], carry[1]
    return final_SBTD, (layer_state, final_SBTD, final_inv_rms_SBT, positions_BT, saved)

  def backward(residuals, d_final_SBTD):
    layer_state, final_SBTD, final_inv_rms_SBT, positions_BT, saved = residuals

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
                                             eps=cfg.attn_res_eps,
                                             inv_rms_SBT=final_inv_rms_SBT,
                                             **read_kwargs)
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
          d_buffer_SBTD, _ = _add_to_slot(d_buffer_SBTD, slot, d_partial_BTD)
        d_state_f = _add_depth_grads(d_state_f, which, d_query_D, d_gain_D)
        d_state_k = d_state_f if d_state_k is None else jax.tree.map(
            jnp.add, d_state_k, d_state_f)
      return sharding.constrain(d_buffer_SBTD, sharding.DEPTH_BUFFER), d_state_k

    d_buffer_SBTD, d_layer_state = jax.lax.scan(
        body, d_final_SBTD, (layer_state, jnp.arange(cfg.num_layers), saved),
        reverse=True)
    return d_layer_state, d_buffer_SBTD, None

  stack.defvjp(forward, backward)
  return stack(layer_state, buffer_SBTD, positions_BT)
