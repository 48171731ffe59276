"""One run per workdir: the workdir lock and the run-config guard.

The lock, `<workdir>/workdir.lock`, is a file that is never deleted; a process holds
it with `fcntl.flock` and writes its pid, host, start time, purpose and lease into it.
  * The kernel releases a flock when its holder dies, however it dies (kill -9
    included), so a crash never leaves the workdir locked on this host. Nothing relies
    on the file's existence (an O_EXCL lock file would survive a crash), and the file
    is never unlinked while in use (unlinking a flocked file lets two processes lock
    two different inodes of the same path); only a workdir that a run created and left
    empty after an early error is removed, lock file and all (`remove_if_unused`).
  * A clean release empties the file, so a non-empty file whose flock is free is the
    record of a holder that died: on this host it is taken over with a message.
  * The flock may not reach across hosts (some network file systems), so a record that
    names another host is judged by its lease: the holder rewrites `renewed` every
    `lease_seconds / 4` (120 s / 4) while it runs. A record whose lease expired is
    taken over with a message (a preempted job restarted on a new VM resumes
    unattended); one that is renewed while we wait is refused. A record without a
    lease (written by an older version) is refused until removed by hand.
  * A multi-process run holds one lock: process 0 takes it (`train.py` calls this on
    process 0 only and shares the outcome).

The run-config guard compares a resumed run's config with the saved `config.json`
field by field (`config_changes`); see `HARMLESS_FIELDS` for what may change freely.
`make_workdir`, `lock_workdir`, `check_run_config` and `check_disk_space` are what a
training run does with its workdir before it trains; `RunRecord.write` records the run
with its first checkpoint.
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import json
import os
import re
import shutil
import socket
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import jax
import ml_collections
import numpy as np
from absl import logging

from attnres_jax import checkpointing
from attnres_jax import config as config_lib
from attnres_jax import metrics

LOCK_FILE = 'workdir.lock'
# A holder on another host that has not renewed its lease for this long is gone; a
# replacement job (a preempted VM's successor) then takes the lock over.
LEASE_SECONDS = 120.0
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
  holds it. While held, a daemon thread renews the lease (`renewed` in the record)
  every `lease_seconds / 4`. `messages` collects what was noticed on acquiring (a
  stale lock taken over).
  """

  def __init__(self, workdir: str, purpose: str, *,
               lease_seconds: float = LEASE_SECONDS):
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
      if previous and previous.get('host') != socket.gethostname():
        why = _lease_expired(fd, previous, self.path)
        if why is None:
          fcntl.flock(fd, fcntl.LOCK_UN)
          raise WorkdirLockedError(
              f'Workdir {workdir!r} is in use by {_describe(previous)}, on another '
              + ('host, which renews its lease; refusing to write into it.'
                 if _renews(previous) else
                 f'host, whose liveness cannot be checked from here (its record has no '
                 f'lease). If that run is over, delete {self.path} and start again.'))
        self.messages.append(f'Taking over the lock of {_describe(previous)}: {why}.')
      elif previous:
        pid = previous.get('pid')
        state = ('no longer running' if not isinstance(pid, int) or not _pid_alive(pid)
                 else 'not holding the lock (a new process with the same pid)')
        self.messages.append(
            f'Taking over the stale lock of {_describe(previous)}, {state}; its run '
            f'ended without releasing {self.path} (killed or crashed).')
      self._record = dict(pid=os.getpid(), host=socket.gethostname(), started=_now(),
                          purpose=purpose, renewed=time.time(),
                          lease_seconds=lease_seconds)
      _write_record(fd, self._record)
    except BaseException:
      os.close(fd)
      raise
    self._fd = fd
    self._stop = threading.Event()
    self._renewer = threading.Thread(target=self._renew, args=(lease_seconds / 4,),
                                     daemon=True, name='workdir-lease')
    self._renewer.start()

  def _renew(self, every: float) -> None:
    while not self._stop.wait(every):
      self._record['renewed'] = time.time()
      try:
        _write_record(self._fd, self._record)
      except OSError as e:  # a full disk: the flock still holds on this host
        logging.warning('Could not renew the lease in %s: %s', self.path, e)

  def release(self) -> None:
    if self._fd is None:
      return
    self._stop.set()
    self._renewer.join()
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


def _write_record(fd: int, record: Mapping[str, Any]) -> None:
  data = json.dumps(record).encode()
  os.pwrite(fd, data, 0)
  os.ftruncate(fd, len(data))
  os.fsync(fd)


