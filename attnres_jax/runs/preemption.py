"""Stopping a run cleanly on SIGTERM or SIGINT (preemption, a scheduler, Ctrl-C).

Cloud TPU preemption, Kubernetes and SLURM send SIGTERM some seconds before SIGKILL.
`StopSignal` turns the first SIGTERM or SIGINT into a flag the training loop reads at
the end of every step; the loop then saves that step's checkpoint, waits for the save
and raises `Preempted`, whose `exit_code` (128 + the signal number: 143 for SIGTERM,
130 for SIGINT, as a shell reports a process killed by it) `train.py` exits with. A
second signal acts as it would have without the handler (the default kills), so a
stuck save can still be interrupted.

With several processes (`jax.distributed`), every process must stop after the same
step: the flag alone could be seen at different steps. There the loop asks JAX's
preemption sync point (`multihost_utils.reached_preemption_sync_point`), which the
coordination service drives from SIGTERM on any process and which answers True on
every process at the same step; SIGINT is turned into a SIGTERM of this process so
that it goes the same way.
"""

from __future__ import annotations

import os
import signal
import threading

import jax
from jax.experimental import multihost_utils

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Preempted(Exception):
  """The run stopped on a signal after saving the checkpoint of `step`."""

  def __init__(self, message: str, *, signum: int, step: int | None):
    super().__init__(message)
    self.signum = signum
    self.step = step
    self.exit_code = 128 + signum


def _sync_point_available() -> bool:
  """Whether JAX's preemption sync manager runs (jax.distributed with >1 process)."""
  if jax.process_count() == 1:
    return False
  # Private (no public probe of the sync manager); imported only where it is needed.
  from jax._src import distributed  # pylint: disable=g-import-not-at-top

  return getattr(distributed.global_state, 'preemption_sync_manager', None) is not None


class StopSignal:
  """Catches SIGTERM and SIGINT while entered (main thread only; elsewhere it catches
  nothing); `reached(step)` says whether to stop after `step`."""

  def __init__(self):
    self.signum: int | None = None
    self._previous = {}
    self._sync = False

  def __enter__(self):
    if threading.current_thread() is not threading.main_thread():
      return self
    self._sync = _sync_point_available()
    for signum in SIGNALS:
      if self._sync and signum == signal.SIGTERM:
        continue  # JAX's coordination service listens to SIGTERM itself
      self._previous[signum] = signal.signal(signum, self._handle)
    return self

  def __exit__(self, *exc):
    self._restore()

  def _restore(self):
    for signum, handler in self._previous.items():
      signal.signal(signum, handler)
    self._previous = {}

  def _handle(self, signum, frame):  # pylint: disable=unused-argument
    self.signum = signum
    self._restore()  # a second signal acts as without this handler
    if self._sync:
      os.kill(os.getpid(), signal.SIGTERM)  # to JAX's preemption notifier

  def reached(self, step: int) -> bool:
    """True (on every process alike) if the run should stop after `step`."""
    if self._sync:
      stop = multihost_utils.reached_preemption_sync_point(step)
      if stop and self.signum is None:
        self.signum = signal.SIGTERM
      return stop
    return self.signum is not None
