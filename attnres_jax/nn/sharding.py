"""Logical axis names -> device mesh axes, in one place.

Parameters carry logical axis names in their `out_sharding` metadata
(`models/transformer.py`; the stacked layers add a leading 'layers'); key activations
are constrained with `constrain(x, names)`. The rules in `config.mesh.rules` map every logical name to the
tuple of mesh axes it is split over (empty: not split). The mesh has three axes:

  data    pure data parallelism: the batch is split, everything else replicated
  fsdp    the batch is split AND the parameters and optimizer state are split along
          their 'embed' dimension (ZeRO-3 / FSDP: each layer's weights are gathered
          just before use)
  tensor  tensor (Megatron) parallelism: attention heads, the MLP hidden units and the
          vocabulary are split, activations along them too

plus a fourth, outermost axis `stage` (size `mesh.stage`, 1 by default) for pipeline
parallelism (`parallel/pipeline.py`): the stacked layers ('layers') are split over
it, and the pipeline's per-stage activations ('stages').

Activations use their own name for the model width, 'hidden', separate from the
parameters' 'embed': under FSDP the batch already uses the fsdp axis, so the hidden
state is split along batch only (or along 'tensor' too, if mapped so). The AttnRes
depth buffers [S, B, T, D] are laid out like the hidden state, with the source axis
'depth' never split, so every depth read is local to a device (no all-gather of the
buffer; the small pseudo-query and gain are gathered instead).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import jax
import ml_collections
import optax
from absl import logging
from flax import nnx
from jax.experimental import mesh_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

AXIS_NAMES = ('data', 'fsdp', 'tensor')
STAGE_AXIS = 'stage'  # pipeline stages: always the mesh's first axis
PIPELINE_TRANSFERS = ('naive', 'cached')

# logical name -> the mesh axes it is split over (empty: not split): the default of
# config.mesh.rules. Tuples, so that one rule can be overridden on the command line:
# --config.mesh.rules.hidden=tensor.
DEFAULT_RULES = {
  # activations
  'batch': ('data', 'fsdp'),  # activations and batches
  'length': (),
  'hidden': (),  # model width of activations and depth sources
  'depth': (),  # the AttnRes source axis of the depth buffers (HC: streams)
  # parameters (and the activations along the same dimension)
  'embed': ('fsdp',),  # model width of weights: FSDP splits parameters here
  'heads': ('tensor',),
  'head_dim': (),
  'mlp': ('tensor',),
  'vocab': ('tensor',),
  'layers': ('stage',),  # the stacked-layer axis: pipeline stages hold slices of it
  'stages': ('stage',),  # the pipeline's per-stage axis of activations
  'sublayers': (),  # attention / MLP rows of the residuals' layer parameters
}

Rules = Mapping[str, Any]

# Logical axes of the key activations.
HIDDEN = ('batch', 'length', 'hidden')  # residual stream, sublayer I/O
DEPTH_BUFFER = ('depth', 'batch', 'length', 'hidden')  # AttnRes sources [S, B, T, D]


def default_mesh_config(**overrides) -> ml_collections.ConfigDict:
  """The `mesh` config section: shape (one -1 = the remaining devices), axis names and
  the logical-axis rules. Default: all devices data parallel; e.g.
  --config.mesh.shape='(2,2,2)' for data x FSDP x tensor parallelism, and
  --config.mesh.stage=2 to pipeline the layers over 2 stages (`parallel/pipeline.py`;
  the shape then covers the devices of one stage)."""
  cfg = ml_collections.ConfigDict(
    dict(
      shape=(-1, 1, 1),
      axis_names=AXIS_NAMES,
      rules=dict(DEFAULT_RULES),
      stage=1,  # pipeline stages P (1: no pipeline)
      virtual_stages=1,  # V chunks per stage: 1 GPipe, > 1 interleaved (circular)
      num_microbatches=1,  # M microbatches in flight in the pipeline (V > 1: M >= P)
      pipeline_transfer='cached',  # AttnRes state between stages: 'naive' | 'cached'
    )
  )
  cfg.update(overrides)
  return cfg


def _as_axes(value) -> tuple[str, ...]:
  """A rule's value (None, an axis name, or a sequence of them; JSON gives lists) as a
  tuple of mesh axis names."""
  if value is None:
    return ()
  if isinstance(value, str):
    return (value,)
  return tuple(value)


def rules_from_config(
  mesh_config: ml_collections.ConfigDict,
) -> dict[str, tuple[str, ...]]:
  """The rules of a mesh config section (the defaults if it has none)."""
  rules = mesh_config.get('rules')
  if rules is None:
    rules = DEFAULT_RULES
  if isinstance(rules, ml_collections.ConfigDict):
    rules = rules.to_dict()
  return {name: _as_axes(value) for name, value in dict(rules).items()}


def _invalid(message: str):
  raise ValueError(f'Invalid mesh config: {message}')


def validate_mesh_config(mesh_config: ml_collections.ConfigDict) -> None:
  """Raises ValueError for a malformed mesh section (before any device is touched)."""
  shape, names = tuple(mesh_config.shape), tuple(mesh_config.axis_names)
  if len(shape) != len(names) or list(shape).count(-1) > 1:
    _invalid(
      f'shape {shape} and axis_names {names} must have equal lengths, with at most '
      'one -1.'
    )
  if 'data' not in names:
    _invalid(f"axis_names {names} has no 'data' axis.")
  if STAGE_AXIS in names:
    _invalid(
      f'axis_names {names} must not name {STAGE_AXIS!r}: it is added by mesh.stage.'
    )
  for name in ('stage', 'virtual_stages', 'num_microbatches'):
    value = mesh_config.get(name, 1)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
      _invalid(f'{name} must be a positive integer, got {value!r}.')
  transfer = mesh_config.get('pipeline_transfer', 'cached')
  if transfer not in PIPELINE_TRANSFERS:
    _invalid(f'pipeline_transfer must be one of {PIPELINE_TRANSFERS}, got {transfer!r}.')
  if mesh_config.get('stage', 1) == 1 and (mesh_config.get('virtual_stages', 1) > 1):
    _invalid('virtual_stages > 1 needs a pipeline (mesh.stage > 1).')
  names = names + (STAGE_AXIS,)
  for name, axes in rules_from_config(mesh_config).items():
    unknown = [a for a in axes if a not in names]
    if unknown:
      _invalid(
        f'rule {name!r} -> {axes!r} names mesh axes {unknown} that are not in '
        f'axis_names {names}.'
      )
    if len(set(axes)) != len(axes):
      _invalid(f'rule {name!r} -> {axes!r} repeats an axis.')


def make_mesh(
  mesh_config: ml_collections.ConfigDict, devices: Sequence[jax.Device] | None = None
) -> Mesh:
  """The device mesh of `mesh_config` over `devices` (default: all devices of all
  processes); one -1 in the shape takes the remaining devices.

  The axes are `Auto`: the compiler propagates shardings from the parameters, the
  batch and the `constrain` calls. The first axis is `stage` (size `mesh.stage`).
  """
  count = len(devices) if devices is not None else jax.device_count()
  shape = mesh_shape(mesh_config, count)
  names, sizes = tuple(shape), list(shape.values())
  axis_types = (jax.sharding.AxisType.Auto,) * len(names)
  listed = jax.devices() if devices is None else devices
  slices = len({getattr(d, 'slice_index', 0) for d in listed})
  if slices > 1:  # multi-slice: the data axis spans the slices (DCN), the rest ICI
    data = names.index('data')
    if sizes[data] % slices:
      raise ValueError(
        f'The data axis ({sizes[data]} devices) must be a multiple of the '
        f'{slices} slices: only data parallelism crosses slices.'
      )
    ici, dcn = list(sizes), [1] * len(sizes)
    ici[data], dcn[data] = sizes[data] // slices, slices
    return Mesh(
      mesh_utils.create_hybrid_device_mesh(ici, dcn, devices=devices),
      names,
      axis_types=axis_types,
    )
  return jax.make_mesh(tuple(sizes), names, devices=devices, axis_types=axis_types)


def mesh_shape(
  mesh_config: ml_collections.ConfigDict, num_devices: int
) -> dict[str, int]:
  """Mesh axis name -> size on `num_devices` devices, `stage` first (the -1 resolved);
  ValueError if the shape does not cover the devices."""
  validate_mesh_config(mesh_config)
  stages = mesh_config.get('stage', 1)
  shape = [stages] + list(mesh_config.shape)
  if -1 in shape:
    known = math.prod(s for s in shape if s != -1)
    if known < 1 or num_devices % known:
      raise ValueError(
        f'Mesh shape {tuple(mesh_config.shape)} with stage={stages} '
        f'does not fit {num_devices} devices.'
      )
    shape[shape.index(-1)] = num_devices // known
  if math.prod(shape) != num_devices:
    raise ValueError(
      f'Mesh shape {tuple(mesh_config.shape)} with stage={stages} does '
      f'not cover the {num_devices} devices.'
    )
  return dict(zip((STAGE_AXIS,) + tuple(mesh_config.axis_names), shape))


def mesh_axes(logical_name: str | None, rules: Rules) -> tuple[str, ...]:
  """The mesh axes a logical axis name is split over (empty: not split)."""
  if logical_name is None:
    return ()
  if logical_name not in rules:
    raise KeyError(
      f'No sharding rule for the logical axis {logical_name!r}; rules '
      f'exist for {sorted(rules)} (config.mesh.rules).'
    )
  return _as_axes(rules[logical_name])


def logical_to_spec(
  logical_axes: Sequence[str | None],
  rules: Rules,
  *,
  mesh: Mesh | None = None,
  shape: Sequence[int] | None = None,
) -> P:
  """The PartitionSpec of an array whose dimensions have `logical_axes` names.

  Given the `mesh` and the array `shape`, a dimension that the mesh axes of its rule
  do not divide evenly is left unsplit (e.g. 2 heads on a 4-way tensor axis), as is
  a mesh axis that another dimension of the same array already uses.
  """
  used, spec = set(), []
  for i, name in enumerate(logical_axes):
    axes = tuple(a for a in mesh_axes(name, rules) if a not in used)
    if mesh is not None:
      axes = tuple(a for a in axes if mesh.shape[a] > 1)
      if shape is not None and shape[i] % math.prod(mesh.shape[a] for a in axes):
        axes = ()
    used.update(axes)
    spec.append(None if not axes else axes[0] if len(axes) == 1 else axes)
  while spec and spec[-1] is None:
    spec.pop()
  return P(*spec)


def logical_axes_tree(abstract_state: nnx.State):
  """The logical axis names (a tuple per leaf) of an NNX state with `out_sharding`
  metadata, as a pure dict like `nnx.to_pure_dict(state)`."""
  specs = nnx.get_partition_spec(abstract_state)
  return nnx.to_pure_dict(jax.tree.map(tuple, specs, is_leaf=lambda x: isinstance(x, P)))


def param_shardings(abstract_state: nnx.State, mesh: Mesh, rules: Rules):
  """NamedShardings of the parameters (pure dict), from their logical axis names."""
  names = logical_axes_tree(abstract_state)
  shapes = nnx.to_pure_dict(abstract_state)

  def sharding(path, axes, leaf):
    spec = logical_to_spec(axes, rules, mesh=mesh, shape=leaf.shape)
    wanted = logical_to_spec(axes, rules, mesh=mesh)
    if spec != wanted:
      logging.warning(
        'Parameter %s %s%s: its logical axes %s -> %s do not divide '
        'evenly on mesh %s; using %s.',
        jax.tree_util.keystr(path),
        leaf.dtype,
        leaf.shape,
        axes,
        wanted,
        dict(mesh.shape),
        spec,
      )
    return NamedSharding(mesh, spec)

  return jax.tree_util.tree_map_with_path(
    sharding, names, shapes, is_leaf=lambda x: isinstance(x, tuple)
  )


# -- activation constraints -----------------------------------------------------------

_ACTIVE: contextvars.ContextVar[tuple[Mesh, Rules] | None] = contextvars.ContextVar(
  'attnres_sharding_rules', default=None
)


@contextlib.contextmanager
def logical_rules(mesh: Mesh, rules: Rules) -> Iterator[None]:
  """Within this context `constrain` maps logical names with `rules` onto `mesh`.

  Enter it inside the jitted function (see `training/step.py`), so that every trace of it
  sees the rules whatever the caller's context.
  """
  token = _ACTIVE.set((mesh, dict(rules)))
  try:
    yield
  finally:
    _ACTIVE.reset(token)


def compile_platform() -> str:
  """The platform ('tpu', 'gpu', 'cpu') of the devices of the mesh the program is
  traced under (`logical_rules`: a compile-only run for a TPU topology on a CPU host
  gets 'tpu'), else of JAX's default backend (eager code, a plain jit)."""
  active = _ACTIVE.get()
  if active is not None:
    return active[0].devices.flat[0].platform
  return jax.default_backend()


