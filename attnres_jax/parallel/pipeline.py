"""Pipeline parallelism over the mesh's `stage` axis, with the AttnRes state sent
between stages either whole ('naive') or incrementally ('cached', the paper's
cross-stage caching). Design, schedule and measurements: `docs/pipeline.md`.

P physical stages, V virtual stages each, C = P V chunks of num_layers / C consecutive
layers. Chunk c runs on stage c mod P (the interleaved, "circular" assignment; V = 1
is GPipe). M microbatches flow through: at iteration t, stage p works on microbatch
(t - p) mod M of its virtual stage (t - p) div M, so a microbatch's chunk c runs at
iteration v M + m + p and its next chunk one iteration later (on stage 0, after
waiting M - P iterations in a small storage when M > P). The whole schedule is one
`lax.scan` over M V + P - 1 iterations of a function vmapped over the stages (sharded
over `stage`); between iterations the stages' outgoing messages rotate by one stage
(a collective-permute). The backward pass is autodiff of that scan (all forward
microbatches, then all backward: GPipe order), which rotates the cotangents the other
way; `remat` applies per stage as elsewhere, and a chunk that runs the residual's own
schedule goes through its `custom_stack` (AttnRes: the linear-memory backward,
resumed from the received carry). The 'remat' schedule reruns each iteration from
what the stages received (`jax.checkpoint`), except where the chunk runs that
backward: there the iteration is not rerun, and what it keeps is what the custom
VJPs of `pipeline_vjp.py` keep (the chunk's backward residuals, the final read's
inputs and weights, scalar conditions), each iteration's only large values.

What crosses a stage boundary is the residual's carry (`Residual.carry_axes` names
its leaves; `Residual.pipeline_chunk` gives the residual that runs one chunk): the
stream for the standard residual, the m streams for HC/mHC; for AttnRes the depth
buffer (the completed blocks and the running partial sum) with its per-slot inverse
RMS. 'naive' sends the whole carry; 'cached' applies to residuals that declare
`cached_transfer` (AttnRes), the others always send the whole carry. 'cached' keeps, on
every stage, the buffer of each microbatch as it last received it, and sends only the
slots written since the receiver last saw the state: in the first virtual stage
everything written so far, from the second on the slots of the last P chunks.
Received values are copied, never recomputed, so both transfers give bitwise-equal
forward passes; the backward pass sends the windows' cotangents and adds a cached
block's cotangent at the stage that cached it, the same sum in another order (equal
gradients up to float rounding).

The layers keep their stored layout [num_layers, ...] (split over `stage` by the
'layers' rule), so checkpoints move freely between pipelined and plain meshes.

What crosses the boundaries and where it waits (inbox, delay line, cache):
`pipeline_transfer.py`; the schedule's static plan: `pipeline_plan.py`.

Shape suffixes as in `residuals/attnres/depth.py`, plus M: microbatches (`x_MBTD` is
[M, B / M, T, D]).
"""

from __future__ import annotations

import dataclasses
import functools
import types
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from attnres_jax.parallel import pipeline_transfer
from attnres_jax.parallel import pipeline_vjp
from attnres_jax.nn import sharding
from attnres_jax.parallel.pipeline_plan import PipelineConfig
from attnres_jax.nn import stack as stack_lib


# -- running one chunk of layers from a carry -----------------------------------------


def run_chunk(
  residual,
  graphdef,
  chunk_state,
  carry,
  segment_offset,
  positions_BT,
  *,
  model_config,
  layers_per_chunk: int,
  custom_stack=None,
):
  """The carry after one chunk's layers (`chunk_state`: their stacked parameters);
  through the residual's `custom_stack` (its own backward pass, resumed from the
  carry) when given."""
  if custom_stack is not None:
    return custom_stack(graphdef, chunk_state, carry, positions_BT, segment_offset)
  chunk_config = types.SimpleNamespace(
    num_layers=layers_per_chunk,
    remat=model_config.remat,
    scan_layers=model_config.scan_layers,
  )
  resumed = stack_lib.Resumed(residual, segment_offset)
  carry, _ = stack_lib.run_layers(
    resumed, graphdef, chunk_state, carry, positions_BT, cfg=chunk_config
  )
  return carry


