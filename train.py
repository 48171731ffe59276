"""Trains an AttnRes language model: python train.py [--config=configs/default.py[:variants]]
[--workdir=DIR].

Config variants and overrides on the command line, e.g.
  python train.py --config=configs/default.py:paper_small,full --config.train.num_steps=100

Several processes (docs/scaling.md): give each the same --coordinator_address and
--num_processes and its own --process_id, or pass --distributed where JAX finds them
itself (Cloud TPU pod slices, SLURM, Open MPI). Every process runs the same command on
the same --workdir.

A run locks its workdir (a second run on it is refused), and a resumed run must have
the config of the checkpoints it resumes, except for the fields named in
--allow_config_change (recorded in the workdir's config_history.jsonl).

On SIGTERM or SIGINT (preemption, a scheduler, Ctrl-C) the run finishes the step in
flight (or the evaluation batch), saves its checkpoint and exits with 128 + the signal
number (143 for SIGTERM, 130 for SIGINT) and one line naming the step; the same
command resumes from it. Before the first step (imports, set-up, the compilation)
there is nothing new to save: it exits at once, the workdir lock released.
Errors are one FATAL line (exit 1); --debug shows the traceback.
"""

import os
import sys

import startup_signals  # first: a signal while starting ends the run in one line

startup_signals.install()

import traceback

import jax
from absl import app
from absl import flags
from absl import logging
from ml_collections import config_flags

from attnres_jax.compile_report import aot
from attnres_jax.compile_report import suggest
from attnres_jax import config as config_lib
from attnres_jax.runs import preemption
from attnres_jax.runs import quiet
from attnres_jax.runs import storage
from attnres_jax.training import step as train
from attnres_jax.training import loop as loop_lib

_CONFIG = config_flags.DEFINE_config_file(
  'config', 'configs/default.py', 'Training configuration file.', lock_config=True
)
_WORKDIR = flags.DEFINE_string(
  'workdir',
  'workdirs/default',
  'Checkpoints, metrics and config.json; a run resumes from the latest checkpoint.',
)
_DISTRIBUTED = flags.DEFINE_bool(
  'distributed',
  False,
  'Call jax.distributed.initialize() and let JAX detect the cluster (TPU pod slice, '
  'SLURM, Open MPI); implied by --coordinator_address.',
)
_COORDINATOR = flags.DEFINE_string(
  'coordinator_address',
  None,
  'host:port of process 0, for a multi-process run (e.g. localhost:1234).',
)
_NUM_PROCESSES = flags.DEFINE_integer(
  'num_processes', None, 'Processes of a multi-process run.'
)
_PROCESS_ID = flags.DEFINE_integer(
  'process_id', None, 'This process, 0 .. num_processes - 1.'
)
_COMPILE_ONLY = flags.DEFINE_bool(
  'compile_only',
  False,
  'Compile the train, eval and decode steps for --topology (a TPU, on any host: '
  'needs libtpu) and report memory, FLOPs, step time and collectives; trains nothing. '
  'Writes compile_report.json to --workdir if given, else prints it.',
)
_TOPOLOGY = flags.DEFINE_string(
  'topology',
  None,
  'With --compile_only: a TPU topology, e.g. v5e:2x2, v5p:2x2x1, v5p:4x4x4, v6e:8x8.',
)
_NUM_SLICES = flags.DEFINE_integer(
  'num_slices', 1, 'With --compile_only: slices of --topology (DCN).'
)
_SUGGEST = flags.DEFINE_bool(
  'suggest',
  False,
  'With --compile_only: compile the train step over a small grid (remat policies x '
  'sequences per chip) and print the flags of the best estimated step that fits.',
)
_ALLOW_CONFIG_CHANGE = flags.DEFINE_list(
  'allow_config_change',
  [],
  'Config fields (e.g. num_steps,train.learning_rate) that may differ from those of '
  'the checkpoints being resumed; the change is recorded in config_history.jsonl.',
)
_DEBUG = flags.DEFINE_bool(
  'debug', False, 'Print the full traceback of an error, not one line.'
)


def parse_flags(argv):
  """absl's flag parsing, with a readable message for an unknown config field."""
  try:
    return flags.FLAGS(argv)
  except (AttributeError, KeyError):
    message = config_lib.explain_config_overrides(argv, default='configs/default.py')
    if message is None:
      raise
    print(f'FATAL Flags parsing error: {message}', file=sys.stderr)
    sys.exit(1)
  except flags.Error as e:
    print(f'FATAL Flags parsing error: {e}', file=sys.stderr)
    print('Pass --helpshort or --helpfull to see help on flags.', file=sys.stderr)
    sys.exit(1)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  if _DISTRIBUTED.value or _COORDINATOR.value is not None:
    jax.distributed.initialize(
      coordinator_address=_COORDINATOR.value,
      num_processes=_NUM_PROCESSES.value,
      process_id=_PROCESS_ID.value,
    )
  elif _NUM_PROCESSES.value is not None or _PROCESS_ID.value is not None:
    raise app.UsageError('--num_processes and --process_id need --coordinator_address.')
  if not flags.FLAGS['verbosity'].present:
    logging.set_verbosity(logging.WARNING)  # orbax logs every file at INFO
  if _TOPOLOGY.value and not _COMPILE_ONLY.value:
    raise app.UsageError('--topology is for --compile_only.')
  if _SUGGEST.value and not _COMPILE_ONLY.value:
    raise app.UsageError('--suggest is for --compile_only.')
  if _SUGGEST.value:
    sys.exit(suggest.main(_CONFIG.value, _TOPOLOGY.value, _NUM_SLICES.value))
  if _COMPILE_ONLY.value:
    workdir = _WORKDIR.value if flags.FLAGS['workdir'].present else None
    sys.exit(aot.main(_CONFIG.value, _TOPOLOGY.value, _NUM_SLICES.value, workdir))
  if not _DEBUG.value:
    quiet.silence_save_errors()  # a failed save: one line, not pages of orbax's
  try:
    storage.check_reachable(_WORKDIR.value)  # gs:// without network: seconds, one line
    with preemption.StopSignal(exit_early=True) as stop_signal:
      startup_signals.set_line(
        'Killed by a second {name}: the save in flight is abandoned; the same '
        'command resumes from the checkpoint before it.'
      )
      loop_lib.train_and_evaluate(
        _CONFIG.value,
        _WORKDIR.value,
        allow_config_change=_ALLOW_CONFIG_CHANGE.value,
        stop_signal=stop_signal,
      )
  except preemption.Preempted as e:
    # Saved, closed and unlocked: end now, without the seconds Python's teardown of
    # JAX and the data loader's threads takes (out of the grace period).
    print(e, file=sys.stderr)
    logging.flush()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(e.exit_code)  # pylint: disable=protected-access
  except (*train.RUN_ERRORS, ValueError, OSError) as e:  # config and I/O errors say all
    if _DEBUG.value:
      traceback.print_exc()
    print(f'FATAL: {e}', file=sys.stderr)
    sys.exit(1)


if __name__ == '__main__':
  app.run(main, flags_parser=parse_flags)
