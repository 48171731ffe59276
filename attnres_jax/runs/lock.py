"""The workdir lock: one run per workdir, across processes and hosts.

The lock, `<workdir>/workdir.lock`, is a file that is never deleted; a process holds
it with `fcntl.flock` and writes its pid, host, start time, purpose and lease into it.
  * The kernel releases a flock when its holder dies, however it dies (kill -9
    included), so a crash never leaves the workdir locked on this host. Nothing relies
    on the file's existence (an O_EXCL lock file would survive a crash), and the file
    is never unlinked while in use (unlinking a flocked file lets two processes lock
    two different inodes of the same path); only a workdir that a run created and left
    empty after an early error is removed, lock file and all
    (`workdir.remove_if_unused`).
  * A clean release empties the file, so a non-empty file whose flock is free is the
    record of a holder that died: on this host it is taken over with a message.
  * The flock may not reach across hosts (some network file systems), so a record that
    names another host is judged by its lease: the holder rewrites `renewed` every
    `lease_seconds / 4` (120 s / 4) while it runs. A record whose lease expired is
    taken over with a message (a preempted job restarted on a new VM resumes
    unattended); one that is renewed while we wait is refused. A record without a
    lease (written by an older version) is refused until removed by hand.
  * A multi-process run holds one lock: process 0 takes it (`lease.lock_workdir`
    takes it on process 0 only and shares the outcome).
A gs:// workdir has no flock: there the lock is `lease.GcsLease`, the same record in
an object whose every write is conditional on the generation read before it.
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import json
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from absl import logging

from attnres_jax.runs import metrics

LOCK_FILE = 'workdir.lock'
# A holder on another host that has not renewed its lease for this long is gone; a
# replacement job (a preempted VM's successor) then takes the lock over.
LEASE_SECONDS = 120.0


class WorkdirLockedError(RuntimeError):
  """Another process holds the workdir."""


def now() -> str:
  """The local time, ISO 8601 with its offset (for records people read)."""
  return datetime.datetime.now().astimezone().isoformat(timespec='seconds')


def pid_alive(pid: int) -> bool:
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

  def __init__(self, workdir: str, purpose: str, *, lease_seconds: float = LEASE_SECONDS):
    self.path = os.path.join(workdir, LOCK_FILE)
    self.messages: list[str] = []
    fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
      try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
      except OSError as e:
        if e.errno not in (errno.EAGAIN, errno.EACCES):
          raise
        holder = read_holder(fd)
        raise WorkdirLockedError(
          f'Workdir {workdir!r} is in use by {describe(holder)}; refusing to '
          f'write into it. Wait for that process to finish or stop it (lock file '
          f'{self.path}).'
        ) from None
      previous = read_holder(fd)
      if previous and previous.get('host') != socket.gethostname():
        why = lease_expired(lambda: read_holder(fd), previous, previous, self.path)
        if why is None:
          fcntl.flock(fd, fcntl.LOCK_UN)
          raise WorkdirLockedError(
            f'Workdir {workdir!r} is in use by {describe(previous)}, on another '
            + (
              'host, which renews its lease; refusing to write into it.'
              if renews(previous)
              else f'host, whose liveness cannot be checked from here (its record has no '
              f'lease). If that run is over, delete {self.path} and start again.'
            )
          )
        self.messages.append(f'Taking over the lock of {describe(previous)}: {why}.')
      elif previous:
        pid = previous.get('pid')
        state = (
          'no longer running'
          if not isinstance(pid, int) or not pid_alive(pid)
          else 'not holding the lock (a new process with the same pid)'
        )
        self.messages.append(
          f'Taking over the stale lock of {describe(previous)}, {state}; its run '
          f'ended without releasing {self.path} (killed or crashed).'
        )
      self._record = dict(
        pid=os.getpid(),
        host=socket.gethostname(),
        started=now(),
        purpose=purpose,
        renewed=time.time(),
        lease_seconds=lease_seconds,
      )
      _write_record(fd, self._record)
    except BaseException:
      os.close(fd)
      raise
    self._fd = fd
    self._stop = threading.Event()
    self._renewer = threading.Thread(
      target=self._renew, args=(lease_seconds / 4,), daemon=True, name='workdir-lease'
    )
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


# Every record is padded with spaces (JSON's whitespace) to at least this length, so a
# renewal rewrites the whole file in one write at a fixed size: written and then
# truncated, a record shorter than the one before (`renewed` with one digit fewer) left
# a moment in which a reader saw the new record followed by the old one's last bytes
# (not JSON: a holder read as unreadable).
RECORD_BYTES = 512


def _write_record(fd: int, record: Mapping[str, Any]) -> None:
  data = json.dumps(record).encode()
  data = data.ljust(RECORD_BYTES)
  os.pwrite(fd, data, 0)
  if os.fstat(fd).st_size > len(data):  # a longer record before (not a renewal's)
    os.ftruncate(fd, len(data))
  os.fsync(fd)


def renews(holder: Mapping[str, Any]) -> bool:
  return all(
    isinstance(holder.get(k), (int, float)) for k in ('renewed', 'lease_seconds')
  )


def lease_expired(
  version: Callable[[], Any], seen: Any, holder: Mapping[str, Any], path: str
) -> str | None:
  """Why the lock of `holder` (on another host) is stale, or None if it is live.

  Waits while the lease may still be renewed: the holder is alive if its record
  changes (`version()`, the record or its generation, differs from `seen`), gone once
  `lease_seconds` passed since its last renewal. Host clocks must
  agree to well within the lease (NTP does). A record without a lease is live.
  """
  if not renews(holder):
    return None
  lease, renewed = holder['lease_seconds'], holder['renewed']
  if time.time() - renewed <= lease:
    metrics.say(
      f'{path}: waiting up to {lease - (time.time() - renewed):.0f} s for the '
      f'lease of {describe(holder)} to expire (it renews every '
      f'{lease / 4:g} s while it runs).'
    )
  while time.time() - renewed <= lease:
    time.sleep(min(1.0, lease / 20))
    if version() != seen:
      return None
  return (
    f'its lease expired {time.time() - renewed - lease:.0f} s ago (last renewed '
    f'{time.time() - renewed:.0f} s ago), so it is gone'
  )


def read_holder(fd: int) -> dict[str, Any]:
  data = os.pread(fd, 4096, 0)
  if not data.strip():
    return {}
  try:
    return json.loads(data)
  except ValueError:
    return {'unreadable': data[:80].decode(errors='replace')}


def describe(holder: Mapping[str, Any]) -> str:
  if not holder:
    return 'another process (no holder recorded yet)'
  if 'unreadable' in holder:
    return f'an unknown holder ({holder["unreadable"]!r})'
  return (
    f'pid {holder.get("pid")} on host {holder.get("host")} '
    f'({holder.get("purpose", "?")}, started {holder.get("started", "?")})'
  )
