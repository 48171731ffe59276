"""Running the stacked layers through a residual (`residuals/base.py`).

The layers follow the layer contract (`layer_contract.py`: `sublayer_norm`,
`sublayer_body`, and the attribute `residual`), built by `make_layers` with a leading
'layers' axis. The stack applies them by `jax.lax.scan` over `nnx.split` state,
merging one layer's state inside the body (`sublayer_function`), never returning
parameters from it; each layer runs its `residual.sublayers_per_layer` sublayers in
order.

The layers run in schedule segments of `residual.segment_layers` layers: a scan over
segments whose body runs the segment's few layers unrolled (a last, shorter segment
runs after the scan when the segment length does not divide the depth). The standard
residual's segments are single layers; AttnRes starts each with Phase 1 of the block
schedule. Nothing here depends on which residual runs. `scan_layers=False` makes the
scan a Python loop too (a debugging path and the reference for the scan).
Decoding (`apply_layers_cached`) runs the same segments through the same residual
calls, unrolled over per-layer weights and KV caches (`docs/inference.md`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx

from attnres_jax.nn import layer_contract
from attnres_jax.nn import ops
from attnres_jax.nn import remat as remat_lib
from attnres_jax.nn.segments import group_segments
from attnres_jax.nn.segments import index_segment_layers
from attnres_jax.nn.segments import join_layers
from attnres_jax.nn.segments import segment_layers_of

LAYER_METHODS = layer_contract.LAYER_METHODS
check_layer = layer_contract.check_layer
make_layers = layer_contract.make_layers


def sublayer_function(graphdef, which: int, remat: str):
  """f(layer_state, h, positions) -> raw output of one sublayer, as a pure function
  run as the `model.remat` policy `remat` says (`nn/remat.py`)."""

  def apply(layer_state, h_BTD, positions_BT):
    layer = nnx.merge(graphdef, layer_state)
    return layer.sublayer_body(which, layer.sublayer_norm(which, h_BTD), positions_BT)

  return remat_lib.sublayer(remat, apply)


def sublayer_halves(graphdef, which: int):
  """`sublayer_function` split at its PreNorm, as pure functions: (norm(layer_state,
  h) -> normed, body(layer_state, normed, positions) -> raw output)."""

  def norm(layer_state, h_BTD):
    return nnx.merge(graphdef, layer_state).sublayer_norm(which, h_BTD)

  def body(layer_state, normed_BTD, positions_BT):
    return nnx.merge(graphdef, layer_state).sublayer_body(which, normed_BTD, positions_BT)

  return norm, body


def scan_or_loop(step, carry, xs, *, unroll: bool = False):
  """`jax.lax.scan(step, carry, xs)`, or the same as a Python loop when `unroll`."""
  if not unroll:
    return jax.lax.scan(step, carry, xs)
  ys = []
  for k in range(jax.tree.leaves(xs)[0].shape[0]):
    carry, y = step(carry, jax.tree.map(lambda x: x[k], xs))
    ys.append(y)
  return carry, jax.tree.map(lambda *y: jnp.stack(y), *ys)


def layer_entry(per_layer, j: int):
  """Layer `j`'s share of what `Residual.begin_segment` hands a segment's layers: the
  `j`-th item of a list (one entry per layer, e.g. AttnRes's Phase 1 outputs, kept
  apart so that none is stacked), else row `j` of every array (stacked over layers)."""
  if isinstance(per_layer, list):
    return per_layer[j]
  return jax.tree.map(lambda x: x[j], per_layer)


def token_mean(x_BT, token_weights_BT):
  """Weighted mean over tokens (a batch without weight gives 0)."""
  return jnp.sum(x_BT * token_weights_BT) / jnp.maximum(jnp.sum(token_weights_BT), 1e-30)


def _sublayer_stats(residual, applied, token_weights_BT):
  """Token-weighted means of one sublayer's statistics (for the analysis): its input
  and output RMS, and the residual's own (`Residual.sublayer_statistics`)."""
  mean = functools.partial(token_mean, token_weights_BT=token_weights_BT)
  entry = {
    'input_rms': mean(1.0 / ops.rms_inverse(applied.h_BTD, 0.0)),
    'output_rms': mean(1.0 / ops.rms_inverse(applied.out_BTD, 0.0)),
  }
  entry.update(residual.sublayer_statistics(applied.weights, mean))
  return entry


# apply_sublayer(which, layer_in_segment, layer_state, h, *, inner, extra, per_layer)
#   -> (out, saved): one sublayer's branch; `inner` is the residual's inner carry
#   before the sublayer, `extra` the layer's slice of `extra_xs`, `per_layer` the
#   layer's share of what `Residual.begin_segment` computed (AttnRes: its Phase 1).
SublayerHook = Callable[..., tuple[jax.Array, Any]]


