"""Stopping a run cleanly on SIGTERM or SIGINT (preemption, a scheduler, Ctrl-C).

Cloud TPU preemption, Kubernetes and SLURM send SIGTERM some seconds before SIGKILL.
`StopSignal` turns the first SIGTERM or SIGINT into a flag the training loop reads at
the end of every step (and between evaluation batches); the loop then saves that
step's checkpoint, waits for the save and raises `Preempted`, whose `exit_code` (128 +
the signal number: 143 for SIGTERM, 130 for SIGINT, as a shell reports a process
killed by it) `train.py` exits with. A second signal acts as it would have without the
handler (the default kills), so a stuck save can still be interrupted.

Before a segment's first step there is nothing new to save, and the wait can be long:
XLA compiles the step in C++, and Python runs a signal handler only between bytecodes,
so the flag would be read only after the compilation (minutes on a TPU) and one step.
With `exit_early` (command lines: `train.py`, `eval.py`) a thread woken through
`signal.set_wakeup_fd` acts at once instead, until `training()` says the loop reads
the flag: it waits for a write in progress (`critical()`), runs the clean-ups
registered with `on_early_exit` (closing the progress bar, releasing the workdir lock,
removing a workdir the run created and left empty), prints one line and ends the
process with the same exit code (`os._exit`: the main thread may be inside XLA).
Nothing is written then that a resumed run would miss: the segment has trained
nothing yet.

With several processes (`jax.distributed`), every process must stop after the same
step: the flag alone could be seen at different steps. There the loop asks JAX's
preemption sync point (`multihost_utils.reached_preemption_sync_point`), which the
coordination service drives from SIGTERM on any process and which answers True on
every process at the same step; SIGINT is turned into a SIGTERM of this process so
that it goes the same way. There a signal is acted on only at a step's end (no early
exit, no stop inside an evaluation, which is a collective program every process must
finish).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable

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
  nothing); `reached(step)` says whether to stop after `step`. `exit_early`: until
  `training()`, a signal ends the process at once (see the module docstring)."""

  def __init__(self, *, exit_early: bool = False):
    self.signum: int | None = None
    self._previous = {}
    self._sync = False
    self._exit_early = exit_early
    self._early = False
    self._mutex = threading.RLock()  # held by a write the early exit must not cut
    self._cleanups: list[Callable[[], None]] = []
    self.early_message: Callable[[str], str] = lambda name: (
      f'Stopped by {name} while setting up the run; nothing new to save; run the '
      'same command to resume.'
    )
    self._wakeup = None  # (read fd, write fd, the wakeup fd before)

  def __enter__(self):
    if threading.current_thread() is not threading.main_thread():
      return self
    self._sync = _sync_point_available()
    for signum in SIGNALS:
      if self._sync and signum == signal.SIGTERM:
        continue  # JAX's coordination service listens to SIGTERM itself
      self._previous[signum] = signal.signal(signum, self._handle)
    if self._exit_early and not self._sync:
      self._early = True
      read_fd, write_fd = os.pipe()
      os.set_blocking(write_fd, False)  # as set_wakeup_fd requires
      before = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
      self._wakeup = (read_fd, write_fd, before)
      threading.Thread(
        target=self._watch, args=(read_fd,), daemon=True, name='stop-signal'
      ).start()
    return self

  def __exit__(self, *exc):
    self._restore()
    with self._mutex:
      self._early = False
    if self._wakeup is not None:
      read_fd, write_fd, before = self._wakeup
      signal.set_wakeup_fd(before)
      os.close(write_fd)  # the watcher reads the end of the pipe and returns
      self._wakeup = None

  def _restore(self):
    for signum, handler in self._previous.items():
      signal.signal(signum, handler)
    self._previous = {}

  def _handle(self, signum, frame):  # pylint: disable=unused-argument
    self.signum = signum
    self._restore()  # a second signal acts as without this handler
    if self._sync:
      os.kill(os.getpid(), signal.SIGTERM)  # to JAX's preemption notifier

  def _watch(self, read_fd: int) -> None:
    """The watcher thread: woken by each signal's number, written by the C-level
    handler even while the main thread is inside XLA."""
    seen = 0
    try:
      while data := os.read(read_fd, 64):
        for signum in data:
          if signum not in SIGNALS:
            continue
          seen += 1
          if seen > 1:  # as the default handler would: no clean-up
            _exit(f'Killed by a second {signal.Signals(signum).name}.', signum)
          with self._mutex:
            if self._early:
              self._exit_now(signum)
    finally:
      os.close(read_fd)

  def _exit_now(self, signum: int) -> None:
    name = signal.Signals(signum).name
    for cleanup in reversed(self._cleanups):
      try:
        cleanup()
      except Exception as e:  # pylint: disable=broad-except
        print(f'WARNING: cleaning up after {name} failed: {e}', file=sys.stderr)
    _exit(self.early_message(name), signum)

  def on_early_exit(self, cleanup: Callable[[], None]) -> None:
    """Runs `cleanup` (in the watcher thread; the last registered first) if a signal
    ends the process before `training()`."""
    self._cleanups.append(cleanup)

  @contextlib.contextmanager
  def critical(self):
    """A write that an early exit waits for (it must not leave it half done)."""
    with self._mutex:
      yield

  def training(self) -> None:
    """From now on a signal is a flag the loop reads (a step to save): no early exit."""
    with self._mutex:
      self._early = False

  def reached(self, step: int) -> bool:
    """True (on every process alike) if the run should stop after `step`."""
    if self._sync:
      stop = multihost_utils.reached_preemption_sync_point(step)
      if stop and self.signum is None:
        self.signum = signal.SIGTERM
      return stop
    return self.signum is not None

  def interrupts_evaluation(self) -> bool:
    """True if a signal arrived and an evaluation may stop between batches (one
    process: with several, every process must run the whole evaluation)."""
    return not self._sync and self.signum is not None


def _exit(message: str, signum: int) -> None:
  """Prints `message`, flushes the output and ends the process with 128 + `signum`."""
  for stream in (sys.stdout, sys.stderr):
    with contextlib.suppress(Exception):
      stream.flush()
  with contextlib.suppress(Exception):
    os.write(2, f'{message}\n'.encode())
  os._exit(128 + signum)  # pylint: disable=protected-access
