"""Per-layer stacked arrays [L, ...] in the layer stack's schedule (`stack.py`):
grouped into whole segments of `size` layers and a shorter last one, one segment's
layers taken out, and per-layer outputs stacked back over all layers."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def group_segments(tree, num_layers: int, size: int):
  """Per-layer stacked arrays [L, ...] in the schedule's layout: (the whole segments,
  each array [num_segments, size, ...], or None; the last, shorter segment as a tuple
  of single-layer trees, or None).

  The whole segments are a reshape of the leading layers, free when they are all of
  them: the scan over segments slices one segment's [size, ...] block (contiguous)
  and each layer takes its row of it, where a tree per position in the segment
  (`x[:, j]`, a strided slice) is a copy of every layer's parameters.
  """
  num_full, rest = divmod(num_layers, size)
  full = tail = None
  if num_full:
    full = jax.tree.map(
      lambda x: x[: num_full * size].reshape(num_full, size, *x.shape[1:]), tree
    )
  if rest:
    tail = tuple(
      jax.tree.map(lambda x: x[num_full * size + j], tree) for j in range(rest)
    )
  return full, tail


def segment_layers_of(grouped, size: int):
  """One segment's layers from its slice of `group_segments`' arrays [size, ...]."""
  return tuple(jax.tree.map(lambda x: x[j], grouped) for j in range(size))


def index_segment_layers(tree, segment, size: int):
  """Segment `segment`'s layers (may be traced) of per-layer stacked arrays [L, ...],
  each indexed in the whole stack: `segment_layers_of` without the segment's slice."""
  return tuple(
    jax.tree.map(
      lambda x: jax.lax.dynamic_index_in_dim(x, segment * size + j, 0, False), tree
    )
    for j in range(size)
  )


def ungroup_layers(grouped):
  """The inverse of `group_segments` for trees: one stack over all layers [L, ...]
  (a reshape when there is no shorter last segment)."""
  full, tail = grouped
  parts = []
  if full is not None:
    parts.append(jax.tree.map(lambda y: y.reshape(-1, *y.shape[2:]), full))
  if tail is not None:
    parts.append(jax.tree.map(lambda *y: jnp.stack(y), *tail))
  return (
    parts[0] if len(parts) == 1 else jax.tree.map(lambda *y: jnp.concatenate(y), *parts)
  )


def join_layers(segmented):
  """Per-layer outputs of `stack.run_layers` (the whole segments as a tuple of `size`
  trees [num_segments, ...], one per position; the shorter last segment as a tuple of
  single-layer trees) stacked over all layers [L, ...]."""
  full, tail = segmented
  if full is not None:
    full = jax.tree.map(lambda *y: jnp.stack(y, axis=1), *full)
  return ungroup_layers((full, tail))