def stacked_residual_params(graphdef, layer_states):
  """The residual parameters of several layers as one module of stacked arrays."""
  modules = [nnx.merge(graphdef, state).residual for state in layer_states]
  if modules[0] is None:
    return None
  graph = nnx.graphdef(modules[0])
  return nnx.merge(
    graph, jax.tree.map(lambda *x: jnp.stack(x), *[nnx.state(m) for m in modules])
  )


@dataclasses.dataclass(frozen=True)
class Resumed:
  """`base` run by `run_layers` from a received carry, which it passes where it
  would pass the embedding, its segments numbered from `segment_offset` (may be
  traced) on: a chunk of the layers in the middle of the model (a pipeline stage's)."""

  base: Any
  segment_offset: Any

  @property
  def segment_layers(self):
    return self.base.segment_layers

  @property
  def sublayers_per_layer(self):
    return self.base.sublayers_per_layer

  def init(self, carry):
    return carry

  def begin_segment(self, carry, params, segment):
    return self.base.begin_segment(carry, params, segment + self.segment_offset)

  def sublayer(self, *args):
    return self.base.sublayer(*args)

  def end_segment(self, carry, inner, segment):
    return self.base.end_segment(carry, inner, segment + self.segment_offset)


def _plain_sublayers(graphdef, positions_BT, remat: str, count: int) -> SublayerHook:
  """The default `apply_sublayer`: each of `count` sublayers' raw output, run as the
  remat policy `remat` says; nothing saved."""
  functions = [sublayer_function(graphdef, which, remat) for which in range(count)]

  def apply_sublayer(which, layer_in_segment, state_k, h_BTD, *, inner, extra, per_layer):
    del layer_in_segment, inner, extra, per_layer
    return functions[which](state_k, h_BTD, positions_BT), None

  return apply_sublayer


@dataclasses.dataclass(frozen=True)
class _SegmentRunner:
  """What `run_layers` runs per layer and per segment. `stats_weights_BT`: the
  token weights of the statistics, None when none are collected."""

  residual: Any
  graphdef: Any
  apply_sublayer: SublayerHook
  remat_layer: bool
  stats_weights_BT: Any

  def layer(self, inner, state_k, per_layer, extra, *, j):
    """Layer `j` of the segment: its sublayers through the residual; returns
    (inner carry, (what each sublayer saved, its statistics or None))."""
    residual, collect_stats = self.residual, self.stats_weights_BT is not None
    params = nnx.merge(self.graphdef, state_k).residual
    saved, stats = [], []
    for which in range(residual.sublayers_per_layer):
      branch = functools.partial(
        self.apply_sublayer,
        which,
        j,
        state_k,
        inner=inner,
        extra=extra,
        per_layer=per_layer,
      )
      inner, applied = residual.sublayer(inner, params, per_layer, j, which, branch)
      saved.append(applied.saved)
      if collect_stats:
        stats.append(_sublayer_stats(residual, applied, self.stats_weights_BT))
    stats = jax.tree.map(lambda *s: jnp.stack(s), *stats) if collect_stats else None
    return inner, (tuple(saved), stats)

  def segment(self, carry, xs):
    """The layers of one segment, unrolled: a segment is at most a few layers.
    `xs`: (their states, the segment's index, their extra inputs)."""
    layer_states, segment, extras = xs
    params = stacked_residual_params(self.graphdef, layer_states)
    inner, per_layer = self.residual.begin_segment(carry, params, segment)
    ys = []
    for j, (state_j, extra_j) in enumerate(zip(layer_states, extras)):
      step = functools.partial(self.layer, j=j)
      if self.remat_layer:
        step = jax.checkpoint(step)
      per_layer_j = layer_entry(per_layer, j)
      inner, ys_j = step(inner, state_j, per_layer_j, extra_j)
      ys.append(ys_j)
    return self.residual.end_segment(carry, inner, segment), tuple(ys)

  def grouped_segment(self, carry, xs, *, layer_state, size: int):
    """`segment` on one segment's slices [size, ...] of `group_segments`' arrays;
    with no slice of the states, its layers indexed in `layer_state` instead."""
    grouped_states, segment, grouped_extras = xs
    extras_j = (
      (None,) * size
      if grouped_extras is None
      else segment_layers_of(grouped_extras, size)
    )
    layers = (
      index_segment_layers(layer_state, segment, size)
      if grouped_states is None
      else segment_layers_of(grouped_states, size)
    )
    return self.segment(carry, (layers, segment, extras_j))


