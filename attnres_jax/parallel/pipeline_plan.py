"""The static side of pipeline parallelism (`pipeline.py` runs it): the pipeline's
configuration and its validation, the schedule table and its bubble, which AttnRes
buffer slots each stage transition sends (the cross-stage cache's plan). What the
transfers cost in compiled HLO: `compile_report/pipeline_hlo.py`. Design and
measurements: docs/pipeline.md.
"""

from __future__ import annotations

import dataclasses

from attnres_jax.residuals.attnres import depth
from attnres_jax import residuals
from attnres_jax.nn import sharding
from attnres_jax.residuals.attnres import residual as attnres


# What the backward pass of the schedule's scan keeps per iteration. 'remat': the carry
# (what each stage received: one microbatch's boundary) and, for a chunk run through
# the residual's own backward pass (AttnRes's linear-memory one), that backward's
# residuals, the iteration rerun in the backward pass up to the chunk; 'remat_rerun':
# the carry only, the whole iteration rerun (its chunk too); 'gpipe': every activation
# of every iteration (plain autodiff).
SCHEDULES = ('remat', 'remat_rerun', 'gpipe')


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
  stages: int  # P
  virtual_stages: int = 1  # V
  num_microbatches: int = 1  # M
  transfer: str = 'cached'  # 'naive' | 'cached' (AttnRes only)
  schedule: str = 'remat'  # what the backward pass keeps (SCHEDULES)

  @property
  def num_chunks(self) -> int:
    return self.stages * self.virtual_stages

  @property
  def num_iterations(self) -> int:
    return self.num_microbatches * self.virtual_stages + self.stages - 1


def from_mesh_config(mesh_config) -> PipelineConfig | None:
  """The pipeline of a mesh config section; None without one (stage = 1)."""
  if mesh_config.get('stage', 1) == 1:
    return None
  return PipelineConfig(
    stages=mesh_config.stage,
    virtual_stages=mesh_config.get('virtual_stages', 1),
    num_microbatches=mesh_config.get('num_microbatches', 1),
    transfer=mesh_config.get('pipeline_transfer', 'cached'),
    schedule=mesh_config.get('pipeline_schedule', 'remat'),
  )


