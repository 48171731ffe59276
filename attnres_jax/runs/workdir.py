"""One run per workdir: the workdir lock and the run-config guard.

The lock (`lock.WorkdirLock`, re-exported here; on gs:// the lease object
`lease.GcsLease`) keeps one run per workdir. A workdir is a local path or gs://
(`storage`); its files are read and written through `storage`.

The run-config guard compares a resumed run's config with the saved `config.json`
field by field (`config_changes`); see `HARMLESS_FIELDS` for what may change freely.
`make_workdir`, `lock_workdir`, `check_run_config` and `check_disk_space` are what a
training run does with its workdir before it trains; `RunRecord.write` records the run
with its first checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import jax
import ml_collections

from attnres_jax.runs import checkpointing
from attnres_jax import config as config_lib
from attnres_jax.runs import metrics
from attnres_jax.runs import lease as lease_lib
from attnres_jax.runs import lock as lock_lib
from attnres_jax.runs import records
from attnres_jax.runs import storage

# The lock's names, re-exported: callers say workdir.WorkdirLock, workdir.LOCK_FILE.
LOCK_FILE, LEASE_SECONDS = lock_lib.LOCK_FILE, lock_lib.LEASE_SECONDS
WorkdirLock, WorkdirLockedError = lock_lib.WorkdirLock, lock_lib.WorkdirLockedError
lock_workdir = lease_lib.lock_workdir

CONFIG_HISTORY = 'config_history.jsonl'

# Fields that may differ between the segments of one run without the user's say-so:
# they change when and how the run reports or stores itself, not what it computes.
# (Everything else, the data pipeline, the batch, the schedule and optimizer, the seed,
# the eval split and budget, changes the numbers the run produces, so it is refused
# unless named in `allow_config_change`.)
HARMLESS_FIELDS = frozenset(
  {
    'train.log_every',  # reporting cadence
    'train.eval_every',  # extra evaluations; the same eval batches each time
    'train.checkpoint_every',  # when to save; resume is exact from any step
    'train.keep_checkpoints',
    'train.async_checkpointing',
    'data.tfds_data_dir',  # where the prepared dataset lives, not which one
    'model.remat',  # memory for compute; the same math
    'mesh',  # checkpoints restore resharded onto any mesh
  }
)


def make_writable_dir(path: str) -> str:
  """Creates `path` (local; a gs:// prefix needs no creating) and writes and deletes a
  probe file there, so an unwritable directory, a missing bucket or a missing
  permission fails before any work; returns its absolute path. Raises OSError."""
  path = storage.absolute(path)
  storage.makedirs(path)
  probe = os.path.join(path, f'.write_test.{socket.gethostname()}.{os.getpid()}')
  storage.write_text(probe, 'ok')
  storage.remove(probe)
  return path


def is_harmless(field: str) -> bool:
  """Whether `field` ('train.log_every', 'mesh.rules.batch') is in HARMLESS_FIELDS,
  itself or through its section."""
  parts = field.split('.')
  return any('.'.join(parts[:i]) in HARMLESS_FIELDS for i in range(1, len(parts) + 1))


class RunConfigError(ValueError):
  """A resumed run's config differs from its checkpoints' in a run-defining field."""


# -- the run-config guard -------------------------------------------------------------


def flatten(tree: Mapping[str, Any], prefix: str = '') -> dict[str, Any]:
  """{'train.seq_len': 32, ...} of a nested dict (lists and tuples are leaves)."""
  flat = {}
  for key, value in tree.items():
    if isinstance(value, Mapping):
      flat.update(flatten(value, f'{prefix}{key}.'))
    else:
      flat[f'{prefix}{key}'] = value
  return flat


def config_changes(
  saved: Mapping[str, Any], current: Mapping[str, Any], defaults: Mapping[str, Any]
) -> dict[str, tuple[Any, Any]]:
  """{field: (saved, current)} of the flattened configs' differences.

  A field missing from `saved` (added to the code since) counts as its default.
  """
  missing = object()
  changes = {}
  for field in sorted(set(saved) | set(current)):
    old = saved.get(field, defaults.get(field, missing))
    new = current.get(field, missing)
    if _normal(old) != _normal(new):
      changes[field] = (None if old is missing else old, None if new is missing else new)
  return changes


def _normal(value):
  """JSON has no tuples: (1, 2) and [1, 2] are one value."""
  if isinstance(value, (list, tuple)):
    return [_normal(v) for v in value]
  return value


def resolve_allowed(allowed: Iterable[str], fields: Iterable[str]) -> set[str]:
  """The full field names of `allowed` ('seq_len' or 'train.seq_len').

  Raises ValueError for a name that is no config field or is ambiguous.
  """
  fields = set(fields)
  resolved = set()
  for name in allowed:
    name = name.strip()
    if not name:
      continue
    matches = (
      [name]
      if name in fields
      else sorted(f for f in fields if f.rsplit('.', 1)[-1] == name)
    )
    if len(matches) != 1:
      problem = 'matches no config field' if not matches else f'is ambiguous: {matches}'
      raise ValueError(f'allow_config_change: {name!r} {problem}.')
    resolved.add(matches[0])
  return resolved


def record_config_change(
  workdir: str,
  step: int,
  changes: Mapping[str, tuple[Any, Any]],
  previous_config: Mapping[str, Any],
) -> None:
  """Appends one line to `<workdir>/config_history.jsonl`: when, the latest checkpoint
  step then, what changed, and the whole config the run had until then."""
  record = dict(
    time=lock_lib.now(),
    latest_checkpoint=step,
    changes={f: {'old': old, 'new': new} for f, (old, new) in changes.items()},
    previous_config=previous_config,
  )
  records.append_jsonl(os.path.join(workdir, CONFIG_HISTORY), record, say=metrics.say)


# -- a run's workdir, before it trains -------------------------------------------------


def make_workdir(workdir: str) -> str:
  """Creates `workdir` and checks that it is writable; returns its absolute path.

  `gs://bucket/run` is a workdir too (`storage`); another scheme is refused.
  """
  storage.check_supported(workdir)
  try:
    return make_writable_dir(workdir)
  except OSError as e:
    raise OSError(f'Workdir {workdir!r} is not writable: {e}') from e


def changes_training_data(field: str) -> bool:
  """Whether a change of `field` makes a saved training data iterator state
  meaningless (another pipeline, batch or order)."""
  return field in ('train.seq_len', 'train.batch_size', 'train.seed') or (
    field.startswith('data.') and field not in ('data.tfds_data_dir', 'data.eval_split')
  )


def _model_defaults() -> dict[str, Any]:
  """Model fields added to the code after a run saved its config take these values
  (the other sections of a saved config are complete: they come from the config file)."""
  return flatten({'model': config_lib.ModelConfig().to_dict()})


class RunRecord:
  """The run record of a checked config: `changes` (the fields that differ from the
  checkpoints'), and `write()`, which writes `config.json` (and appends accepted
  changes to `config_history.jsonl`) once, on process 0. The loop writes it with the
  segment's first checkpoint, so an attempt that fails before saving (a bad mesh, a
  compile error, a diverged run) leaves the record of the checkpoints as it was."""

  def __init__(
    self,
    workdir: str,
    config: ml_collections.ConfigDict,
    changes: Mapping[str, tuple[Any, Any]],
    saved: Mapping[str, Any] | None,
    latest_step: int | None,
  ):
    self.workdir, self.config, self.changes = workdir, config, dict(changes)
    self._saved, self._latest_step = saved, latest_step
    self._written = False

  def write(self) -> None:
    if self._written:
      return
    if jax.process_index() == 0:
      if self.changes:
        record_config_change(self.workdir, self._latest_step, self.changes, self._saved)
      checkpointing.save_config(self.workdir, self.config)
    self._written = True


def check_run_config(
  workdir: str, config: ml_collections.ConfigDict, allow_config_change: Sequence[str] = ()
) -> RunRecord:
  """Checks `config` against the run in `workdir`; returns its (unwritten) RunRecord.

  If `workdir` holds checkpoints, every field that differs from the saved
  `config.json` must be harmless (`workdir.HARMLESS_FIELDS`) or named in
  `allow_config_change` ('seq_len' or 'train.seq_len'); model fields never may (the
  checkpoints could not hold that model). Call it holding the workdir lock.
  """
  current = json.loads(config.to_json())
  flat_current = flatten(current)
  allowed = resolve_allowed(allow_config_change, flat_current)
  config_path = os.path.join(workdir, checkpointing.CONFIG_JSON)
  ckpt_dir = checkpointing.checkpoint_dir(workdir)
  steps = [int(n) for n in storage.listdir(ckpt_dir) if n.isdigit()]
  changes, saved = {}, None
  if steps and storage.exists(config_path):
    saved = records.read_json(config_path)
    changes = config_changes(flatten(saved), flat_current, _model_defaults())
    model = sorted(f for f in changes if f.startswith('model.') and not is_harmless(f))
    if model:
      raise RunConfigError(
        f'Workdir {workdir!r} holds checkpoints of a different model (fields '
        f'{[f.split(".", 1)[1] for f in model]} differ); use another workdir.'
      )
    refused = {
      f: v for f, v in changes.items() if not is_harmless(f) and f not in allowed
    }
    if refused:
      lines = ''.join(f'\n  {f}: {old!r} -> {new!r}' for f, (old, new) in refused.items())
      raise RunConfigError(
        f'Workdir {workdir!r} holds checkpoints of a run with another config; '
        f'resuming it with these changes would make a different run:{lines}\n'
        f'Use another workdir, or accept the changes explicitly with '
        f'--allow_config_change={",".join(refused)} '
        f'(recorded in {CONFIG_HISTORY}).'
      )
  return RunRecord(workdir, config, changes, saved, max(steps) if steps else None)


def remove_if_unused(workdir: str, lock: lock_lib.WorkdirLock | None) -> None:
  """Releases `lock` and removes `workdir` (one this run created) if the run left
  nothing in it worth keeping: no checkpoint and no metrics record."""
  ckpt_dir = checkpointing.checkpoint_dir(workdir)
  kept = any(n.isdigit() for n in storage.listdir(ckpt_dir)) or metrics.read_jsonl(
    workdir
  )
  if lock is not None:
    lock.release()
  if not kept and jax.process_index() == 0:
    storage.rmtree(workdir)


def check_disk_space(workdir: str, abstract_state) -> None:
  """Warns if the workdir's file system has no room for one checkpoint (a local
  one: a bucket has no free-space figure)."""
  if storage.is_remote(workdir):
    return
  needed = sum(
    x.size * x.dtype.itemsize
    for x in jax.tree.leaves((abstract_state.params, abstract_state.opt_state))
  )
  free = shutil.disk_usage(workdir).free
  if free < needed * 1.1:  # 10%: the iterator state, metadata, file system blocks
    metrics.say(
      f'WARNING: {workdir} has {free / 2**20:,.1f} MiB free, and one checkpoint '
      f'needs about {needed / 2**20:,.1f} MiB (parameters and optimizer state): '
      'the first save will fail and stop the run.'
    )


class RunLock:
  """The lock a training run holds on `workdir` (`lock`: None until taken), and what
  a stop signal before its first step does with it (`give_up`, called from
  `preemption.StopSignal`'s watcher thread)."""

  def __init__(self, workdir: str, fresh: bool):
    self.workdir, self.fresh = workdir, fresh
    self.lock = None

  def give_up(self) -> None:
    """Releases the lock; a workdir this run created and left unused is removed. A
    lock taken but not yet handed back (a signal in between) is released by its
    record, which names this process."""
    if self.fresh:
      remove_if_unused(self.workdir, self.lock)
    elif self.lock is not None:
      self.lock.release()
    else:
      lease_lib.release_if_mine(self.workdir)
    self.lock = None