def run_layers(
  residual,
  graphdef,
  layer_state,
  x_BTD,
  positions_BT,
  *,
  cfg,
  apply_sublayer: SublayerHook | None = None,
  collect_stats=False,
  stats_weights_BT=None,
  extra_xs=None,
  index_layers: bool = False,
):
  """Runs every layer through `residual`; returns (final carry, per-layer outputs).

  Per-layer outputs: what `apply_sublayer` saved for each sublayer (a tuple) and the
  statistics when `collect_stats` (means over tokens weighted by `stats_weights_BT`,
  default uniform): the whole segments' as a tuple of `size` trees [num_segments,
  ...], one per position, the last shorter segment's a tuple of trees; `join_layers`
  stacks them over layers.
  `extra_xs`: per-layer inputs stacked over layers (a KV cache), handed to the hook.
  `index_layers`: the scan over whole segments indexes each layer's parameters in the
  whole stack [L, ...] (`index_segment_layers`: one dynamic slice per layer) instead of
  slicing a segment [size, ...] and then its layers (each slice a copy of parameters).
  Only where the scan is not differentiated (a custom VJP's forward): autodiff would
  add a cotangent of the whole stack per segment.
  """
  if apply_sublayer is None:
    apply_sublayer = _plain_sublayers(
      graphdef, positions_BT, cfg.remat, residual.sublayers_per_layer
    )
  if collect_stats and stats_weights_BT is None:
    stats_weights_BT = jnp.ones(x_BTD.shape[:2], jnp.float32)
  runner = _SegmentRunner(
    residual,
    graphdef,
    apply_sublayer,
    remat_layer=cfg.remat == 'layer',
    stats_weights_BT=stats_weights_BT if collect_stats else None,
  )
  size = residual.segment_layers
  num_full = cfg.num_layers // size
  states, extras = (
    group_segments(tree, cfg.num_layers, size) for tree in (layer_state, extra_xs)
  )
  carry = residual.init(x_BTD)
  full_ys = tail_ys = None
  if states[0] is not None:
    carry, full_ys = scan_or_loop(
      functools.partial(runner.grouped_segment, layer_state=layer_state, size=size),
      carry,
      (None if index_layers else states[0], jnp.arange(num_full), extras[0]),
      unroll=not cfg.scan_layers,
    )
  if states[1] is not None:
    extras_tail = extras[1] if extras[1] is not None else (None,) * len(states[1])
    carry, tail_ys = runner.segment(carry, (states[1], num_full, extras_tail))
  return carry, (full_ys, tail_ys)


def apply_layers(residual, graphdef, layer_state, x_BTD, positions_BT, *, cfg, **stats):
  """Runs the stacked layers from the embedding; returns (final residual carry,
  per-sublayer statistics [num_layers, sublayers_per_layer, ...] or None). `stats`: `run_layers`'
  `collect_stats` and `stats_weights_BT`."""
  collect_stats = stats.get('collect_stats', False)
  if collect_stats:
    residual = residual.for_statistics()
  if residual.custom_stack is not None and not collect_stats:
    return residual.custom_stack(graphdef, layer_state, x_BTD, positions_BT), None
  carry, ys = run_layers(
    residual, graphdef, layer_state, x_BTD, positions_BT, cfg=cfg, **stats
  )
  return carry, join_layers(ys)[1] if collect_stats else None


def apply_layers_cached(
  residual, graphdef, layers, x_BTD, positions_BT, caches, cache_index, start_B, *, cfg
):
  """Decoding: runs the layers with their KV caches; returns (final carry, caches).

  `layers` and `caches` hold one state / `KVCache` per layer, and the layers run
  unrolled: every weight and cache is then a buffer of its own that the step reads in
  place and updates in place (donated), where a scan over stacked layers slices out
  (copies) each layer's weights and threads the caches through as inputs and a fresh
  stacked output every token (`docs/inference.md` measures both). The schedule is
  training's: segments of `residual.segment_layers` layers through the same residual
  interface calls, so any residual decodes.
  """
  size = residual.segment_layers
  carry = residual.init(x_BTD)
  caches = list(caches)
  for segment, first in enumerate(range(0, cfg.num_layers, size)):
    states = layers[first : first + size]
    inner, per_layer = residual.begin_segment(
      carry, stacked_residual_params(graphdef, states), segment
    )
    for j, state_j in enumerate(states):
      layer = nnx.merge(graphdef, state_j)
      per_layer_j = layer_entry(per_layer, j)
      for which in range(residual.sublayers_per_layer):
        if which == 0:  # the attention sublayer also returns its updated cache
          branch = functools.partial(
            layer.sublayer,
            which,
            positions_BT=positions_BT,
            cache=caches[first + j],
            cache_index=cache_index,
            start_B=start_B,
          )
        else:
          branch = lambda h_BTD, layer=layer, which=which: (
            layer.sublayer(which, h_BTD, positions_BT),
            None,
          )
        inner, applied = residual.sublayer(
          inner, layer.residual, per_layer_j, j, which, branch
        )
        if which == 0:
          caches[first + j] = applied.saved
    carry = residual.end_segment(carry, inner, segment)
  return carry, tuple(caches)
