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

Shape suffixes as in `depth.py`, plus M: microbatches (`x_MBTD` is [M, B / M, T, D]).
"""

from __future__ import annotations

import dataclasses
import functools
import types

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from attnres_jax.parallel import pipeline_plan
from attnres_jax.parallel import pipeline_vjp
from attnres_jax.nn import sharding
from attnres_jax.parallel.pipeline_plan import PipelineConfig
from attnres_jax.parallel.pipeline_plan import TransferPlan
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


# -- the transfers ----------------------------------------------------------------------


def _select(condition, on_true, on_false):
  return jax.tree.map(lambda a, b: jnp.where(condition, a, b), on_true, on_false)


class NaiveTransfer:
  """The whole carry crosses every stage boundary."""

  def send(self, carry, chunk):
    del chunk
    return carry

  def receive(self, message, base, chunk):
    del base, chunk
    return message


class CachedTransfer:
  """A window of the AttnRes buffer crosses, merged into the receiver's cache."""

  def __init__(self, plan: TransferPlan, num_stages: int):
    self.plan = plan
    self.starts = jnp.asarray(plan.starts, jnp.int32)
    # From its second visit on a stage takes the slots below the window from its
    # cache, the rest from the window or empty: it caches only those slots.
    self.cache_slots = max(plan.starts[num_stages - 1 : -1], default=0)

  def to_cache(self, carry):
    return jax.tree.map(lambda x: x[: self.cache_slots], carry)

  def from_cache(self, cached, zero_carry):
    return jax.tree.map(lambda z, c: z.at[: self.cache_slots].set(c), zero_carry, cached)

  def send(self, carry, chunk):
    # A static chunk's start is static (nothing traced for a custom VJP to close over).
    start = self.plan.starts[chunk] if isinstance(chunk, int) else self.starts[chunk]
    return jax.tree.map(
      lambda x: jax.lax.dynamic_slice_in_dim(x, start, self.plan.width, 0), carry
    )

  def receive(self, message, base, chunk):
    """`chunk`: the sender's chunk; `base`: the receiver's cached carry."""
    start = self.starts[chunk]
    return jax.tree.map(
      lambda b, w: jax.lax.dynamic_update_slice_in_dim(b, w, start, 0), base, message
    )


def _constrain_stages(tree, axes, leading: int = 0):
  """Splits the leading axis of every leaf (a stacked carry, message or output with
  `leading` more axes before the carry's own `axes`) over `stage`; the rest as the
  carry's logical names say (the batch over the data axes, ...)."""
  if tree is None:
    return None
  is_axes = lambda x: isinstance(x, tuple) and all(isinstance(a, str) for a in x)
  return jax.tree.map(
    lambda names, x: sharding.constrain(x, ('stages',) + (None,) * leading + names),
    axes,
    tree,
    is_leaf=is_axes,
  )


