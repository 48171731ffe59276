"""Custom VJPs of the pipeline's schedule (`pipeline.py`) for the 'remat' schedule with
the residual's own backward pass: the schedule's scan is differentiated without a
`jax.checkpoint` around its iteration, so what each iteration keeps is what these
VJPs keep: the chunk's backward residuals without its parameters (`indexing_params`),
the final read's inputs and its softmax weights (`final_read`), the arguments of what
is cheap to rerun (`recomputed`: the first chunk's embedded window), the scalar
conditions of the schedule's selects (`select`). On the TPU compile (`bench/pipeline.py
--topology=v5p:2x2x1`) Block S=4 at V = 1 estimates 83.2 ms (84.2 before).

The delay line's and the cache's entry updates (`swap_entry`, `set_entry_where`, used
with either backward) have backward passes that update the cotangents in place; plain
autodiff copied the whole cotangent stacks every iteration (V = 2, full/bf16/pallas:
100.84 -> 96.61 ms, docs/pipeline.md)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from attnres_jax.residuals.attnres import depth


class _Param:
  """Where a VJP held a leaf of the chunk's parameters: a pytree node without
  leaves, the leaf's index its static data."""

  def __init__(self, index: int):
    self.index = index


jax.tree_util.register_pytree_node(
  _Param, lambda p: ((), p.index), lambda index, _: _Param(index)
)


def indexing_params(chunk_fn):
  """`chunk_fn(chunk_state, carry, positions_BT, segment_offset) -> carry` as
  `run(virtual_states, virtual, carry, positions_BT, segment_offset)` on the chunk
  `virtual` of the stage's stacked parameters, its VJP keeping what `chunk_fn`'s VJP
  keeps except the parameters' slice: it keeps the stacked parameters instead (the
  same in every iteration of the schedule, which its backward pass does not stack)
  and slices them again. Without it the schedule would keep the chunk's parameters
  once per iteration."""
  take = lambda states, virtual: jax.tree.map(lambda x: x[virtual], states)
  is_param = lambda x: isinstance(x, _Param)

  @jax.custom_vjp
  def run(virtual_states, virtual, carry, positions_BT, segment_offset):
    state = take(virtual_states, virtual)
    return chunk_fn(state, carry, positions_BT, segment_offset)

  def forward(virtual_states, virtual, carry, positions_BT, segment_offset):
    state = take(virtual_states, virtual)
    out, vjp_fn = jax.vjp(
      lambda s, c: chunk_fn(s, c, positions_BT, segment_offset), state, carry
    )
    param_at = {id(x): i for i, x in enumerate(jax.tree.leaves(state))}
    kept = jax.tree.map(
      lambda x: _Param(param_at[id(x)]) if id(x) in param_at else x, vjp_fn
    )
    return out, (virtual_states, virtual, kept)

  def backward(residuals, d_out):
    virtual_states, virtual, kept = residuals
    params = jax.tree.leaves(take(virtual_states, virtual))
    vjp_fn = jax.tree.map(
      lambda x: params[x.index] if is_param(x) else x, kept, is_leaf=is_param
    )
    d_state, d_carry = vjp_fn(d_out)
    d_states = jax.tree.map(
      lambda x, d: jnp.zeros_like(x).at[virtual].add(d), virtual_states, d_state
    )
    return d_states, None, d_carry, None, None

  run.defvjp(forward, backward)
  return run


def recomputed(fn):
  """`fn(*args)` whose VJP keeps only its arguments and reruns `fn` in the backward
  pass (as `jax.checkpoint` with nothing saveable, without the `reduce_precision` it
  inserts on the kept values: a pass over the whole carry)."""

  @jax.custom_vjp
  def run(*args):
    return fn(*args)

  def forward(*args):
    return fn(*args), args

  def backward(args, d_out):
    return jax.vjp(fn, *args)[1](d_out)

  run.defvjp(forward, backward)
  return run


def final_read(buffer_KBTD, inv_rms_KBT, query_D, gain_D):
  """AttnRes's final read (`depth.read_parts` over the whole buffer, the inverse RMS
  given), in the buffer's dtype, its VJP keeping its inputs and the float32 weights
  and dots [K, B, T]: the backward pass reads the buffer twice (the weights'
  cotangent, then the buffer's and the query's) instead of recomputing the logits
  first."""
  return _final_read(buffer_KBTD, inv_rms_KBT, query_D, gain_D)


def _final_forward(buffer_KBTD, inv_rms_KBT, query_D, gain_D):
  # The inverse RMS is given, so read_parts' eps (which would size it) is unused.
  h_BTD, (weights_KBT, dots_KBT, _) = depth.read_parts(
    buffer_KBTD, query_D, gain_D, eps=0.0, inv_rms_KBT=inv_rms_KBT
  )
  return h_BTD, (weights_KBT, dots_KBT)


@jax.custom_vjp
def _final_read(buffer_KBTD, inv_rms_KBT, query_D, gain_D):
  return _final_forward(buffer_KBTD, inv_rms_KBT, query_D, gain_D)[0]


