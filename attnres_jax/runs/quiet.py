"""Keeping orbax's background noise out of what a run prints, and errors to one line.

A run reports a failed save once, in one line (`checkpointing.CheckpointSaveError`);
orbax's own threads would also log a traceback per array, and TensorStore callbacks
that outlive orbax's event loop raise 'Event loop is closed' as unraisable exceptions.
"""

from __future__ import annotations

import contextlib
import errno
import logging as std_logging
import os
import sys

from absl import logging


class _DropMessage(std_logging.Filter):
  """Drops the log records of one format string."""

  def __init__(self, message: str):
    super().__init__()
    self.message = message

  def filter(self, record: std_logging.LogRecord) -> bool:
    return record.msg != self.message


@contextlib.contextmanager
def dropping(message: str):
  """Drops absl log records of the format string `message` while entered."""
  drop = _DropMessage(message)
  logging.get_absl_logger().addFilter(drop)
  try:
    yield
  finally:
    logging.get_absl_logger().removeFilter(drop)


class _DropBackgroundErrors(std_logging.Filter):
  """Drops error logs of orbax's background threads and of asyncio's leftovers."""

  def filter(self, record: std_logging.LogRecord) -> bool:
    path = record.pathname.replace(os.sep, '/')
    return not (
      record.levelno >= std_logging.ERROR and ('/orbax/' in path or '/asyncio/' in path)
    )


def silence_save_errors() -> None:
  """From now on in this process, a failing save is reported once, by
  CheckpointSaveError, not also by orbax's threads: their error logs (a traceback per
  array) and the 'Event loop is closed' errors of TensorStore callbacks that outlive
  orbax's event loop (unraisable exceptions, some at exit) are dropped. For command
  lines (train.py; its --debug keeps them)."""
  previous_hook = sys.unraisablehook

  def hook(unraisable):
    if not (
      isinstance(unraisable.exc_value, RuntimeError)
      and str(unraisable.exc_value) == 'Event loop is closed'
    ):
      previous_hook(unraisable)

  logging.get_absl_handler().addFilter(_DropBackgroundErrors())  # all loggers
  sys.unraisablehook = hook


def root_cause(error: BaseException) -> str:
  """'Type: first line' of the innermost exception of `error`'s chain (TensorStore's
  outer messages run to pages and name no file)."""
  seen = set()
  while (error.__cause__ or error.__context__) is not None and id(error) not in seen:
    seen.add(id(error))
    error = error.__cause__ or error.__context__
  lines = str(error).strip().splitlines()
  return f'{type(error).__name__}: {lines[0][:300] if lines else ""}'


def save_error_cause(error: BaseException) -> str:
  """The root cause of a save error, e.g. '[Errno 28] No space left on device'."""
  seen, chain = set(), []
  while error is not None and id(error) not in seen:
    seen.add(id(error))
    chain.append(error)
    error = error.__cause__ or error.__context__
  for e in chain:  # an OS error with an errno says it best
    if isinstance(e, OSError) and e.errno is not None:
      return f'{type(e).__name__}: [Errno {e.errno}] {os.strerror(e.errno)}' + (
        f': {e.filename}' if e.filename else ''
      )
  text = str(chain[-1]).strip().splitlines()
  if any('No space left' in str(e) for e in chain):
    return f'[Errno {errno.ENOSPC}] No space left on device'
  return f'{type(chain[-1]).__name__}: {text[0][:300] if text else ""}'