def validate(
  pipe: PipelineConfig | None, model_config, batch_size: int, data_shards: int = 1
) -> None:
  """Raises ValueError (before anything compiles) for a pipeline that cannot run.
  `model_config`: a `ModelConfig` (`config.validate` checks a run config's pipeline)."""
  if pipe is None:
    return

  def fail(message):
    raise ValueError(
      f'Invalid pipeline (mesh.stage={pipe.stages}, '
      f'virtual_stages={pipe.virtual_stages}, '
      f'num_microbatches={pipe.num_microbatches}): {message}'
    )

  if model_config.num_layers % pipe.num_chunks:
    fail(
      f'num_layers={model_config.num_layers} is not divisible by stage x '
      f'virtual_stages = {pipe.num_chunks} chunks.'
    )
  if batch_size % pipe.num_microbatches:
    fail(
      f'the batch of {batch_size} rows does not split into '
      f'{pipe.num_microbatches} microbatches.'
    )
  if (batch_size // pipe.num_microbatches) % data_shards:
    fail(
      f'a microbatch of {batch_size // pipe.num_microbatches} rows does not split '
      f'over the {data_shards} data-parallel devices.'
    )
  if pipe.virtual_stages > 1 and pipe.num_microbatches < pipe.stages:
    fail(
      'the interleaved schedule needs num_microbatches >= stage (a microbatch '
      'returns to stage 0 for its next virtual stage after P iterations).'
    )
  if pipe.transfer not in sharding.PIPELINE_TRANSFERS:
    fail(f'pipeline_transfer must be one of {sharding.PIPELINE_TRANSFERS}.')
  if pipe.schedule not in SCHEDULES:
    fail(f'pipeline_schedule must be one of {SCHEDULES}, got {pipe.schedule!r}.')
  refusal = residuals.make(model_config).pipeline_refusal(
    model_config.num_layers // pipe.num_chunks
  )
  if refusal:
    fail(f'residual={model_config.residual!r}: {refusal}')


# -- the schedule (static) ------------------------------------------------------------


def schedule_table(pipe: PipelineConfig) -> list[list[tuple[int, int] | None]]:
  """[iteration][stage] -> (microbatch, virtual stage) or None (idle)."""
  num_stages, num_virtual = pipe.stages, pipe.virtual_stages
  num_micro = pipe.num_microbatches
  table = []
  for t in range(pipe.num_iterations):
    row = []
    for p in range(num_stages):
      k = t - p
      busy = 0 <= k < num_micro * num_virtual
      row.append((k % num_micro, k // num_micro) if busy else None)
    table.append(row)
  return table


def bubble_fraction(pipe: PipelineConfig) -> float:
  """Idle (stage, iteration) slots over all slots of the schedule."""
  slots = [s for row in schedule_table(pipe) for s in row]
  return sum(s is None for s in slots) / len(slots)


# -- what a transition sends (static) -------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TransferPlan:
  """The AttnRes buffer slots each transition sends (chunk c -> chunk c + 1).

  `needed[c]`: the slot range [lo, hi) the receiver lacks; `starts[c]`: where the
  fixed-width window of `width` slots that carries it starts (clamped to the buffer).
  """

  num_slots: int  # K: the embedding + one per block
  width: int  # W slots per cached message
  needed: tuple[tuple[int, int], ...]  # per transition c = 0 .. C - 2
  starts: tuple[int, ...]  # per chunk c = 0 .. C - 1 (the last: unused)

  def block_sets(self, embedding: bool = True) -> tuple[tuple[range, range], ...]:
    """Per transition c -> c + 1, the (naive, cached) buffer slots the receiver gets
    (slot 0 the embedding b0, slot i >= 1 block b_i, partial or complete): naive every
    slot written so far, cached the ones its copy of the microbatch's buffer lacks.
    Logical sets; on the wire naive sends all K slots and cached a W-slot window."""
    first = 0 if embedding else 1
    return tuple((range(first, hi), range(max(lo, first), hi)) for lo, hi in self.needed)

  def block_transmissions(self, embedding: bool = False) -> tuple[int, int]:
    """(naive, cached) block sums sent over all transitions of one microbatch (the
    sizes of `block_sets`); without the embedding and at N_p = 1 these are the
    paper's eqs. 7-8."""
    sets = self.block_sets(embedding)
    return sum(len(n) for n, _ in sets), sum(len(c) for _, c in sets)

  def wire_slots(self) -> tuple[int, int]:
    """(naive, cached) buffer slots actually sent over all C - 1 transitions of one
    microbatch: (C - 1) K whole buffers against (C - 1) W fixed-width windows."""
    return len(self.needed) * self.num_slots, len(self.needed) * self.width

  def accumulated_slots(self) -> int:
    """Slots the paper's naive transfer sends over the C - 1 transitions: only those
    written so far, embedding included (ours, 'preallocated', sends all K)."""
    return sum(hi for _, hi in self.needed)


def transfer_plan(model_config, pipe: PipelineConfig) -> TransferPlan:
  """The AttnRes buffer windows of the cached transfer (Full or Block AttnRes)."""
  block_size = attnres.block_size_of(model_config)
  num_sublayers = 2 * model_config.num_layers
  num_slots = depth.num_slots(num_sublayers, block_size)
  sublayers_per_chunk = num_sublayers // pipe.num_chunks
  num_stages, num_chunks = pipe.stages, pipe.num_chunks

  def touched(c):  # the slots chunk c writes: [first, last + 1)
    first = c * sublayers_per_chunk
    return (
      depth.output_slot(first, block_size),
      depth.output_slot(first + sublayers_per_chunk - 1, block_size) + 1,
    )

  needed = []
  for c in range(num_chunks - 1):
    hi = touched(c)[1]
    # The receiver runs chunk c + 1; it last received this microbatch's state before
    # chunk c + 1 - P (its previous virtual stage), so it lacks what chunks
    # c + 1 - P .. c wrote; in its first virtual stage, everything.
    lo = 0 if c + 1 < num_stages else touched(c + 1 - num_stages)[0]
    needed.append((lo, hi))
  width = max([hi - lo for lo, hi in needed] or [num_slots])
  starts = tuple(min(lo, num_slots - width) for lo, _ in needed) + (0,)
  return TransferPlan(num_slots, width, tuple(needed), starts)