def _final_read_forward(buffer_KBTD, inv_rms_KBT, query_D, gain_D):
  h_BTD, stats = _final_forward(buffer_KBTD, inv_rms_KBT, query_D, gain_D)
  return h_BTD, (buffer_KBTD, inv_rms_KBT, query_D, gain_D, *stats)


def _final_read_backward(residuals, d_out):
  buffer_KBTD, inv_rms_KBT, query_D, gain_D, weights_KBT, dots_KBT = residuals
  d_h_BTD = d_out.astype(jnp.float32)
  values_KBTD = buffer_KBTD.astype(jnp.float32)
  folded_D = query_D.astype(jnp.float32) * gain_D.astype(jnp.float32)
  d_weights_KBT = jnp.sum(values_KBTD * d_h_BTD[None], axis=-1)
  d_logits_KBT = weights_KBT * (
    d_weights_KBT - jnp.sum(weights_KBT * d_weights_KBT, axis=0, keepdims=True)
  )
  d_dots_KBT = d_logits_KBT * inv_rms_KBT
  d_buffer_KBTD = (
    weights_KBT[..., None] * d_h_BTD[None]
    + d_dots_KBT[..., None] * folded_D[None, None, None]
  )
  d_folded_D = jnp.sum(d_dots_KBT[..., None] * values_KBTD, axis=(0, 1, 2))
  return (
    d_buffer_KBTD.astype(buffer_KBTD.dtype),
    d_logits_KBT * dots_KBT,
    (d_folded_D * gain_D.astype(jnp.float32)).astype(query_D.dtype),
    (d_folded_D * query_D.astype(jnp.float32)).astype(gain_D.dtype),
  )


_final_read.defvjp(_final_read_forward, _final_read_backward)


@jax.custom_vjp
def select(condition, on_true, on_false):
  """`jnp.where(condition, on_true, on_false)` for a scalar `condition` and pytrees,
  its VJP keeping the scalar: autodiff keeps the condition broadcast to the values'
  shape (under the stages' vmap the broadcast is part of the primal), one boolean per
  element and iteration."""
  return jax.tree.map(lambda a, b: jnp.where(condition, a, b), on_true, on_false)


def _select_forward(condition, on_true, on_false):
  return select(condition, on_true, on_false), condition


def _select_backward(condition, d_out):
  zero = lambda d: jnp.zeros_like(d)
  return (
    None,
    jax.tree.map(lambda d: jnp.where(condition, d, zero(d)), d_out),
    jax.tree.map(lambda d: jnp.where(condition, zero(d), d), d_out),
  )


select.defvjp(_select_forward, _select_backward)


def _read_then_set(stacked, index, rows):
  """(stacked[index], stacked with entry `index` set to `rows(stacked[index])`) for a
  pytree of arrays with a leading entry axis, each read ordered before its write: the
  write then updates the array in place. Unordered, the compiler copies the whole
  stack to keep the entry readable (every iteration, in the backward pass of the
  schedule's delay line and cache: bench/pipeline.py v5p, P=2 V=2, four copies of
  their cotangents an iteration)."""
  leaves, treedef = jax.tree.flatten(stacked)
  old = [x[index] for x in leaves]
  old, leaves = jax.lax.optimization_barrier((old, leaves))
  new = jax.tree.leaves(rows(treedef.unflatten(old)))
  leaves = [x.at[index].set(n) for x, n in zip(leaves, new)]
  return treedef.unflatten(old), treedef.unflatten(leaves)


@jax.custom_vjp
def swap_entry(stacked, index, new):
  """(stacked[index], stacked with entry `index` replaced by `new`) for a pytree of
  arrays with a leading entry axis. Its backward pass is the same swap of the
  cotangents (`d_new` = d_stacked[index], whose entry becomes `d_old`), in place."""
  return _read_then_set(stacked, index, lambda _: new)


def _swap_entry_forward(stacked, index, new):
  return _read_then_set(stacked, index, lambda _: new), index


def _swap_entry_backward(index, cotangents):
  d_old, d_stacked = cotangents
  d_new, d_stacked = _read_then_set(d_stacked, index, lambda _: d_old)
  return d_stacked, None, d_new


swap_entry.defvjp(_swap_entry_forward, _swap_entry_backward)


@jax.custom_vjp
def set_entry_where(stacked, index, condition, new):
  """`stacked` with entry `index` replaced by `new` where the scalar `condition`
  holds, kept where not; its backward pass reads the entry's cotangent before it
  zeroes it (`condition`) in place, keeping only the index and the condition."""
  return jax.tree.map(
    lambda s, n: s.at[index].set(jnp.where(condition, n, s[index])), stacked, new
  )


def _set_entry_where_forward(stacked, index, condition, new):
  return set_entry_where(stacked, index, condition, new), (index, condition)


def _set_entry_where_backward(residuals, d_out):
  index, condition = residuals
  # The entry's cotangent splits as the select's (`select(condition, new, old)`):
  # to `new` where the condition holds, back to the kept entry where not.
  d_rows, d_stacked = _read_then_set(
    d_out, index, lambda rows: _select_backward(condition, rows)[2]
  )
  return d_stacked, None, None, _select_backward(condition, d_rows)[1]


set_entry_where.defvjp(_set_entry_where_forward, _set_entry_where_backward)
