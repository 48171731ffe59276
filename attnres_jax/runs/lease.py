"""The lock of a gs:// workdir (`GcsLease`), and `lock_workdir`, which takes a run's
lock: a flock'd file for a local workdir (`lock.WorkdirLock`), a lease object on GCS."""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from typing import Any

import jax
import numpy as np
from absl import logging
from jax.experimental import multihost_utils

from attnres_jax.runs import lock as lock_lib
from attnres_jax.runs import metrics
from attnres_jax.runs import storage


class GcsLease:
  """The lock of a gs:// workdir: the object `<workdir>/workdir.lock`, holding the
  record a `WorkdirLock` holds (pid, host, start, purpose, lease), renewed by a thread
  every `lease_seconds / 4`.

  GCS has no flock, so the lease alone guards the run, with GCS's generation
  preconditions (`if_generation_match`): every write of the record names the
  generation read before it, so of two processes that read the same record only one
  replaces it (the other is refused), and a holder whose record another process
  replaced stops renewing it and says so. A record of a live process on this host is
  refused at once; of a process on this host that is gone, taken over at once; of
  another host, judged by its lease as `WorkdirLock` does (refused if it is renewed
  while we wait, taken over once it expired). Release deletes the object.
  """

  def __init__(
    self, workdir: str, purpose: str, *, lease_seconds: float = lock_lib.LEASE_SECONDS
  ):
    self.path = storage.join(workdir, lock_lib.LOCK_FILE)
    self.messages: list[str] = []
    self.lost = False
    bucket, _, name = self.path[len('gs://') :].partition('/')
    self._blob = _gcs_client().bucket(bucket).blob(name)
    previous, generation = self._read()
    holder = lock_lib.describe(previous)
    if previous and previous.get('host') == socket.gethostname():
      pid = previous.get('pid')
      if isinstance(pid, int) and lock_lib.pid_alive(pid):
        raise lock_lib.WorkdirLockedError(
          f'Workdir {workdir!r} is in use by {holder}; refusing to write into it. '
          f'Wait for that process to finish or stop it (lease {self.path}).'
        )
      self.messages.append(
        f'Taking over the stale lease of {holder}, no longer running; its run ended '
        f'without releasing {self.path} (killed or crashed).'
      )
    elif previous:
      why = lock_lib.lease_expired(
        lambda: self._read()[1], generation, previous, self.path
      )
      if why is None:
        raise lock_lib.WorkdirLockedError(
          f'Workdir {workdir!r} is in use by {holder}, on another host, '
          + (
            'which renews its lease; refusing to write into it.'
            if lock_lib.renews(previous)
            else f'whose liveness cannot be checked (its record has no lease). If '
            f'that run is over, delete {self.path} and start again.'
          )
        )
      self.messages.append(f'Taking over the lease of {holder}: {why}.')
    self._record = dict(
      pid=os.getpid(),
      host=socket.gethostname(),
      started=lock_lib.now(),
      purpose=purpose,
      renewed=time.time(),
      lease_seconds=lease_seconds,
    )
    try:
      self._generation = self._write(generation)
    except _precondition_failed() as e:
      raise lock_lib.WorkdirLockedError(
        f'Workdir {workdir!r}: another process took the lease {self.path} at the same '
        'moment; refusing to write into it.'
      ) from e
    self._stop = threading.Event()
    self._renewer = threading.Thread(
      target=self._renew, args=(lease_seconds / 4,), daemon=True, name='workdir-lease'
    )
    self._renewer.start()

  def _read(self) -> tuple[dict[str, Any], int]:
    """(record, generation) of the lease object; ({}, 0) if there is none."""
    while True:
      blob = self._blob.bucket.get_blob(self._blob.name)
      if blob is None:
        return {}, 0
      generation = int(blob.generation)
      try:  # the content of the generation seen
        data = blob.download_as_bytes(if_generation_match=generation)
        break
      except _precondition_failed():  # rewritten in between: read again
        continue
    try:
      record = json.loads(data) if data.strip() else {}
    except ValueError:
      record = {'unreadable': data[:80].decode(errors='replace')}
    return record, generation

  def _write(self, generation: int) -> int:
    """Writes the record if the object is still at `generation` (0: absent); returns
    the new generation. Raises PreconditionFailed if it is not."""
    self._blob.upload_from_string(
      json.dumps(self._record),
      content_type='application/json',
      if_generation_match=generation,
    )
    return int(self._blob.generation)

  def _renew(self, every: float) -> None:
    while not self._stop.wait(every):
      self._record['renewed'] = time.time()
      try:
        self._generation = self._write(self._generation)
      except _precondition_failed():
        self.lost = True
        logging.error(
          'The lease %s was taken over by another process; this one no longer '
          'holds the workdir.',
          self.path,
        )
        return
      except Exception as e:  # pylint: disable=broad-except
        logging.warning('Could not renew the lease %s: %s', self.path, e)

  def release(self) -> None:
    if self._stop.is_set():
      return
    self._stop.set()
    self._renewer.join()
    if self.lost:
      return
    try:
      self._blob.delete(if_generation_match=self._generation)
    except Exception as e:  # pylint: disable=broad-except
      logging.warning('Could not delete the lease %s: %s', self.path, e)

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.release()


