"""Attention Residuals: Full (block size 1) and Block AttnRes through the paper's block
schedule (`docs/method.md`), with the depth-read ablations of the paper's Section 5.

The carry between segments is the depth buffer [K, B, T, D] (slot 0 the embedding,
then one slot per block) and each slot's inverse RMS (`DepthCarry`). A segment of G
layers starts on a block boundary and owns J local slots (its blocks), which live in
the inner carry (`SegmentCarry`) and are written into the buffer when it ends.
Two-phase reads run Phase 1 for the segment's Q = n G queries (n sublayers a layer) against the completed
slots at its start, then merge the local slots per sublayer (Phase 2). One-shot reads
(the reference, the ablations, the analysis statistics) read the buffer with the local
slots in place. The linear-memory backward pass is `backward.py`; the schedule's
sizes, config checks and costs are `schedule.py`; the automatic choices of how it is
computed (the Phase 1 kernel, the prefixes its XLA version reads) are `choices.py`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from attnres_jax.residuals.attnres import depth
from attnres_jax.nn import sharding
from attnres_jax.residuals.attnres import backward as attnres_backward
from attnres_jax.residuals.attnres import choices
from attnres_jax.residuals.attnres import phases
from attnres_jax.residuals.attnres import reads as attnres_reads
from attnres_jax.residuals.attnres import schedule as attnres_schedule
from attnres_jax.residuals import base

# Schedule functions that other modules use through this one.
block_size_of = attnres_schedule.block_size_of
depth_read_sources = attnres_schedule.depth_read_sources
whole_block_layers = attnres_schedule.whole_block_layers


class DepthCarry(NamedTuple):
  """Between segments: the depth buffer and each slot's inverse RMS."""

  buffer_KBTD: jax.Array
  inv_rms_KBT: jax.Array


class SegmentCarry(NamedTuple):
  """Within a segment: the buffer as it was at the segment's start, the buffer slot of
  its first local slot, and the local slots it writes (with their inverse RMS); or,
  where the residual writes its slots in place (`AttnResResidual.writes_in_place`),
  the buffer with the slots written so far, and no local slots (None)."""

  buffer_KBTD: jax.Array
  inv_rms_KBT: jax.Array
  first: Any
  local_JBTD: jax.Array
  local_inv_rms_JBT: jax.Array


