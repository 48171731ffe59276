"""Residual connections behind one interface: the only contact between the layer stack
and the way sublayer inputs are read from depth and outputs written to it.

The stack (`stack.py`) runs the layers in schedule segments of `segment_layers`
consecutive layers and calls, in this order:

    carry = residual.init(x_BTD)                          # once, from the embedding
    for each segment:                                     # a scan over segments
      inner, per_layer = residual.begin_segment(carry, params_GL, segment)
      for each layer j of the segment, sublayer which:    # unrolled (G is small)
        h, weights = residual.read(inner, params, per_layer_j, j, which)
        inner = residual.write(inner, params, per_layer_j, j, which, f(h))
      carry = residual.end_segment(carry, inner, segment)
    h, weights = residual.final(carry, final_params)      # the input of the final norm

`params` are the residual's own parameters: `layer_params(cfg)` builds one layer's
(the stack keeps them as `layer.residual`, stacked over layers like every layer
parameter; `params_GL` holds a whole segment's), `final_params(cfg)` the final read's
(`model.final_residual`). A residual with a memory-lean backward pass of its own
offers it as `custom_stack`. Adding a residual is one new class (here, or in its own
module like `hyper_connections.py`) and a line in `make_residual`; nothing else in the
stack or the layers branches on the kind.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from attnres_jax import config as config_lib
from attnres_jax import depth
from attnres_jax import sharding


def _param(init, shape, axes, dtype) -> nnx.Param:
  """A parameter without random numbers, with logical axis names."""
  return nnx.Param(init(shape, dtype), out_sharding=axes, eager_sharding=False)


class Residual(abc.ABC):
  """The interface; see the module docstring for the call order."""

  segment_layers: int
  custom_stack = None  # optional: fn(graphdef, layer_state, x, positions) -> carry

  def layer_params(self, cfg) -> nnx.Module | None:
    return None

  def final_params(self, cfg) -> nnx.Module | None:
    return None

  @abc.abstractmethod
  def init(self, x_BTD):
    """The carry before the first layer, from the token embedding."""

  def begin_segment(self, carry, params, segment):
    return carry, None

  @abc.abstractmethod
  def read(self, inner, params, per_layer, layer_in_segment, which):
    """(the input of sublayer `which` of the layer, its depth weights or None)."""

  @abc.abstractmethod
  def write(self, inner, params, per_layer, layer_in_segment, which, out_BTD):
    """The inner carry after the sublayer's output `out_BTD` is written."""

  def end_segment(self, carry, inner, segment):
    return inner

  @abc.abstractmethod
  def final(self, carry, params):
    """(the input of the final norm, the final read's depth weights or None)."""


@dataclasses.dataclass(frozen=True)
class StandardResidual(Residual):
  """h_{l+1} = h_l + f_l(h_l): the stream is the whole state."""

  segment_layers: int = 1  # nothing to schedule: one layer at a time

  def init(self, x_BTD):
    return x_BTD

  def read(self, inner, params, per_layer, layer_in_segment, which):
    return inner, None

  def write(self, inner, params, per_layer, layer_in_segment, which, out_BTD):
    return sharding.constrain(inner + out_BTD, sharding.HIDDEN)

  def final(self, carry, params):
    return carry, None


# -- Attention Residuals ------------------------------------------------------------


class DepthReads(nnx.Module):
  """The parameters of AttnRes depth reads: one pseudo-query and key gain per read
  (`rows` reads: the two sublayers of a layer, or the single final read), plus those
  of the enabled ablations. None takes random numbers: queries start at zero (uniform
  weights) and gains at one, so the shared weights of every mode are identical."""

  def __init__(self, cfg, rows: tuple[int, ...], row_axes: tuple[str, ...]):
    pdt = jnp.dtype(cfg.param_dtype)
    d = cfg.d_model
    self.query = _param(jnp.zeros, (*rows, d), (*row_axes, 'embed'), pdt)
    self.gain = _param(jnp.ones, (*rows, d), (*row_axes, 'embed'), pdt)
    # Ablations (paper Section 5): an input-dependent query, DenseFormer-style scalars.
    self.query_proj = (_param(jnp.zeros, (*rows, d, d), (*row_axes, 'embed', None), pdt)
                       if cfg.depth_query_input else None)
    slots = depth.num_slots(config_lib.num_sublayers(cfg),
                            config_lib.effective_block_size(cfg))
    self.mix = (_param(jnp.ones, (*rows, slots), (*row_axes, 'depth'), pdt)
                if cfg.depth_mixing == 'scalars' else None)


