"""What crosses the pipeline's stage boundaries (`pipeline.py`) and where it waits:
the transfers (the whole carry, or the window of the AttnRes buffer written since the
receiver last saw it, merged into the receiver's cache), each stage's inbox, stage
0's delay line and the per-microbatch cache, all stacked over the stages.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from attnres_jax.nn import sharding
from attnres_jax.parallel import pipeline_plan
from attnres_jax.parallel.pipeline_plan import PipelineConfig
from attnres_jax.parallel.pipeline_plan import TransferPlan


def select(condition, on_true, on_false):
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


def make_transfer(residual, cfg, pipe: PipelineConfig):
  """(how the carry crosses a stage boundary, whether each stage keeps a cache of
  every microbatch's carry)."""
  cached = residual.cached_transfer and pipe.transfer == 'cached'
  transfer = (
    CachedTransfer(pipeline_plan.transfer_plan(cfg, pipe), pipe.stages)
    if cached
    else NaiveTransfer()
  )
  # With V = 1 a stage sees each microbatch once; with nothing below the window, the
  # cache would hold no slot.
  keeps_cache = cached and pipe.virtual_stages > 1 and transfer.cache_slots > 0
  return transfer, keeps_cache


def constrain_stages(tree, axes, leading: int = 0):
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


def delay_length(pipe: PipelineConfig) -> int:
  """Stage 0 reads what the last stage sent M - P iterations after it arrived: a
  delay line of M - P messages, entry t mod (M - P) read, then overwritten."""
  return pipe.num_microbatches - pipe.stages if pipe.virtual_stages > 1 else 0


def initial_state(transfer, zero_carry, pipe: PipelineConfig, keeps_cache: bool):
  """The scan's carry before the first iteration, all zero: each stage's inbox, the
  delay line and the cache."""
  zero_message = transfer.send(zero_carry, 0)
  stacked = lambda tree, *n: jax.tree.map(
    lambda x: jnp.zeros((*n, *x.shape), x.dtype), tree
  )
  delay, num_stages = delay_length(pipe), pipe.stages
  return dict(
    inbox=stacked(zero_message, num_stages),
    wrap=stacked(zero_message, num_stages, delay) if delay else None,
    cache=stacked(transfer.to_cache(zero_carry), num_stages, pipe.num_microbatches)
    if keeps_cache
    else None,
  )


def constrain_state(state, carry_axes):
  return dict(
    inbox=constrain_stages(state['inbox'], carry_axes),
    wrap=constrain_stages(state['wrap'], carry_axes, 1),
    cache=constrain_stages(state['cache'], carry_axes, 1),
  )
