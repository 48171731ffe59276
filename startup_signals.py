"""The command lines' first import (train.py, eval.py): until a run catches SIGTERM and
SIGINT itself, a signal (a scheduler's stop, Ctrl-C while Python imports JAX) ends the
process at once with one line and no KeyboardInterrupt traceback. Standard library
only, so that it is in force before anything heavy is imported."""

import os
import signal

_LINE = ['Stopped by {name} while starting; nothing was written.']


def set_line(line: str) -> None:
  """What a signal that lands here says from now on ('{name}': the signal's name)."""
  _LINE[0] = line


def _stop_at_once(signum, frame):
  del frame
  name = signal.Signals(signum).name
  os.write(2, (_LINE[0].format(name=name) + '\n').encode())
  os._exit(128 + signum)  # pylint: disable=protected-access


def install() -> None:
  for signum in (signal.SIGTERM, signal.SIGINT):
    signal.signal(signum, _stop_at_once)