def read_one_shot(cfg, buffer_KBTD, num_valid, query_D, gain_D, query_proj_DD=None,
                  mixing_K=None, inv_rms_KBT=None):
  """One depth read over `buffer[:num_valid]` in one softmax (the reference read), or
  one of its ablations. Returns (h, weights [K, B, T])."""
  if not cfg.ablations:
    h_BTD, (weights_KBT, _, _) = depth.read_parts(
        buffer_KBTD, query_D, gain_D, eps=cfg.attn_res_eps, num_valid=num_valid,
        inv_rms_KBT=inv_rms_KBT)
    return h_BTD, weights_KBT
  if num_valid is None:
    num_valid = buffer_KBTD.shape[0]
  query = query_D
  if query_proj_DD is not None:  # input-dependent: from the most recent source
    latest_BTD = jax.lax.dynamic_index_in_dim(buffer_KBTD, num_valid - 1, 0, False)
    normed_BTD = latest_BTD.astype(jnp.float32) * depth.rms_inverse(
        latest_BTD, cfg.attn_res_eps)[..., None]
    # Fan-in scaling, as for attention logits: Adam moves every entry of W by ~lr, so
    # an unscaled W x grows ~sqrt(d) times faster than the static query and the depth
    # softmax collapses to one source per token (measured: entropy 0.01-0.05 nats
    # after 300 steps at lr 3e-3, d=128, and 16% worse held-out loss than Full).
    query = depth.lead(query_D.astype(jnp.float32), normed_BTD.ndim) + (
        normed_BTD @ query_proj_DD.astype(jnp.float32)) * normed_BTD.shape[-1] ** -0.5
  return depth.attn_res_read_variant(
      buffer_KBTD, query, gain_D, eps=cfg.attn_res_eps, num_valid=num_valid,
      normalizer=cfg.depth_normalizer, key_norm=cfg.depth_key_norm,
      window=cfg.depth_window, num_heads=cfg.depth_heads, mixing_weights_K=mixing_K,
      inv_rms_KBT=inv_rms_KBT)


def _row(param, which):
  return None if param is None else param[...][which]


def default_segment_layers(num_layers: int, block_size: int) -> int:
  """Layers per schedule segment when the config leaves it to us: the shortest that
  covers whole blocks (2 G sublayers a multiple of block_size, so that every segment
  has the same slot layout), and 2 layers for Full AttnRes.

  Measured (`bench/memory.py`, d256 T256 B8, 16 layers, step time / standard):
  Block S=2 1.12 / 1.27 / 1.37 with G = 1 / 2 / 4, Full 1.62 / 1.57 / 1.68. Longer
  segments read the completed blocks less often but merge more local slots per
  sublayer, unroll more layers in the scan body and keep more memory.
  """
  unit = block_size // 2 if block_size % 2 == 0 else block_size
  if block_size == 1:
    unit = 2 if num_layers % 2 == 0 else 1
  return min(unit, num_layers)


def segment_layers(cfg) -> int:
  """G: the configured or default layers per schedule segment."""
  block_size = config_lib.effective_block_size(cfg)
  return cfg.schedule_layers or default_segment_layers(cfg.num_layers, block_size)