@dataclasses.dataclass(frozen=True)
class AttnResResidual(base.Residual):
  """Full and Block AttnRes (`cfg.residual` 'full' / 'block'). The paper's read runs
  the two-phase block schedule, the ablations the one-shot read. The other fields
  are no config fields: set by the library (the statistics, the pipeline) or, as
  test references, by tests (`dataclasses.replace(model.residual, ...)`): part of
  the model's GraphDef, so a jit traces each variant apart."""

  cfg: Any
  one_shot: bool = False  # every read one softmax over the buffer (the reference)
  layers_per_segment: int = 0  # 0: the configured or default segment length
  # Test-only: plain autodiff of the two-phase schedule, not the linear-memory backward.
  autodiff_backward: bool = False
  prefix_count: int = 0  # XLA Phase 1's buffer prefixes; 0: `choices.phase1_prefixes`
  keep_phase1: bool | None = None  # Test-only; None: `choices.keeps_phase1`

  no_decay = frozenset({'query', 'gain', 'mix'})  # decay would pull reads to uniform
  figures = ('depth_weights', 'depth_entropy')
  cached_transfer = True

  # -- configuration and names ------------------------------------------------------

  def validate(self) -> None:
    attnres_schedule.validate(self.cfg)

  @property
  def label(self) -> str:
    if self.cfg.residual == 'full':
      return 'Full AttnRes'
    return f'Block AttnRes (S={self.cfg.block_size})'

  def describe(self):
    return {'block_size': self.block_size}

  @property
  def block_size(self) -> int:
    return block_size_of(self.cfg)

  @property
  def storage_dtype(self):
    """The depth buffer's and the partial sums' dtype."""
    return attnres_schedule.depth_state_dtype_of(self.cfg)

  @property
  def phase1_dtype(self):
    """Phase 1 outputs' dtype: the storage dtype."""
    return attnres_schedule.depth_state_dtype_of(self.cfg)

  def to_compute(self, h_BTD):
    """A read's result in the compute dtype (the sublayer's input)."""
    return h_BTD.astype(self.cfg.dtype)

  @property
  def segment_layers(self) -> int:
    return (
      self.layers_per_segment
      or self.cfg.schedule_layers
      or attnres_schedule.default_segment_layers(
        self.cfg.num_layers, self.block_size, self.sublayers_per_layer
      )
    )

  @property
  def num_slots(self) -> int:
    return depth.num_slots(self.num_sublayers, self.block_size)

  @property
  def two_phase(self) -> bool:
    """The two-phase block schedule: the paper's read (the ablations read in one
    shot), unless `one_shot`."""
    return not self.one_shot and not self.cfg.ablations

  @property
  def kernel(self) -> str:
    """'pallas' or 'xla': how Phase 1 is computed (`choices.phase1_kernel`)."""
    return choices.phase1_kernel(self)

  @property
  def writes_in_place(self) -> bool:
    """Two-phase Full AttnRes writes each sublayer's output straight into its buffer
    slot: the slot is empty until then and written once, and Phase 1 read the buffer
    at the segment's start, so the merge reads the segment's slots from the buffer.
    A separate stack of local slots was zero-filled every segment and copied into the
    buffer at its end (bench/aot.py d1024 v5p:2x2x1 data, full/bf16/pallas: 51.14 ->
    50.68 ms). Block keeps the stack: its own slot accumulates the block's partial
    sum, and written in place it measured no better (block:4/bf16/pallas 47.89 ->
    47.90 ms, block:8 50.14 -> 50.64)."""
    return self.two_phase and self.block_size == 1

  @property
  def custom_stack(self):
    if not (self.two_phase and not self.autodiff_backward and self.cfg.scan_layers):
      return None
    run = attnres_backward.make_stack(self)
    return lambda *args: DepthCarry(*run(*args))

  def for_statistics(self):
    return dataclasses.replace(self, one_shot=True)

  def layer_params(self):
    return attnres_reads.DepthReads(
      self.cfg, (self.sublayers_per_layer,), ('sublayers',), self.num_slots
    )

  def final_params(self):
    return attnres_reads.DepthReads(self.cfg, (), (), self.num_slots)

  # -- the block schedule -----------------------------------------------------------

  def local_slots(self, num_layers: int) -> int:
    """J: the slots that a segment of `num_layers` layers (starting on a block
    boundary) writes."""
    return -(-self.sublayers_per_layer * num_layers // self.block_size)

  def first_local_slot(self, segment):
    """The buffer slot of a segment's first local slot (segment may be traced)."""
    return 1 + segment * (
      self.sublayers_per_layer * self.segment_layers // self.block_size
    )

  def local_index(self, layer_in_segment, which):
    """Which local slot a sublayer writes, and how many local slots it reads."""
    position = self.sublayers_per_layer * layer_in_segment + which
    index = position // self.block_size
    return index, index + (position % self.block_size != 0)

  def init(self, x_BTD):
    x_BTD = x_BTD.astype(self.storage_dtype)
    buffer_KBTD = jnp.zeros((self.num_slots,) + x_BTD.shape, x_BTD.dtype)
    buffer_KBTD = sharding.constrain(buffer_KBTD.at[0].set(x_BTD), sharding.DEPTH_BUFFER)
    inv_rms_KBT = jnp.zeros((self.num_slots,) + x_BTD.shape[:-1], jnp.float32)
    return DepthCarry(
      buffer_KBTD, inv_rms_KBT.at[0].set(depth.rms_inverse(x_BTD, self.cfg.attn_res_eps))
    )

  def begin_segment(self, carry, params, segment):
    num_layers = params.query.shape[0]
    num_local = self.local_slots(num_layers)
    buffer_KBTD, inv_rms_KBT = carry
    first = self.first_local_slot(segment)
    if self.writes_in_place:
      inner = SegmentCarry(buffer_KBTD, inv_rms_KBT, first, None, None)
      return inner, phases.phase1(self, buffer_KBTD, params, first, inv_rms_KBT)
    local_JBTD = jnp.zeros((num_local,) + buffer_KBTD.shape[1:], buffer_KBTD.dtype)
    local_inv_rms_JBT = jnp.zeros((num_local,) + inv_rms_KBT.shape[1:], jnp.float32)
    inner = SegmentCarry(
      buffer_KBTD,
      inv_rms_KBT,
      first,
      sharding.constrain(local_JBTD, sharding.DEPTH_BUFFER),
      local_inv_rms_JBT,
    )
    if not self.two_phase:
      return inner, None
    return inner, phases.phase1(self, buffer_KBTD, params, first, inv_rms_KBT)

  def read(self, inner: SegmentCarry, params, per_layer, layer_in_segment, which):
    _, num_local_valid = self.local_index(layer_in_segment, which)
    query_D, gain_D = params.query[...][which], params.gain[...][which]
    if self.two_phase:
      local_JBTD, local_inv_rms_JBT = inner.local_JBTD, inner.local_inv_rms_JBT
      if self.writes_in_place:  # the slots it reads, written so far in the buffer
        local_JBTD, local_inv_rms_JBT = (
          jax.lax.dynamic_slice_in_dim(x, inner.first, num_local_valid, 0)
          if num_local_valid
          else None
          for x in (inner.buffer_KBTD, inner.inv_rms_KBT)
        )
      h_BTD = phases.merge(
        self,
        per_layer[which],
        local_JBTD,
        query_D,
        gain_D,
        layer_in_segment,
        which,
        inner.first,
        inner.buffer_KBTD[0],
        local_inv_rms_JBT,
      )
      return h_BTD, None
    # One shot: the buffer as this sublayer sees it, local slots in place.
    view = DepthCarry(
      *(
        jax.lax.dynamic_update_slice_in_dim(whole, local, inner.first, 0)
        for whole, local in (
          (inner.buffer_KBTD, inner.local_JBTD),
          (inner.inv_rms_KBT, inner.local_inv_rms_JBT),
        )
      )
    )
    h_BTD, weights_KBT = attnres_reads.read_row(
      self.cfg,
      view.buffer_KBTD,
      inner.first + num_local_valid,
      params,
      which,
      view.inv_rms_KBT,
    )
    return self.to_compute(h_BTD), weights_KBT

  def write(
    self, inner: SegmentCarry, params, per_layer, layer_in_segment, which, out_BTD
  ):
    index, _ = self.local_index(layer_in_segment, which)
    eps = self.cfg.attn_res_eps
    if self.writes_in_place:
      buffer_KBTD, inv_rms_KBT = attnres_reads.add_to_slot(
        inner.buffer_KBTD,
        inner.inv_rms_KBT,
        inner.first + index,
        out_BTD,
        eps,
        empty=True,
      )
      return inner._replace(buffer_KBTD=buffer_KBTD, inv_rms_KBT=inv_rms_KBT)
    local_JBTD, local_inv_rms_JBT = attnres_reads.add_to_slot(
      inner.local_JBTD, inner.local_inv_rms_JBT, index, out_BTD, eps
    )
    return inner._replace(local_JBTD=local_JBTD, local_inv_rms_JBT=local_inv_rms_JBT)

  def end_segment(self, carry, inner: SegmentCarry, segment):
    if self.writes_in_place:
      return DepthCarry(inner.buffer_KBTD, inner.inv_rms_KBT)
    return DepthCarry(
      sharding.constrain(
        jax.lax.dynamic_update_slice_in_dim(
          inner.buffer_KBTD, inner.local_JBTD, inner.first, 0
        ),
        sharding.DEPTH_BUFFER,
      ),
      jax.lax.dynamic_update_slice_in_dim(
        inner.inv_rms_KBT, inner.local_inv_rms_JBT, inner.first, 0
      ),
    )

  def final(self, carry: DepthCarry, params):
    h_BTD, weights_KBT = attnres_reads.read_row(
      self.cfg, carry.buffer_KBTD, None, params, (), carry.inv_rms_KBT
    )
    if self.kernel == 'pallas':  # the weights (statistics only) stay XLA's, unused
      h_BTD = phases.final_read_with_kernel(self, carry.buffer_KBTD, params)
    return self.to_compute(h_BTD), weights_KBT

  # -- analysis ---------------------------------------------------------------------

  def sublayer_statistics(self, weights, mean):
    if weights is None:
      return {}
    plogp = jnp.where(weights > 0, weights * jnp.log(weights), 0.0)
    return {
      'depth_weights': jax.vmap(mean)(weights),
      'depth_entropy': mean(-jnp.sum(plogp, axis=0)),
    }

  def final_statistics(self, weights, mean):
    return {'final_depth_weights': jax.vmap(mean)(weights)}

  # -- cost -------------------------------------------------------------------------

  def forward_flops(self) -> float:
    return attnres_schedule.forward_flops(self.cfg)

  def io_per_sublayer(self) -> tuple[float, float]:
    return attnres_schedule.io_per_sublayer(self)

  def min_extra_per_sublayer(self) -> float:
    return attnres_schedule.min_extra_per_sublayer(self)

  # -- the pipeline -----------------------------------------------------------------

  def carry_axes(self):
    return DepthCarry(sharding.DEPTH_BUFFER, sharding.DEPTH_BUFFER[:-1])

  def pipeline_refusal(self, layers_per_chunk: int) -> str | None:
    if self.cfg.ablations:
      return 'the depth-read ablations are not pipelined.'
    return None

  def pipeline_chunk(self, layers_per_chunk: int):
    if (
      self.sublayers_per_layer * layers_per_chunk
    ) % self.block_size:  # a block spans a chunk boundary
      return BufferReads(self.cfg), layers_per_chunk
    # The configured segment, or the longest shorter one that divides the chunk and
    # covers whole blocks (`unit` layers always do: the chunk starts on a block).
    unit = whole_block_layers(self.block_size, self.sublayers_per_layer)
    size = self.segment_layers
    if layers_per_chunk % size:
      size = max(d for d in range(unit, size + 1, unit) if layers_per_chunk % d == 0)
    # One read of the whole buffer per segment: the pipeline vmaps its stages, whose
    # segment starts differ, and a `lax.switch` on a batched index runs every branch.
    chunk = dataclasses.replace(self, layers_per_segment=size, prefix_count=1)
    return chunk, layers_per_chunk // size


class LayerCarry(NamedTuple):
  """`BufferReads`' inner carry: the buffer and the (global) index of the layer."""

  buffer_KBTD: jax.Array
  inv_rms_KBT: jax.Array
  layer: Any


@dataclasses.dataclass(frozen=True)
class BufferReads(AttnResResidual):
  """AttnRes one layer at a time, every read one softmax over the buffer as it stands
  (the running partial sum in place): for pipeline chunks that start inside a block,
  where no block-schedule segment can start. Same carry as `AttnResResidual`."""

  @property
  def segment_layers(self) -> int:
    return 1

  def begin_segment(self, carry, params, segment):
    return LayerCarry(*carry, segment), None  # segment = the (global) layer index

  def read(self, inner: LayerCarry, params, per_layer, layer_in_segment, which):
    sublayer = self.sublayers_per_layer * inner.layer + which
    h_BTD, weights_KBT = attnres_reads.read_row(
      self.cfg,
      inner.buffer_KBTD,
      depth.num_valid_sources(sublayer, self.block_size),
      params,
      which,
      inner.inv_rms_KBT,
    )
    return self.to_compute(h_BTD), weights_KBT

  def write(self, inner: LayerCarry, params, per_layer, layer_in_segment, which, out_BTD):
    slot = depth.output_slot(
      self.sublayers_per_layer * inner.layer + which, self.block_size
    )
    buffer_KBTD, inv_rms_KBT = attnres_reads.add_to_slot(
      inner.buffer_KBTD, inner.inv_rms_KBT, slot, out_BTD, self.cfg.attn_res_eps
    )
    return LayerCarry(buffer_KBTD, inv_rms_KBT, inner.layer)

  def end_segment(self, carry, inner: LayerCarry, segment):
    return DepthCarry(inner.buffer_KBTD, inner.inv_rms_KBT)
