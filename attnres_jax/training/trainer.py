"""The `Trainer`: one segment of a training run on a locked, checked workdir (set up,
the loop, the final evaluation and report, close); `loop.train_and_evaluate` runs it."""

from __future__ import annotations

import collections
import json
import math
import os
import signal
import time

import jax
import numpy as np
import tqdm

from attnres_jax.runs import checkpointing
from attnres_jax.runs import checksum
from attnres_jax.evaluation import evaluate as evaluate_lib
from attnres_jax.runs import metrics as metrics_lib
from attnres_jax.training import optim
from attnres_jax.parallel import pipeline
from attnres_jax.runs import preemption
from attnres_jax.runs import quiet
from attnres_jax.runs import storage
from attnres_jax.training import step as train_lib
from attnres_jax.runs import workdir as workdir_lib
from attnres_jax.training.setup import build_datasets, make_mesh


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
    self.stop_signal.early_message = self._early_stop_message
    if restored is None:
      self.start = 0
      self.state = train_lib.create_train_state(config.model, tx, tc.seed, self.layout)
      # The checksums of the first save, compiled now, while a signal ends the process
      # at once (a restore compiled them already): a stop then waits for no compiler.
      checksum.digest(self.state.params)
      checksum.digest(self.state.opt_state)
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
    # Compiled now, while a stop signal still ends the process at once (train.py): a
    # signal during an evaluation then waits for a batch, not for a compilation
    # (minutes on a TPU). The call at the first evaluation reuses this executable.
    first_eval_batch = self.layout.to_global(next(iter(self.datasets.eval_batches())))
    self.p_eval_step.lower(self.state.params, first_eval_batch).compile()
    self.stop = (
      tc.num_steps if self.max_steps is None else min(tc.num_steps, self.max_steps)
    )
    self.interval = metrics_lib.IntervalStats()

  def _early_stop_message(self, name: str) -> str:
    """The line of a signal before this segment's first step (nothing new to save)."""
    last = (
      f'the latest checkpoint is step {self.start}'
      if self.start
      else 'no checkpoint was saved yet'
    )
    return (
      f'Stopped by {name} before step {self.start + 1} (setting up or compiling): '
      f'nothing new to save, {last} in {self.checkpointer.directory}; run the same '
      'command to resume.'
    )

  def _evaluates_at(self, step: int) -> bool:
    every = self.tc.eval_every
    return step == self.tc.num_steps or bool(every and step % every == 0)

  def _eval_logged(self, step: int) -> bool:
    return any(
      'eval/loss' in r and r['step'] == step for r in metrics_lib.read_jsonl(self.workdir)
    )

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
    self.stop_signal.on_early_exit(self.bar.close)  # the stop line on a line of its own
    eval_result = None
    step, pending, preempted, in_eval = self.start, None, False, False
    if 0 < self.start < num_steps and self._evaluates_at(self.start):
      # The evaluation of the checkpoint's step was cut off by a signal (or a kill):
      # done now, so the run's records equal an uninterrupted run's.
      if not self._eval_logged(self.start):
        eval_result = self._evaluate(self.start)
        preempted = in_eval = eval_result is None
    while step < self.stop and not preempted:
      self.checkpointer.poll(now=step)  # a failed background save stops the run here
      batch = self.layout.to_global(next(self.datasets.train))
      self.state, step_metrics = self.p_train_step(self.state, batch)
      self.stop_signal.training()  # compiled and dispatched: a signal now saves a step
      step += 1
      if pending is not None:  # step - 1, read after dispatching step
        self._process(*pending)
      pending = (step, step_metrics)
      preempted = self.stop_signal.reached(step)
      save = step == self.stop or step % tc.checkpoint_every == 0 or preempted
      evaluate_now = not preempted and self._evaluates_at(step)
      if save or evaluate_now:
        self._process(*pending)  # never save or evaluate an unchecked state
        pending = None
      if save:
        self._save(step)
      if evaluate_now:
        eval_result = self._evaluate(step)
        if eval_result is None:  # a signal stopped it between batches: save the step
          preempted = in_eval = True
          if not save:
            self._save(step)
    if pending is not None:
      self._process(*pending)
    self._metric_writer()  # opened also by a segment that logged nothing (see there)
    self.checkpointer.finish(now=step)  # the last save is complete, or this raises
    if self.start >= num_steps and self.stop == num_steps and not preempted:
      # Already trained: evaluate (logged unless it was).
      eval_result = self._evaluate(num_steps, log=not self._eval_logged(num_steps))
      preempted = in_eval = eval_result is None
    if preempted:
      name = signal.Signals(self.stop_signal.signum).name
      when = f'during the evaluation of step {step}' if in_eval else f'after step {step}'
      redo = ' (the evaluation is done again)' if in_eval else ''
      raise preemption.Preempted(
        f'Stopped by {name} {when}: its checkpoint is saved in '
        f'{self.checkpointer.directory}; run the same command to resume{redo}.',
        signum=self.stop_signal.signum,
        step=step,
      )
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
      with self.stop_signal.critical():  # an early exit never cuts a record
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

  def _evaluate(self, step: int, log: bool = True) -> dict[str, float] | None:
    """Evaluates and logs the state of `step`; None if a signal stopped it."""
    in_flight = collections.deque()

    def eval_step(params, batch):
      if self.stop_signal.interrupts_evaluation():
        raise _EvaluationStopped
      sums = self.p_eval_step(params, batch)
      in_flight.append(sums)
      if len(in_flight) > 2:  # two batches ahead: a signal is read between batches
        jax.block_until_ready(in_flight.popleft())
      return sums

    try:
      result = evaluate_lib.evaluate(
        eval_step,
        self.state.params,
        self.datasets.eval_batches(),
        to_device=self.layout.to_global,
        max_batches=self.tc.max_eval_batches,
      )
    except _EvaluationStopped:
      self.interval.pause()
      return None
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

  def close(self, *, failed: bool = False) -> None:
    """Waits for a save in flight (a save error is logged, not raised: the one that
    stopped the run is already on its way) and closes the writers; `failed`: the run
    stopped on an error, which a writer's own failure to close only repeats."""
    if self.bar is not None:
      self.bar.close()
    if self.checkpointer is not None:
      self.checkpointer.close()
    if self.writer is not None:
      self.writer.close(failed=failed)


class _EvaluationStopped(Exception):
  """A stop signal arrived during an evaluation (raised between its batches)."""
