"""How the Pallas kernels (depth_pallas.py, residuals/hyper_pallas.py,
residuals/sinkhorn_pallas.py) run under the model's mesh: per device, in
`jax.shard_map`, on arrays laid out like the depth buffer [K, B, T, D] (logical axes
`sharding.DEPTH_BUFFER`; HC's streams share them) and split over batch and length
only. Each kernel works on whole slots (or streams) and the whole width. Also a
slot's memory layout pinned per device (`width_minor`, any split)."""

from __future__ import annotations

import jax
from jax.experimental import layout
from jax.sharding import PartitionSpec as P

from attnres_jax.nn import sharding


def _multi_device_mesh():
  """(mesh, sharding rules) of the active mesh; None on one device or outside one."""
  active = sharding._ACTIVE.get()
  return None if active is None or active[0].size == 1 else active


def batch_length_split(shape, what: str, first_axis: str):
  """Under the active mesh: (mesh, the batch's mesh axes, the length's) of a
  [K, B, T, D] array of `shape` as the sharding rules split it; None on one device or
  outside a mesh. A split over K or the width is refused; `what` names the array and
  `first_axis` its K in the message."""
  active = _multi_device_mesh()
  if active is None:
    return None
  mesh, rules = active
  spec = tuple(
    sharding.logical_to_spec(sharding.DEPTH_BUFFER, rules, mesh=mesh, shape=shape)
  )
  k, b, t, d = spec + (None,) * (4 - len(spec))
  if k is not None or d is not None:
    raise ValueError(
      f"depth_kernel='pallas' needs {what} split over batch and length only; the "
      f'sharding rules split it as {P(k, b, t, d)} ({first_axis}, batch, '
      f"length, width) on mesh {dict(mesh.shape)}: map 'depth' and 'hidden' to no "
      f"mesh axis or use depth_kernel='xla'."
    )
  return mesh, b, t


def width_minor(x, axes=sharding.DEPTH_BUFFER[1:]):
  """`x` (a slot [B, T, D], or with `axes` the buffer [K, B, T, D]) laid out with its
  width minor (each token's D values contiguous), as the sublayers' activations are;
  the TPU compiler may otherwise pick the depth buffer's tokens-minor layout for it
  and relayout what meets it. Pinned per device: under a mesh, outside `shard_map`,
  the compiler gathers a layout-constrained array whole."""
  pin = lambda y: layout.with_layout_constraint(
    y, layout.Layout(major_to_minor=tuple(range(y.ndim)))
  )
  active = _multi_device_mesh()
  if active is None:
    return pin(x)
  mesh, rules = active
  spec = P(*sharding.logical_to_spec(axes, rules, mesh=mesh, shape=x.shape))
  return jax.shard_map(pin, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False)(x)