def _chunk_residual(model, pipe: PipelineConfig, layers_per_chunk: int):
  """(the residual that runs one chunk, its segments per chunk, the residual's own
  backward pass that runs the chunk or None)."""
  residual, segments_per_chunk = model.residual.pipeline_chunk(layers_per_chunk)
  # The residual's own backward pass (AttnRes's linear-memory one) runs a chunk when
  # the chunk runs the residual's own schedule, re-segmented; not another one (a
  # block spanning chunk boundaries: `residuals/attnres/residual.BufferReads`).
  custom_stack = None
  if type(residual) is type(model.residual):
    if pipe.schedule == 'remat' and model.cfg.remat == 'none':
      # The schedule keeps the chunk's backward residuals (`own_backward`): with
      # remat='layer' those are the output buffer and the partial sums the sublayers
      # read, not every sublayer's activations; its backward reruns each sublayer.
      residual = dataclasses.replace(
        residual, cfg=dataclasses.replace(residual.cfg, remat='layer')
      )
    custom_stack = residual.custom_stack
  return residual, segments_per_chunk, custom_stack


def _final_read_fn(residual, final_params, own_backward: bool):
  """carry -> the input of the final norm; with the residual's own backward, through
  `pipeline_vjp.final_read`, which keeps its weights (AttnRes, no ablations:
  `pipeline_refusal`)."""
  if not own_backward:
    return lambda carry: residual.final(carry, final_params)[0]
  return lambda carry: residual.to_compute(
    pipeline_vjp.final_read(
      carry.buffer_KBTD,
      carry.inv_rms_KBT,
      final_params.query[...],
      final_params.gain[...],
    )
  )


def _stage_states(layer_state, pipe: PipelineConfig, layers_per_chunk: int):
  """[L, ...] -> [P, V, layers_per_chunk, ...]: chunk c = v P + p on stage p. Each
  stage's chunks where the stage is; the other axes as the parameters' names say."""
  is_spec = lambda x: isinstance(x, jax.sharding.PartitionSpec)
  return jax.tree.map(
    lambda x, spec: sharding.constrain(
      x.reshape(
        pipe.virtual_stages, pipe.stages, layers_per_chunk, *x.shape[1:]
      ).swapaxes(0, 1),
      ('stages', None, None) + tuple(spec)[1:],
    ),
    layer_state,
    nnx.get_partition_spec(layer_state),
    is_leaf=is_spec,
  )


@dataclasses.dataclass(frozen=True)
class _StageRun:
  """What every stage's iteration uses, the same for the whole schedule."""

  pipe: PipelineConfig
  model_config: Any
  residual: Any
  graphdef: Any
  custom_stack: Any  # the residual's own backward pass, or None
  chunk_run: Any  # with `own_backward`: the chunk's run through it, else None
  transfer: Any
  keeps_cache: bool
  select: Callable
  embedded: Callable  # (x_MBTD, microbatch) -> the first chunk's message
  final_read: Callable
  zero_carry: Any
  x_MBTD: jax.Array
  positions_BT: jax.Array
  layers_per_chunk: int
  segments_per_chunk: int


def _received(run: _StageRun, stage, micro, chunk, first, inbox, wrap, cache, t):
  """(the carry stage `stage` runs its chunk from, the delay line, the cache)."""
  transfer, select, delay = (
    run.transfer,
    run.select,
    pipeline_transfer.delay_length(run.pipe),
  )
  message = inbox
  if delay:  # stage 0 reads what arrived M - P iterations ago, stores what arrives
    entry = t % delay
    delayed, wrap = pipeline_vjp.swap_entry(wrap, entry, inbox)
    message = select(stage == 0, delayed, inbox)
  # The first chunk starts from the embedding: its message is the initial carry's
  # window (one select of W slots, not of the whole carry). The window lands at
  # slot 0 on a base that is zero there and above (nothing cached yet).
  message = select(first, run.embedded(run.x_MBTD, micro), message)
  base = run.zero_carry
  if run.keeps_cache:
    base = transfer.from_cache(jax.tree.map(lambda c: c[micro], cache), run.zero_carry)
  carry = transfer.receive(message, base, jnp.maximum(chunk - 1, 0))
  return carry, wrap, cache