def _gcs_client():
  # google-cloud-storage is imported for gs:// workdirs only (a slow import). With no
  # project given, object requests need none; STORAGE_EMULATOR_HOST points it at a
  # local emulator.
  from google.cloud import storage as gcs  # pylint: disable=g-import-not-at-top

  return gcs.Client(project=None)


def _precondition_failed():
  # Imported with the client (above), for gs:// workdirs only.
  from google.api_core import exceptions  # pylint: disable=g-import-not-at-top

  return exceptions.PreconditionFailed


def acquire(workdir: str, purpose: str, **kwargs) -> lock_lib.WorkdirLock | GcsLease:
  """The lock of `workdir`: a flock'd file, or a lease object on gs://."""
  cls = GcsLease if storage.is_remote(workdir) else lock_lib.WorkdirLock
  return cls(workdir, purpose, **kwargs)


def lock_workdir(workdir: str, purpose: str) -> lock_lib.WorkdirLock | GcsLease | None:
  """Process 0 locks `workdir` for the run (one lock per run, not per process); every
  process raises WorkdirLockedError if it could not. None on processes other than 0."""
  lock, error = None, None
  if jax.process_index() == 0:
    try:
      lock = acquire(workdir, purpose)
    except lock_lib.WorkdirLockedError as e:
      error = e
  if jax.process_count() > 1:
    locked = multihost_utils.broadcast_one_to_all(np.int32(error is None))
    if not locked and error is None:
      error = lock_lib.WorkdirLockedError(
        f'Process 0 could not lock the workdir {workdir!r} (see its output).'
      )
  if error is not None:
    raise error
  for message in lock.messages if lock is not None else ():
    metrics.say(f'WARNING: {message}')
  return lock


def release_if_mine(workdir: str) -> None:
  """Clears the lock record of `workdir` if it names this process: a lock taken but
  not yet handed to its caller when a stop signal ends the process (the flock itself
  dies with the process; the record would be taken for a live holder's)."""
  path = storage.join(workdir, lock_lib.LOCK_FILE)
  if storage.is_remote(workdir):
    if storage.exists(path):
      held = json.loads(storage.read_text(path) or '{}')
      if _names_this_process(held):
        storage.remove(path)
    return
  if not os.path.exists(path):
    return
  fd = os.open(path, os.O_RDWR)
  try:
    if _names_this_process(lock_lib.read_holder(fd)):
      os.ftruncate(fd, 0)
  finally:
    os.close(fd)


def _names_this_process(holder) -> bool:
  return holder.get('pid') == os.getpid() and holder.get('host') == socket.gethostname()