def constrain(x: jax.Array, logical_axes: Sequence[str | None]) -> jax.Array:
  """Constrains an activation's sharding by logical axis names; a no-op outside
  `logical_rules` (single device, eager code, decoding)."""
  active = _ACTIVE.get()
  if active is None:
    return x
  mesh, rules = active
  if len(logical_axes) != x.ndim:
    raise ValueError(
      f'constrain: {len(logical_axes)} names {tuple(logical_axes)} for '
      f'an array of shape {x.shape}.'
    )
  spec = logical_to_spec(logical_axes, rules, mesh=mesh, shape=x.shape)
  return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


# -- the train state on a mesh ----------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Layout:
  """Where the train state and the batches live on a device mesh
  (`train_state_layout`)."""

  mesh: jax.sharding.Mesh
  rules: dict[str, Any]
  state: Any  # the train state as NamedShardings
  abstract_state: Any  # its jax.ShapeDtypeStructs (restore targets)
  batch: NamedSharding

  @property
  def replicated(self) -> NamedSharding:
    return NamedSharding(self.mesh, P())

  def to_global(self, batch: Mapping[str, Any]) -> dict[str, jax.Array]:
    """This process's rows of a global batch -> global arrays split over the mesh."""
    return {
      k: jax.make_array_from_process_local_data(self.batch, v) for k, v in batch.items()
    }


