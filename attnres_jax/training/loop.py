"""The host loop of a training run: one segment on a locked, checked workdir.

`train_and_evaluate` checks the config and the workdir, locks it and catches
SIGTERM/SIGINT, then runs a `Trainer`: set up (datasets, mesh, jitted steps, the state
restored from the newest good checkpoint), `run` (the loop, the final evaluation and
report) and `close`. The loop reads step k's metrics after dispatching step k + 1,
never saves or evaluates a state whose loss it has not checked, and stops after the
step at which a signal arrived with a checkpoint of it (`preemption`); a signal during
an evaluation stops it between batches, and the step is saved and evaluated again
when the run resumes. Before the first step a command line's `StopSignal(exit_early=
True)` ends the process at once instead (nothing new to save).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
import contextlib
import json
import time

import jax
import ml_collections

from attnres_jax import config as config_lib
from attnres_jax.data import sources
from attnres_jax.runs import preemption
from attnres_jax.runs import storage
from attnres_jax.training import step as train_lib
from attnres_jax.runs import workdir as workdir_lib
from attnres_jax.training.trainer import Trainer


# -- the host loop --------------------------------------------------------------------


def train_and_evaluate(
  config: ml_collections.ConfigDict,
  workdir: str,
  *,
  max_steps: int | None = None,
  on_metrics: Callable[[int, dict[str, float]], None] | None = None,
  allow_config_change: Sequence[str] = (),
  stop_signal: preemption.StopSignal | None = None,
) -> train_lib.TrainResult:
  """Trains (resuming from `workdir` if it holds checkpoints) and evaluates.

  `max_steps` stops this run early at that step, with a checkpoint (e.g. to split a
  run into jobs); the learning rate schedule still follows `config.train.num_steps`.
  `on_metrics(step, record)` sees every record written to `metrics.jsonl` as it is
  written ('train/...' every `log_every` steps, 'eval/...' at evaluations), on process
  0 only: e.g. a live plot in a notebook.
  `allow_config_change` names config fields ('num_steps', 'train.seq_len') that may
  differ from those of the checkpoints being resumed (see `workdir_lib.check_run_config`).
  `stop_signal`: an entered `preemption.StopSignal` (`train.py`'s, which ends the
  process on a signal before the first step); default: one entered once the workdir
  is locked, whose signals are acted on after a step.

  The run holds the workdir lock (`workdir.WorkdirLock`) throughout, and writes the run
  record (`config.json`, `config_history.jsonl`) with its first checkpoint. Raises
  NonFiniteLossError naming the step if a loss or gradient norm is not finite (the
  state of that step is not saved), CheckpointSaveError or MetricsWriteError as soon
  as a write fails, OSError naming the workdir if it is a bucket that cannot be
  reached, and `preemption.Preempted` after saving the step at which a SIGTERM or
  SIGINT arrived.
  """
  run_start = time.perf_counter()
  config_lib.validate(config, num_devices=jax.device_count())
  workdir_lib.resolve_allowed(
    allow_config_change, workdir_lib.flatten(json.loads(config.to_json()))
  )  # a misspelt field fails here, not after locking
  sources.check_dataset(config.data)
  train_lib.check_memory(config)
  storage.check_supported(workdir)  # before anything looks for it
  storage.check_reachable(workdir)  # a bucket without network or credentials: seconds
  fresh = not storage.exists(workdir)
  held = workdir_lib.RunLock(storage.absolute(workdir), fresh)
  given = stop_signal is not None
  if given:
    stop_signal.on_early_exit(held.give_up)
  try:
    with stop_signal.critical() if given else contextlib.nullcontext():
      workdir = workdir_lib.make_workdir(workdir)
    held.lock = workdir_lib.lock_workdir(workdir, 'train')
    record = workdir_lib.check_run_config(workdir, config, allow_config_change)
    with (
      contextlib.nullcontext(stop_signal) if given else preemption.StopSignal() as stop
    ):
      trainer = Trainer(
        config,
        workdir,
        record,
        max_steps=max_steps,
        on_metrics=on_metrics,
        stop_signal=stop,
      )
      try:
        result = trainer.run(run_start)
      except BaseException:
        trainer.close(failed=True)
        raise
      trainer.close()
      return result
  except BaseException:
    if fresh:  # an early failure leaves no half-made run directory
      workdir_lib.remove_if_unused(workdir, held.lock)
      held.lock = None
    raise
  finally:
    if held.lock is not None:
      held.lock.release()