@dataclasses.dataclass(frozen=True)
class AttnResResidual(Residual):
  """Full (block_size 1) and Block AttnRes through the paper's block schedule.

  The carry between segments is the depth buffer [K, B, T, D] (slot 0 the embedding,
  then one slot per block) and each slot's inverse RMS. A segment of G layers starts
  on a block boundary and owns J local slots (its blocks), which live in the inner
  carry and are written into the buffer when it ends. Two-phase reads run Phase 1 for
  the segment's Q = 2 G queries against the completed slots at its start, then merge
  the local slots per sublayer (Phase 2). One-shot reads (the reference, the
  ablations, the analysis statistics) read the buffer with the local slots in place.
  """

  cfg: Any
  one_shot: bool = False

  @property
  def block_size(self) -> int:
    return config_lib.effective_block_size(self.cfg)

  @property
  def segment_layers(self) -> int:
    return segment_layers(self.cfg)

  def local_slots(self, num_layers: int) -> int:
    """J: the slots that a segment of `num_layers` layers (starting on a block
    boundary) writes."""
    return -(-2 * num_layers // self.block_size)

  @property
  def num_slots(self) -> int:
    return depth.num_slots(config_lib.num_sublayers(self.cfg), self.block_size)

  @property
  def two_phase(self) -> bool:
    return not self.one_shot and self.cfg.depth_read == 'two_phase'

  @property
  def custom_stack(self):
    if not (self.two_phase and self.cfg.linear_memory_backward
            and self.cfg.scan_layers):
      return None
    from attnres_jax import attnres_backward  # the backward builds on this class
    return attnres_backward.make_stack(self)

  def layer_params(self, cfg):
    return DepthReads(cfg, (2,), ('sublayers',))

  def final_params(self, cfg):
    return DepthReads(cfg, (), ())

  def first_local_slot(self, segment):
    """The buffer slot of a segment's first local slot (segment may be traced)."""
    return 1 + segment * (2 * self.segment_layers // self.block_size)

  def local_index(self, layer_in_segment, which):
    """Which local slot a sublayer writes, and how many local slots it reads."""
    position = 2 * layer_in_segment + which
    index = position // self.block_size
    return index, index + (position % self.block_size != 0)

  def init(self, x_BTD):
    buffer_KBTD = jnp.zeros((self.num_slots,) + x_BTD.shape, x_BTD.dtype)
    buffer_KBTD = sharding.constrain(buffer_KBTD.at[0].set(x_BTD), sharding.DEPTH_BUFFER)
    inv_rms_KBT = jnp.zeros((self.num_slots,) + x_BTD.shape[:-1], jnp.float32)
    return buffer_KBTD, inv_rms_KBT.at[0].set(
        depth.rms_inverse(x_BTD, self.cfg.attn_res_eps))

  def segment_queries(self, params, num_layers):
    """The segment's queries and gains, [Q, D] in sublayer order, whole on every
    device (tiny: otherwise a sharded model dimension makes Phase 1 all-reduce its
    [Q, K, B, T] logits instead)."""
    d = self.cfg.d_model
    whole = lambda x: sharding.constrain(x[...].reshape(2 * num_layers, d), (None, None))
    return whole(params.query), whole(params.gain)

  def merge(self, phase1_stats, local_JBTD, query_D, gain_D, layer_in_segment, which,
            first, embedding_BTD, local_inv_rms_JBT=None):
    """Phase 2 of one sublayer: its Phase 1 statistics merged with the local slots it
    reads. The model's first sublayer reads the embedding alone, whatever its query:
    it takes it as is, so that its query's gradient is exactly zero (through the
    online softmax it would be two float32 terms that cancel only to a few ulps)."""
    _, num_valid = self.local_index(layer_in_segment, which)
    valid_J = jnp.arange(local_JBTD.shape[0]) < num_valid
    h_BTD = depth.phase2(phase1_stats, local_JBTD, valid_J, query_D, gain_D,
                         eps=self.cfg.attn_res_eps, local_inv_rms_JBT=local_inv_rms_JBT)
    if layer_in_segment == 0 and which == 0:
      h_BTD = jnp.where(first == 1, embedding_BTD, h_BTD)
    return h_BTD

  def begin_segment(self, carry, params, segment):
    buffer_KBTD, inv_rms_KBT = carry
    num_layers = params.query.shape[0]
    num_local = self.local_slots(num_layers)
    local_JBTD = jnp.zeros((num_local,) + buffer_KBTD.shape[1:], buffer_KBTD.dtype)
    local_inv_rms_JBT = jnp.zeros((num_local,) + inv_rms_KBT.shape[1:], jnp.float32)
    first = self.first_local_slot(segment)
    inner = (buffer_KBTD, inv_rms_KBT, first,
             sharding.constrain(local_JBTD, sharding.DEPTH_BUFFER), local_inv_rms_JBT)
    if not self.two_phase:
      return inner, None
    return inner, self.phase1(buffer_KBTD, params, first, inv_rms_KBT)

  def phase1(self, buffer_KBTD, params, first, inv_rms_KBT=None):
    """Phase 1 of a segment (its layers' stacked `params`) against the slots before
    `first`: statistics per layer and sublayer, [G, 2, ...]."""
    num_layers = params.query.shape[0]
    queries_QD, gains_QD = self.segment_queries(params, num_layers)
    stats = depth.phase1(buffer_KBTD, queries_QD, gains_QD, eps=self.cfg.attn_res_eps,
                         num_valid=first, inv_rms_KBT=inv_rms_KBT)
    return jax.tree.map(lambda x: x.reshape(num_layers, 2, *x.shape[1:]), stats)

  def read(self, inner, params, per_layer, layer_in_segment, which):
    buffer_KBTD, inv_rms_KBT, first, local_JBTD, local_inv_rms_JBT = inner
    _, num_local_valid = self.local_index(layer_in_segment, which)
    query_D, gain_D = params.query[...][which], params.gain[...][which]
    if self.two_phase:
      mine = jax.tree.map(lambda x: x[which], per_layer)
      h_BTD = self.merge(mine, local_JBTD, query_D, gain_D, layer_in_segment, which,
                         first, buffer_KBTD[0], local_inv_rms_JBT)
      return h_BTD, None
    # One shot: the buffer as this sublayer sees it, local slots in place.
    view_KBTD = jax.lax.dynamic_update_slice_in_dim(buffer_KBTD, local_JBTD, first, 0)
    view_inv_rms_KBT = jax.lax.dynamic_update_slice_in_dim(
        inv_rms_KBT, local_inv_rms_JBT, first, 0)
    return read_one_shot(self.cfg, view_KBTD, first + num_local_valid, query_D, gain_D,
                         _row(params.query_proj, which), _row(params.mix, which),
                         inv_rms_KBT=view_inv_rms_KBT)

  def write(self, inner, params, per_layer, layer_in_segment, which, out_BTD):
    buffer_KBTD, inv_rms_KBT, first, local_JBTD, local_inv_rms_JBT = inner
    index, _ = self.local_index(layer_in_segment, which)
    local_JBTD, written_BTD = add_to_slot(local_JBTD, index, out_BTD)
    local_inv_rms_JBT = jax.lax.dynamic_update_index_in_dim(
        local_inv_rms_JBT, depth.rms_inverse(written_BTD, self.cfg.attn_res_eps),
        index, 0)
    return (buffer_KBTD, inv_rms_KBT, first,
            sharding.constrain(local_JBTD, sharding.DEPTH_BUFFER), local_inv_rms_JBT)

  def end_segment(self, carry, inner, segment):
    buffer_KBTD, inv_rms_KBT, first, local_JBTD, local_inv_rms_JBT = inner
    buffer_KBTD = jax.lax.dynamic_update_slice_in_dim(buffer_KBTD, local_JBTD, first, 0)
    inv_rms_KBT = jax.lax.dynamic_update_slice_in_dim(inv_rms_KBT, local_inv_rms_JBT,
                                                      first, 0)
    return sharding.constrain(buffer_KBTD, sharding.DEPTH_BUFFER), inv_rms_KBT

  def final(self, carry, params):
    buffer_KBTD, inv_rms_KBT = carry
    return read_one_shot(self.cfg, buffer_KBTD, None, params.query[...],
                         params.gain[...], _row(params.query_proj, ()),
                         _row(params.mix, ()), inv_rms_KBT=inv_rms_KBT)


def add_to_slot(slots_KBTD, slot, out_BTD):
  """(the slots with `out` added to slot `slot`, that slot's new value)."""
  updated = jax.lax.dynamic_index_in_dim(slots_KBTD, slot, 0, keepdims=False) + out_BTD
  return jax.lax.dynamic_update_index_in_dim(slots_KBTD, updated, slot, 0), updated


def make_residual(cfg, *, one_shot: bool = False) -> Residual:
  """The residual of a model config (`one_shot`: AttnRes reads as one softmax each)."""
  if cfg.residual == 'standard':
    return StandardResidual()
  if cfg.residual in config_lib.HYPER_CONNECTIONS:
    from attnres_jax import hyper_connections  # pylint: disable=g-import-not-at-top
    return hyper_connections.HyperConnectionResidual(cfg)
  return AttnResResidual(cfg, one_shot=one_shot)
