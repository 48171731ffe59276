"""One run per workdir: the workdir lock and the run-config guard.

The lock, `<workdir>/workdir.lock`, is a file that is never deleted; a process holds
it with `fcntl.flock` and writes its pid, host, start time and purpose into it.
  * The kernel releases a flock when its holder dies, however it dies (kill -9
    included), so a crash never leaves the workdir locked on this host. Nothing relies
    on the file's existence (an O_EXCL lock file would survive a crash), and the file
    is never unlinked (unlinking a flocked file lets two processes lock two different
    inodes of the same path).
  * A clean release empties the file, so a non-empty file whose flock is free is the
    record of a holder that died: on this host it is taken over with a message. If it
    names another host, the flock may not reach across hosts (some network file
    systems), so the lock is refused until that record is removed by hand.
  * A multi-process run holds one lock: process 0 takes it (`train.py` calls this on
    process 0 only and shares the outcome).

The run-config guard compares a resumed run's config with the saved `config.json`
field by field (`config_changes`); see `HARMLESS_FIELDS` for what may change freely.
`make_workdir`, `lock_workdir`, `prepare_workdir` and `check_disk_space` are what a
training run does with its workdir before it trains.
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import json
import os
import shutil
import socket
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import jax
import ml_collections
import numpy as np

from attnres_jax import checkpointing
from attnres_jax import config as config_lib
from attnres_jax import metrics

LOCK_FILE = 'workdir.lock'
CONFIG_HISTORY = 'config_history.jsonl'

# Fields that may differ between the segments of one run without the user's say-so:
# they change when and how the run reports or stores itself, not what it computes.
# (Everything else, the data pipeline, the batch, the schedule and optimizer, the seed,
# the eval split and budget, changes the numbers the run produces, so it is refused
# unless named in `allow_config_change`.)
HARMLESS_FIELDS = frozenset({
    'train.log_every',            # reporting cadence
    'train.eval_every',           # extra evaluations; the same eval batches each time
    'train.checkpoint_every',     # when to save; resume is exact from any step
    'train.keep_checkpoints',
    'train.async_checkpointing',
    'data.tfds_data_dir',         # where the prepared dataset lives, not which one
    'model.remat',                # memory for compute; the same math
    'mesh',                       # checkpoints restore resharded onto any mesh
})


def make_writable_dir(path: str) -> str:
  """Creates `path` and writes a probe file there (so an unwritable directory fails
  before any work); returns its absolute path. Raises OSError."""
  path = os.path.abspath(os.path.expanduser(path))
  os.makedirs(path, exist_ok=True)
  probe = os.path.join(path, f'.write_test.{socket.gethostname()}.{os.getpid()}')
  with open(probe, 'w', encoding='utf-8') as f:
    f.write('ok')
  os.remove(probe)
  return path


def is_harmless(field: str) -> bool:
  """Whether `field` ('train.log_every', 'mesh.rules.batch') is in HARMLESS_FIELDS,
  itself or through its section."""
  parts = field.split('.')
  return any('.'.join(parts[:i]) in HARMLESS_FIELDS for i in range(1, len(parts) + 1))


class WorkdirLockedError(RuntimeError):
  """Another process holds the workdir."""


class RunConfigError(ValueError):
  """A resumed run's config differs from its checkpoints' in a run-defining field."""


def _now() -> str:
  return datetime.datetime.now().astimezone().isoformat(timespec='seconds')


def _pid_alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:  # exists, owned by another user
    return True
  return True


class WorkdirLock:
  """Exclusive lock on a workdir; `release()` (or the holder's death) frees it.

  Raises WorkdirLockedError naming the holder's pid and host if another live process
  holds it. `messages` collects what was noticed on acquiring (a stale lock taken
  over).
  """

  def __init__(self, workdir: str, purpose: str):
    self.path = os.path.join(workdir, LOCK_FILE)
    self.messages: list[str] = []
    fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
      try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
      except OSError as e:
        if e.errno not in (errno.EAGAIN, errno.EACCES):
          raise
        holder = _read_holder(fd)
        raise WorkdirLockedError(
            f'Workdir {workdir!r} is in use by {_describe(holder)}; refusing to '
            f'write into it. Wait for that process to finish or stop it (lock file '
            f'{self.path}).') from None
      previous = _read_holder(fd)
      if previous:
        host, pid = previous.get('host'), previous.get('pid')
        if host != socket.gethostname():
          fcntl.flock(fd, fcntl.LOCK_UN)
          raise WorkdirLockedError(
              f'Workdir {workdir!r} was locked by {_describe(previous)}, on another '
              f'host, whose liveness cannot be checked from here. If that run is over, '
              f'delete {self.path} and start again.')
        state = ('no longer running' if not isinstance(pid, int) or not _pid_alive(pid)
                 else 'not holding the lock (a new process with the same pid)')
        self.messages.append(
            f'Taking over the stale lock of {_describe(previous)}, {state}; its run '
            f'ended without releasing {self.path} (killed or crashed).')
      record = dict(pid=os.getpid(), host=socket.gethostname(), started=_now(),
                    purpose=purpose)
      os.ftruncate(fd, 0)
      os.pwrite(fd, json.dumps(record).encode(), 0)
      os.fsync(fd)
    except BaseException:
      os.close(fd)
      raise
    self._fd = fd

  def release(self) -> None:
    if self._fd is None:
      return
    try:
      os.ftruncate(self._fd, 0)  # a clean release leaves no holder record
      fcntl.flock(self._fd, fcntl.LOCK_UN)
    finally:
      os.close(self._fd)
      self._fd = None

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.release()


def _read_holder(fd: int) -> dict[str, Any]:
  data = os.pread(fd, 4096, 0)
  if not data.strip():
    return {}
  try:
    return json.loads(data)
  except ValueError:
    return {'unreadable': data[:80].decode(errors='replace')}


def _describe(holder: Mapping[str, Any]) -> str:
  if not holder:
    return 'another process (no holder recorded yet)'
  if 'unreadable' in holder:
    return f'an unknown holder ({holder["unreadable"]!r})'
  return (f'pid {holder.get("pid")} on host {holder.get("host")} '
          f'({holder.get("purpose", "?")}, started {holder.get("started", "?")})')


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


def config_changes(saved: Mapping[str, Any], current: Mapping[str, Any],
                   defaults: Mapping[str, Any]) -> dict[str, tuple[Any, Any]]:
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
    matches = [name] if name in fields else sorted(
        f for f in fields if f.rsplit('.', 1)[-1] == name)
    if len(matches) != 1:
      problem = 'matches no config field' if not matches else f'is ambiguous: {matches}'
      raise ValueError(f'allow_config_change: {name!r} {problem}.')
    resolved.add(matches[0])
  return resolved


def record_config_change(workdir: str, step: int, changes: Mapping[str, tuple[Any, Any]],
                         previous_config: Mapping[str, Any]) -> None:
  """Appends one line to `<workdir>/config_history.jsonl`: when, the latest checkpoint
  step then, what changed, and the whole config the run had until then."""
  record = dict(time=_now(), latest_checkpoint=step,
                changes={f: {'old': old, 'new': new} for f, (old, new) in changes.items()},
                previous_config=previous_config)
  with open(os.path.join(workdir, CONFIG_HISTORY), 'a', encoding='utf-8') as f:
    f.write(json.dumps(record, sort_keys=True) + '\n')
    f.flush()
    os.fsync(f.fileno())


# -- a run's workdir, before it trains -------------------------------------------------


def make_workdir(workdir: str) -> str:
  """Creates `workdir` and checks that it is writable; returns its absolute path."""
  try:
    return make_writable_dir(workdir)
  except OSError as e:
    raise OSError(f'Workdir {workdir!r} is not writable: {e}') from e


def lock_workdir(workdir: str, purpose: str) -> WorkdirLock | None:
  """Process 0 locks `workdir` for the run (one lock per run, not per process); every
  process raises WorkdirLockedError if it could not. None on processes other than 0."""
  lock, error = None, None
  if jax.process_index() == 0:
    try:
      lock = WorkdirLock(workdir, purpose)
    except WorkdirLockedError as e:
      error = e
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
    locked = multihost_utils.broadcast_one_to_all(np.int32(error is None))
    if not locked and error is None:
      error = WorkdirLockedError(
          f'Process 0 could not lock the workdir {workdir!r} (see its output).')
  if error is not None:
    raise error
  for message in lock.messages if lock is not None else ():
    metrics.say(f'WARNING: {message}')
  return lock


def changes_training_data(field: str) -> bool:
  """Whether a change of `field` makes a saved training data iterator state
  meaningless (another pipeline, batch or order)."""
  return field in ('train.seq_len', 'train.batch_size', 'train.seed') or (
      field.startswith('data.') and field not in ('data.tfds_data_dir', 'data.eval_split'))


def _model_defaults() -> dict[str, Any]:
  """Model fields added to the code after a run saved its config take these values
  (the other sections of a saved config are complete: they come from the config file)."""
  return flatten({'model': config_lib.ModelConfig().to_dict()})


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
  flat_current = flatten(current)
  allowed = resolve_allowed(allow_config_change, flat_current)
  config_path = os.path.join(workdir, checkpointing.CONFIG_JSON)
  ckpt_dir = checkpointing.checkpoint_dir(workdir)
  has_checkpoints = os.path.isdir(ckpt_dir) and any(
      name.isdigit() for name in os.listdir(ckpt_dir))
  changes = {}
  if has_checkpoints and os.path.exists(config_path):
    with open(config_path, encoding='utf-8') as f:
      saved = json.load(f)
    changes = config_changes(flatten(saved), flat_current,
                                         _model_defaults())
    model = sorted(f for f in changes
                   if f.startswith('model.') and not is_harmless(f))
    if model:
      raise RunConfigError(
          f'Workdir {workdir!r} holds checkpoints of a different model (fields '
          f'{[f.split(".", 1)[1] for f in model]} differ); use another workdir.')
    refused = {f: v for f, v in changes.items()
               if not is_harmless(f) and f not in allowed}
    if refused:
      lines = ''.join(f'\n  {f}: {old!r} -> {new!r}' for f, (old, new) in refused.items())
      raise RunConfigError(
          f'Workdir {workdir!r} holds checkpoints of a run with another config; '
          f'resuming it with these changes would make a different run:{lines}\n'
          f'Use another workdir, or accept the changes explicitly with '
          f'--allow_config_change={",".join(refused)} '
          f'(recorded in {CONFIG_HISTORY}).')
    if changes and jax.process_index() == 0:
      steps = [int(n) for n in os.listdir(ckpt_dir) if n.isdigit()]
      record_config_change(workdir, max(steps), changes, saved)
  if jax.process_count() > 1:  # every process has read the old config.json
    from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
    multihost_utils.sync_global_devices('config.json compared')
  if jax.process_index() == 0:
    checkpointing.save_config(workdir, config)
  return set(changes)


def check_disk_space(workdir: str, abstract_state) -> None:
  """Warns if the workdir's file system has no room for one checkpoint."""
  needed = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(
      (abstract_state.params, abstract_state.opt_state)))
  free = shutil.disk_usage(workdir).free
  if free < needed * 1.1:  # 10%: the iterator state, metadata, file system blocks
    metrics.say(f'WARNING: {workdir} has {free / 2**20:,.1f} MiB free, and one checkpoint '
         f'needs about {needed / 2**20:,.1f} MiB (parameters and optimizer state): '
         'the first save will fail and stop the run.')
