"""Whether the Pallas kernels run (`choose_kernel`: `model.depth_kernel='auto'` decided
by the devices the step is compiled for), and how they run under the model's mesh
(depth_pallas.py, hyper_pallas.py, sinkhorn_pallas.py): per device, in
`jax.shard_map`, on arrays laid out like the depth buffer [K, B, T, D] (logical axes
`sharding.DEPTH_BUFFER`; HC's streams share them) and split over batch and length
only. Each kernel works on whole slots (or streams) and the whole width. Also a
slot's memory layout pinned per device (`width_minor`, any split)."""

from __future__ import annotations

from collections.abc import Callable

import jax
from absl import logging
from jax.experimental import layout
from jax.sharding import PartitionSpec as P

from attnres_jax.nn import sharding


KERNEL_SETTINGS = ('auto', 'xla', 'pallas')  # model.depth_kernel
_SAID: set[str] = set()  # the fallbacks already logged


def compiles_for_tpu() -> bool:
  """Whether the program being traced is compiled for TPU devices
  (`sharding.compile_platform`)."""
  return sharding.compile_platform() == 'tpu'


def _split_refusal() -> str | None:
  """Why the active mesh's rules keep the kernels out (they split a [K, B, T, D]
  array over K or the width), None if they do not."""
  active = _multi_device_mesh()
  if active is None:
    return None
  mesh, rules = active
  for name in (sharding.DEPTH_BUFFER[0], sharding.DEPTH_BUFFER[-1]):
    if any(mesh.shape[a] > 1 for a in sharding.mesh_axes(name, rules)):
      return f'the sharding rules split the {name!r} axis, which the kernels keep whole'
  return None


def choose_kernel(setting: str, refusal: Callable[[], str | None] | None = None) -> str:
  """'xla' or 'pallas' for a `model.depth_kernel` setting, at trace time. 'xla' and
  'pallas' are themselves; 'auto' is 'pallas' where the program is compiled for TPU
  devices (`compiles_for_tpu`) and the kernels can run it, else 'xla'. `refusal()`
  says why a kernel cannot run the model (e.g. it does not fit on chip), None if it
  can; that, or a mesh whose rules split the depth or width axis, falls back to XLA,
  said once in the log."""
  if setting != 'auto':
    return setting
  if not compiles_for_tpu():
    return 'xla'
  reason = (refusal() if refusal is not None else None) or _split_refusal()
  if reason is None:
    return 'pallas'
  if reason not in _SAID:
    _SAID.add(reason)
    logging.warning(
      "depth_kernel='auto': the XLA path, not the Pallas kernels: %s.", reason
    )
  return 'xla'


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
      f"mesh axis or use depth_kernel='xla' (or 'auto')."
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