def train_state_layout(
  abstract_state,
  abstract_params: nnx.State,
  tx: optax.GradientTransformation,
  mesh: Mesh,
  rules,
) -> Layout:
  """The shardings of a train state (a flax struct with step, params, opt_state, as
  `jax.eval_shape` gives it) and of the batches: each parameter split as its logical
  axis names (in `abstract_params`) say under `rules`, its optimizer moments
  likewise, scalars replicated."""
  rules = dict(rules)
  params = param_shardings(abstract_params, mesh, rules)
  replicated = NamedSharding(mesh, P())
  opt_state = optax.tree_map_params(
    tx,
    lambda _, s: s,
    abstract_state.opt_state,
    params,
    transform_non_params=lambda _: replicated,
    is_leaf=lambda x: isinstance(x, NamedSharding),
  )
  state = abstract_state.replace(step=replicated, params=params, opt_state=opt_state)
  abstract = jax.tree.map(
    lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), abstract_state, state
  )
  batch = NamedSharding(mesh, logical_to_spec(('batch', 'length'), rules, mesh=mesh))
  return Layout(mesh=mesh, rules=rules, state=state, abstract_state=abstract, batch=batch)


def under_rules(function, layout: 'Layout'):
  """`function` tracing with the activation constraints of `layout`."""

  @functools.wraps(function)
  def wrapped(*args, **kwargs):
    with logical_rules(layout.mesh, layout.rules):
      return function(*args, **kwargs)

  return wrapped