def pipeline_hidden(model, x_MBTD, positions_BT, pipe: PipelineConfig):
  """The input of the final norm, [M, B/M, T, D], for the embedded microbatches
  `x_MBTD`, the layers run through the pipeline."""
  cfg = model.cfg
  num_stages, num_virtual = pipe.stages, pipe.virtual_stages
  num_micro, num_chunks = pipe.num_microbatches, pipe.num_chunks
  layers_per_chunk = cfg.num_layers // num_chunks
  residual, segments_per_chunk = model.residual.pipeline_chunk(layers_per_chunk)
  # The residual's own backward pass (AttnRes's linear-memory one) runs a chunk when
  # the chunk runs the residual's own schedule, re-segmented; not another one (a
  # block spanning chunk boundaries: `attnres.BufferReads`).
  custom_stack = None
  if type(residual) is type(model.residual):
    if pipe.schedule == 'remat' and cfg.remat == 'none':
      # The schedule keeps the chunk's backward residuals (`own_backward` below): with
      # remat='layer' those are the output buffer and the partial sums the sublayers
      # read, not every sublayer's activations; its backward reruns each sublayer.
      residual = dataclasses.replace(
        residual, cfg=dataclasses.replace(residual.cfg, remat='layer')
      )
    custom_stack = residual.custom_stack
  cached = residual.cached_transfer and pipe.transfer == 'cached'
  transfer = (
    CachedTransfer(pipeline_plan.transfer_plan(cfg, pipe), num_stages)
    if cached
    else NaiveTransfer()
  )
  # With V = 1 a stage sees each microbatch once; with nothing below the window, the
  # cache would hold no slot.
  keeps_cache = cached and num_virtual > 1 and transfer.cache_slots > 0
  graphdef, layer_state = nnx.split(model.layers)
  # 'remat' with the residual's own backward pass: the iteration is not rerun (no
  # `jax.checkpoint` around it); the chunk's VJP keeps what its backward needs, the
  # final read keeps its weights (`pipeline_vjp.final_read`), and the transfer code
  # keeps only indices and predicates.
  own_backward = custom_stack is not None and pipe.schedule == 'remat'
  final_params = model.final_residual
  final_read = lambda carry: residual.final(carry, final_params)[0]
  if own_backward:  # AttnRes (no ablations: `pipeline_refusal`)
    final_read = lambda carry: residual.to_compute(
      pipeline_vjp.final_read(
        carry.buffer_KBTD,
        carry.inv_rms_KBT,
        final_params.query[...],
        final_params.gain[...],
      )
    )
  # The first chunk's message: the initial carry's window.
  embedded = lambda x_MBTD, micro: transfer.send(residual.init(x_MBTD[micro]), 0)
  chunk_run = None
  if own_backward:
    # Both keep what is the same in every iteration (the embedded microbatches, the
    # stage's parameters), not a slice of it per iteration.
    embedded = pipeline_vjp.recomputed(embedded)
    chunk_run = pipeline_vjp.indexing_params(functools.partial(custom_stack, graphdef))
  # Under `jax.checkpoint` nothing is kept; without it, the scalar conditions.
  select = pipeline_vjp.select if own_backward else _select

  # [L, ...] -> [P, V, layers_per_chunk, ...]: chunk c = v P + p on stage p.
  # Each stage's chunks where the stage is; the other axes as the parameters' names say.
  is_spec = lambda x: isinstance(x, jax.sharding.PartitionSpec)
  stage_state = jax.tree.map(
    lambda x, spec: sharding.constrain(
      x.reshape(num_virtual, num_stages, layers_per_chunk, *x.shape[1:]).swapaxes(0, 1),
      ('stages', None, None) + tuple(spec)[1:],
    ),
    layer_state,
    nnx.get_partition_spec(layer_state),
    is_leaf=is_spec,
  )

  zero_carry = jax.tree.map(jnp.zeros_like, residual.init(x_MBTD[0]))
  zero_message = transfer.send(zero_carry, 0)
  stacked = lambda tree, *n: jax.tree.map(
    lambda x: jnp.zeros((*n, *x.shape), x.dtype), tree
  )
  # Stage 0 reads what the last stage sent M - P iterations after it arrived: a
  # delay line of M - P messages, entry t mod (M - P) read, then overwritten.
  delay = num_micro - num_stages if num_virtual > 1 else 0
  state = dict(
    inbox=stacked(zero_message, num_stages),
    wrap=stacked(zero_message, num_stages, delay) if delay else None,
    cache=stacked(transfer.to_cache(zero_carry), num_stages, num_micro)
    if keeps_cache
    else None,
  )
  carry_axes = residual.carry_axes()

  def constrain_state(state):
    return dict(
      inbox=_constrain_stages(state['inbox'], carry_axes),
      wrap=_constrain_stages(state['wrap'], carry_axes, 1),
      cache=_constrain_stages(state['cache'], carry_axes, 1),
    )

  def stage_step(stage, virtual_states, inbox, wrap, cache, t):
    """One iteration of one stage: receive, run its chunk, emit."""
    k = t - stage
    valid = (k >= 0) & (k < num_micro * num_virtual)
    k = jnp.clip(k, 0, num_micro * num_virtual - 1)
    micro, virtual = k % num_micro, k // num_micro
    chunk = virtual * num_stages + stage
    first = (stage == 0) & (virtual == 0)
    message = inbox
    if delay:  # stage 0 reads what arrived M - P iterations ago, stores what arrives
      entry = t % delay
      delayed, wrap = pipeline_vjp.swap_entry(wrap, entry, inbox)
      message = select(stage == 0, delayed, inbox)
    # The first chunk starts from the embedding: its message is the initial carry's
    # window (one select of W slots, not of the whole carry). The window lands at
    # slot 0 on a base that is zero there and above (nothing cached yet).
    message = select(first, embedded(x_MBTD, micro), message)
    base = zero_carry
    if keeps_cache:
      base = transfer.from_cache(jax.tree.map(lambda c: c[micro], cache), zero_carry)
    carry = transfer.receive(message, base, jnp.maximum(chunk - 1, 0))
    if keeps_cache:  # what this stage had of the microbatch, for its next visit
      cache = pipeline_vjp.set_entry_where(cache, micro, valid, transfer.to_cache(carry))
    if chunk_run is not None:
      carry = chunk_run(
        virtual_states, virtual, carry, positions_BT, chunk * segments_per_chunk
      )
    else:
      carry = run_chunk(
        residual,
        graphdef,
        jax.tree.map(lambda x: x[virtual], virtual_states),
        carry,
        chunk * segments_per_chunk,
        positions_BT,
        model_config=cfg,
        layers_per_chunk=layers_per_chunk,
        custom_stack=custom_stack,
      )
    h_BTD = final_read(carry)  # used from the last chunk only
    return transfer.send(carry, chunk), h_BTD, wrap, cache

  stages_step = jax.vmap(
    stage_step, in_axes=(0, 0, 0, 0, 0, None), spmd_axis_name=sharding.STAGE_AXIS
  )

  def iteration(state, t):
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
    state = constrain_state(dict(inbox=inbox, wrap=wrap, cache=cache))
    # Outputs leave as the scan's per-iteration results, not in its carry: a carry
    # is what the backward pass keeps once per iteration.
    return state, _constrain_stages(h_PBTD, sharding.HIDDEN)

  if pipe.schedule in ('remat', 'remat_rerun') and not own_backward:
    # The backward pass reruns each iteration from its saved carry (what the stages
    # received) instead of keeping the activations of every microbatch in flight.
    # With the residual's own backward, 'remat' needs no rerun (`own_backward`).
    iteration = jax.checkpoint(
      iteration, prevent_cse=False, policy=jax.checkpoint_policies.nothing_saveable
    )
  _, h_IPBTD = jax.lax.scan(
    iteration, constrain_state(state), jnp.arange(pipe.num_iterations)
  )
  # The last stage finishes microbatch m's last chunk at iteration (V - 1) M + m + P - 1.
  return h_IPBTD[(num_virtual - 1) * num_micro + num_stages - 1 :, num_stages - 1]


def split_microbatches(tree, num_microbatches: int):
  """[B, ...] -> [M, B / M, ...], microbatch m = rows m, m + M, ... (as train.py's
  gradient accumulation splits)."""
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