def _run_stage_chunk(run: _StageRun, virtual_states, virtual, chunk, carry):
  """The carry after the stage's chunk `chunk` (its virtual stage `virtual`)."""
  segment_offset = chunk * run.segments_per_chunk
  if run.chunk_run is not None:
    return run.chunk_run(virtual_states, virtual, carry, run.positions_BT, segment_offset)
  return run_chunk(
    run.residual,
    run.graphdef,
    jax.tree.map(lambda x: x[virtual], virtual_states),
    carry,
    segment_offset,
    run.positions_BT,
    model_config=run.model_config,
    layers_per_chunk=run.layers_per_chunk,
    custom_stack=run.custom_stack,
  )


def _stage_step(run: _StageRun, stage, virtual_states, inbox, wrap, cache, t):
  """One iteration of one stage: receive, run its chunk, emit."""
  num_stages, num_micro = run.pipe.stages, run.pipe.num_microbatches
  num_virtual = run.pipe.virtual_stages
  k = t - stage
  valid = (k >= 0) & (k < num_micro * num_virtual)
  k = jnp.clip(k, 0, num_micro * num_virtual - 1)
  micro, virtual = k % num_micro, k // num_micro
  chunk = virtual * num_stages + stage
  first = (stage == 0) & (virtual == 0)
  carry, wrap, cache = _received(run, stage, micro, chunk, first, inbox, wrap, cache, t)
  if run.keeps_cache:  # what this stage had of the microbatch, for its next visit
    cache = pipeline_vjp.set_entry_where(
      cache, micro, valid, run.transfer.to_cache(carry)
    )
  carry = _run_stage_chunk(run, virtual_states, virtual, chunk, carry)
  h_BTD = run.final_read(carry)  # used from the last chunk only
  return run.transfer.send(carry, chunk), h_BTD, wrap, cache


def _iteration(state, t, *, stages_step, stage_state, carry_axes, num_stages: int):
  """One iteration of every stage; the scan's (carry, per-iteration output)."""
  sent, h_PBTD, wrap, cache = stages_step(
    jnp.arange(num_stages),
    stage_state,
    state['inbox'],
    state['wrap'],
    state['cache'],
    t,
  )
  # Stage p's message goes to stage p + 1 (and stage P - 1's to stage 0).
  inbox = jax.tree.map(lambda x: jnp.roll(x, 1, axis=0), sent)
  state = pipeline_transfer.constrain_state(
    dict(inbox=inbox, wrap=wrap, cache=cache), carry_axes
  )
  # Outputs leave as the scan's per-iteration results, not in its carry: a carry
  # is what the backward pass keeps once per iteration.
  return state, pipeline_transfer.constrain_stages(h_PBTD, sharding.HIDDEN)


def _stage_run(model, x_MBTD, positions_BT, pipe: PipelineConfig):
  """(the `_StageRun` of the schedule, whether the chunks run the residual's own
  backward pass without rerunning the iteration)."""
  cfg = model.cfg
  layers_per_chunk = cfg.num_layers // pipe.num_chunks
  residual, segments_per_chunk, custom_stack = _chunk_residual(
    model, pipe, layers_per_chunk
  )
  transfer, keeps_cache = pipeline_transfer.make_transfer(residual, cfg, pipe)
  graphdef, _ = nnx.split(model.layers)
  # 'remat' with the residual's own backward pass: the iteration is not rerun (no
  # `jax.checkpoint` around it); the chunk's VJP keeps what its backward needs, the
  # final read keeps its weights (`pipeline_vjp.final_read`), and the transfer code
  # keeps only indices and predicates.
  own_backward = custom_stack is not None and pipe.schedule == 'remat'
  final_read = _final_read_fn(residual, model.final_residual, own_backward)
  # The first chunk's message: the initial carry's window.
  embedded = lambda x_MBTD, micro: transfer.send(residual.init(x_MBTD[micro]), 0)
  chunk_run = None
  if own_backward:
    # Both keep what is the same in every iteration (the embedded microbatches, the
    # stage's parameters), not a slice of it per iteration.
    embedded = pipeline_vjp.recomputed(embedded)
    chunk_run = pipeline_vjp.indexing_params(functools.partial(custom_stack, graphdef))
  run = _StageRun(
    pipe=pipe,
    model_config=cfg,
    residual=residual,
    graphdef=graphdef,
    custom_stack=custom_stack,
    chunk_run=chunk_run,
    transfer=transfer,
    keeps_cache=keeps_cache,
    # Under `jax.checkpoint` nothing is kept; without it, the scalar conditions.
    select=pipeline_vjp.select if own_backward else pipeline_transfer.select,
    embedded=embedded,
    final_read=final_read,
    zero_carry=jax.tree.map(jnp.zeros_like, residual.init(x_MBTD[0])),
    x_MBTD=x_MBTD,
    positions_BT=positions_BT,
    layers_per_chunk=layers_per_chunk,
    segments_per_chunk=segments_per_chunk,
  )
  return run, own_backward