def _renews(holder: Mapping[str, Any]) -> bool:
  return all(isinstance(holder.get(k), (int, float)) for k in ('renewed', 'lease_seconds'))


def _lease_expired(fd: int, holder: Mapping[str, Any], path: str) -> str | None:
  """Why the lock of `holder` (on another host) is stale, or None if it is live.

  Waits while the lease may still be renewed: the holder is alive if its record
  changes, gone once `lease_seconds` passed since its last renewal. Host clocks must
  agree to well within the lease (NTP does). A record without a lease is live.
  """
  if not _renews(holder):
    return None
  lease, renewed = holder['lease_seconds'], holder['renewed']
  if time.time() - renewed <= lease:
    metrics.say(f'{path}: waiting up to {lease - (time.time() - renewed):.0f} s for the '
                f'lease of {_describe(holder)} to expire (it renews every '
                f'{lease / 4:g} s while it runs).')
  while time.time() - renewed <= lease:
    time.sleep(min(1.0, lease / 20))
    if _read_holder(fd) != holder:
      return None
  return (f'its lease expired {time.time() - renewed - lease:.0f} s ago (last renewed '
          f'{time.time() - renewed:.0f} s ago), so it is gone')


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
  """Creates `workdir` and checks that it is writable; returns its absolute path.

  A URL (`gs://bucket/run`) is refused: the lock, the run record and the metrics need
  a file system; mount the bucket (gcsfuse) and pass the mount point instead.
  """
  scheme = re.match(r'^([A-Za-z][A-Za-z0-9+.-]*)://', workdir)
  if scheme:
    raise ValueError(
        f'Workdir {workdir!r}: {scheme.group(1)}:// paths are not supported (the lock, '
        'config.json and metrics.jsonl need a file system; they would go to a local '
        f'directory named "{scheme.group(1)}:"). Use a local path or a mounted bucket '
        '(e.g. gcsfuse).')
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


class RunRecord:
  """The run record of a checked config: `changes` (the fields that differ from the
  checkpoints'), and `write()`, which writes `config.json` (and appends accepted
  changes to `config_history.jsonl`) once, on process 0. The loop writes it with the
  segment's first checkpoint, so an attempt that fails before saving (a bad mesh, a
  compile error, a diverged run) leaves the record of the checkpoints as it was."""

  def __init__(self, workdir: str, config: ml_collections.ConfigDict,
               changes: Mapping[str, tuple[Any, Any]], saved: Mapping[str, Any] | None,
               latest_step: int | None):
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


def check_run_config(workdir: str, config: ml_collections.ConfigDict,
                     allow_config_change: Sequence[str] = ()) -> RunRecord:
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
  steps = [int(n) for n in os.listdir(ckpt_dir)
           if n.isdigit()] if os.path.isdir(ckpt_dir) else []
  changes, saved = {}, None
  if steps and os.path.exists(config_path):
    with open(config_path, encoding='utf-8') as f:
      saved = json.load(f)
    changes = config_changes(flatten(saved), flat_current, _model_defaults())
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
  return RunRecord(workdir, config, changes, saved, max(steps) if steps else None)


def remove_if_unused(workdir: str, lock: WorkdirLock | None) -> None:
  """Releases `lock` and removes `workdir` (one this run created) if the run left
  nothing in it worth keeping: no checkpoint and no metrics record."""
  ckpt_dir = checkpointing.checkpoint_dir(workdir)
  kept = (os.path.isdir(ckpt_dir) and any(n.isdigit() for n in os.listdir(ckpt_dir))) \
      or metrics.read_jsonl(workdir)
  if lock is not None:
    lock.release()
  if not kept and jax.process_index() == 0:
    shutil.rmtree(workdir, ignore_errors=True)


def write_text(path: str, text: str) -> None:
  """Writes `path` atomically (a temporary file, then a rename)."""
  tmp = f'{path}.tmp.{os.getpid()}'
  with open(tmp, 'w', encoding='utf-8') as f:
    f.write(text)
  os.replace(tmp, path)


def check_disk_space(workdir: str, abstract_state) -> None:
  """Warns if the workdir's file system has no room for one checkpoint."""
  needed = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(
      (abstract_state.params, abstract_state.opt_state)))
  free = shutil.disk_usage(workdir).free
  if free < needed * 1.1:  # 10%: the iterator state, metadata, file system blocks
    metrics.say(f'WARNING: {workdir} has {free / 2**20:,.1f} MiB free, and one checkpoint '
         f'needs about {needed / 2**20:,.1f} MiB (parameters and optimizer state): '
         'the first save will fail and stop the run.')