def pipeline_hidden(model, x_MBTD, positions_BT, pipe: PipelineConfig):
  """The input of the final norm, [M, B/M, T, D], for the embedded microbatches
  `x_MBTD`, the layers run through the pipeline."""
  num_stages, num_micro = pipe.stages, pipe.num_microbatches
  run, own_backward = _stage_run(model, x_MBTD, positions_BT, pipe)
  _, layer_state = nnx.split(model.layers)
  stage_state = _stage_states(layer_state, pipe, run.layers_per_chunk)
  state = pipeline_transfer.initial_state(
    run.transfer, run.zero_carry, pipe, run.keeps_cache
  )
  carry_axes = run.residual.carry_axes()
  stages_step = jax.vmap(
    functools.partial(_stage_step, run),
    in_axes=(0, 0, 0, 0, 0, None),
    spmd_axis_name=sharding.STAGE_AXIS,
  )
  iteration = functools.partial(
    _iteration,
    stages_step=stages_step,
    stage_state=stage_state,
    carry_axes=carry_axes,
    num_stages=num_stages,
  )
  if pipe.schedule in ('remat', 'remat_rerun') and not own_backward:
    # The backward pass reruns each iteration from its saved carry (what the stages
    # received) instead of keeping the activations of every microbatch in flight.
    # With the residual's own backward, 'remat' needs no rerun (`own_backward`).
    iteration = jax.checkpoint(
      iteration, prevent_cse=False, policy=jax.checkpoint_policies.nothing_saveable
    )
  _, h_IPBTD = jax.lax.scan(
    iteration,
    pipeline_transfer.constrain_state(state, carry_axes),
    jnp.arange(pipe.num_iterations),
  )
  # The last stage finishes microbatch m's last chunk at iteration (V - 1) M + m + P - 1.
  return h_IPBTD[(pipe.virtual_stages - 1) * num_micro + num_stages - 1 :, num_stages - 1]


def split_microbatches(tree, num_microbatches: int):
  """[B, ...] -> [M, B / M, ...], microbatch m = rows m, m + M, ... (as
  `training/step.py`'s gradient accumulation splits)."""
  return jax.tree.map(
    lambda x: x.reshape(
      x.shape[0] // num_microbatches, num_microbatches, *x.shape[1:]
    ).swapaxes(0, 1),
    tree,
  )


def loss_sums(params, batch, *, graphdef, pipe: PipelineConfig):
  """`evaluate.loss_sums` with the layers pipelined: (sum of weighted token
  cross-entropies, sum of weights) of the batch."""
  model = nnx.merge(graphdef, params)
  micro = split_microbatches(batch, pipe.num_microbatches)
  length = micro['inputs'].shape[-1]
  positions_BT = jnp.broadcast_to(jnp.arange(length), micro['inputs'].shape[1:])
  x_MBTD = jax.vmap(model.embed)(micro['inputs'])
  h_MBTD = pipeline_hidden(model, x_MBTD, positions_BT, pipe)

  def microbatch_sums(h_BTD, targets_BT, weights_BT):
    logits_BTV = model.head(h_BTD)
    losses_BT = optax.softmax_cross_entropy_with_integer_labels(
      logits_BTV.astype(jnp.float32), targets_BT
    )
    weights_BT = weights_BT.astype(jnp.float32)
    return jnp.sum(losses_BT * weights_BT), jnp.sum(weights_BT)

  loss_MB, weight_MB = jax.vmap(microbatch_sums)(
    h_MBTD, micro['targets'], micro['weights']
  )
  return jnp.sum(loss_MB), jnp.sum(weight_MB)


def make_loss_fn(pipe: PipelineConfig | None):
  """A drop-in for `evaluate.loss_sums(params, batch, *, graphdef)`, or None."""
  if pipe is None:
    return None
  return functools.partial(loss_sums, pipe=pipe)
