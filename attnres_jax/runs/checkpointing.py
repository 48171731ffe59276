"""Checkpoints with orbax's `CheckpointManager` (args API), and the run config.

A checkpoint of step s, in `<workdir>/checkpoints/<s>/`, holds three items of one
`ocp.args.Composite`:
  params:      the model parameters (a pure dict, `nnx.to_pure_dict`)
  train_state: {'step': s, 'opt_state': the optax state}
  data:        the training data iterator state (grain's checkpoint handler, JSON,
               one file per process)
  digest:      checksums of the params and of the optimizer state (`checksum.digest`)
all after s optimizer updates and s batches. A restore recomputes the checksums of
what it read and treats a mismatch (bytes damaged inside an array file, which the
decoder does not notice) like any other damaged checkpoint. Orbax writes each step
into a temporary directory and renames it when complete, so a run killed during a
save leaves the earlier checkpoints usable; the unfinished temporary directory is
ignored and removed at the next start. A complete checkpoint whose files were damaged
later is moved to `<workdir>/corrupt_checkpoints/` by the training loop
(`move_aside`), never deleted.

A save that fails (disk full, I/O error), in the background too, raises
CheckpointSaveError from the next `poll`, `save` or `finish`, naming the step, the
cause and the last good checkpoint.

`<workdir>/config.json` is the full run config, written with a run's first checkpoint
(`workdir.RunRecord`); `restore_model` rebuilds the model from it.
"""

from __future__ import annotations

import json
import os
from typing import Any

import grain
import jax
import ml_collections
import numpy as np
import orbax.checkpoint as ocp
from absl import logging
from flax import nnx
from jax.experimental import multihost_utils

from attnres_jax import config as config_lib
from attnres_jax.models import transformer as model_lib
from attnres_jax.runs import checksum
from attnres_jax.runs import metrics
from attnres_jax.runs import quiet
from attnres_jax.runs import storage

CONFIG_JSON = 'config.json'
CHECKPOINTS = 'checkpoints'
CORRUPT = 'corrupt_checkpoints'


class CheckpointSaveError(OSError):
  """A checkpoint save failed; the run must stop."""


class CheckpointRestoreError(RuntimeError):
  """No checkpoint of a workdir restores."""


def checkpoint_dir(workdir: str) -> str:
  return os.path.join(storage.absolute(workdir), CHECKPOINTS)


def save_config(workdir: str, config: ml_collections.ConfigDict) -> None:
  """Writes `config.json` atomically (a temporary file and a rename; on gs:// one
  object upload)."""
  path = os.path.join(workdir, CONFIG_JSON)
  storage.write_text(path, config.to_json(indent=2, sort_keys=True))


def load_config(workdir: str) -> ml_collections.ConfigDict:
  """The run's saved config; model fields added since it was saved get defaults."""
  config = ml_collections.ConfigDict(
    json.loads(storage.read_text(os.path.join(workdir, CONFIG_JSON)))
  )
  if 'model' in config:
    config.model = ml_collections.ConfigDict(
      config_lib.ModelConfig.from_config(config.model).to_dict()
    )
  return config


class Checkpointer:
  """Saves and restores (params, optimizer state, step, data iterator) by step."""

  def __init__(
    self,
    workdir: str,
    *,
    save_every: int,
    keep: int | None,
    async_save: bool = True,
    read_only: bool = False,
  ):
    options = ocp.CheckpointManagerOptions(
      save_interval_steps=0 if read_only else save_every,
      max_to_keep=None if read_only else keep,
      create=not read_only,
      read_only=read_only,
      cleanup_tmp_directories=not read_only,
      enable_async_checkpointing=async_save,
    )
    self.directory = checkpoint_dir(workdir)
    with quiet.dropping('Given directory is read only=%s'):  # said at every read-only use
      self.manager = ocp.CheckpointManager(self.directory, options=options)
    self._saving = None  # the step of a save that may still be running

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def all_steps(self) -> list[int]:
    return list(self.manager.all_steps())

  def save(
    self,
    step: int,
    *,
    params,
    opt_state,
    train_iter: grain.DatasetIterator,
    force: bool = False,
  ) -> bool:
    """Starts saving step `step` (asynchronously if enabled); True if it saves.

    Raises CheckpointSaveError if the previous save or this one's synchronous part
    failed.
    """
    self.finish(now=step)
    try:
      saved = self.manager.save(
        step,
        args=ocp.args.Composite(
          params=ocp.args.StandardSave(params),
          train_state=ocp.args.StandardSave({'step': step, 'opt_state': opt_state}),
          data=grain.checkpoint.CheckpointSave(train_iter),
          digest=ocp.args.JsonSave(
            {'params': checksum.digest(params), 'opt_state': checksum.digest(opt_state)}
          ),
        ),
        force=force,
      )
    except Exception as e:  # pylint: disable=broad-except
      raise self._save_error(step, e, now=step) from e
    if saved:
      self._saving = step
    return saved

  def _save_error(self, step: int, error: BaseException, now: int) -> CheckpointSaveError:
    self.manager.reload()  # forget the failed step
    last = self.manager.latest_step()
    return CheckpointSaveError(
      f'Saving the checkpoint of step {step} in {self.directory} failed: '
      f'{quiet.save_error_cause(error)}. Training stopped at step {now}; '
      'the last good checkpoint is '
      + (f'step {last}.' if last is not None else 'none (no checkpoint was saved).')
    )

  def poll(self, now: int) -> None:
    """Raises CheckpointSaveError if a background save has failed (never blocks)."""
    if self._saving is not None and not self.manager.is_saving_in_progress():
      self.finish(now)

  def finish(self, now: int) -> None:
    """Waits for a running save; raises CheckpointSaveError if it failed."""
    if self._saving is None:
      return
    step, self._saving = self._saving, None
    try:
      self.manager.wait_until_finished()
    except Exception as e:  # pylint: disable=broad-except
      raise self._save_error(step, e, now=now) from e

  def move_aside(self, step: int) -> str:
    """Moves checkpoint `step` to `<workdir>/corrupt_checkpoints/` (process 0); returns
    where it went."""
    target_dir = os.path.join(os.path.dirname(self.directory), CORRUPT)
    target = os.path.join(target_dir, str(step))
    n = 1
    while storage.exists(target):
      target = os.path.join(target_dir, f'{step}.{n}')
      n += 1
    if jax.process_index() == 0:
      storage.makedirs(target_dir)
      storage.rename(os.path.join(self.directory, str(step)), target)
    if jax.process_count() > 1:
      multihost_utils.sync_global_devices(f'checkpoint {step} moved aside')
    self.manager.reload()
    return target

  def restore(
    self,
    step: int,
    *,
    abstract_params,
    abstract_opt_state,
    train_iter: grain.DatasetIterator | None,
  ) -> tuple[Any, Any]:
    """(params, opt_state) of `step`; also sets `train_iter` (unless None) to its
    saved state.

    The abstract trees are `jax.ShapeDtypeStruct`s with the target shardings, which
    may differ from those the checkpoint was saved with (another mesh, another number
    of processes): every process reads the pieces its devices need.
    """
    items = dict(
      params=ocp.args.StandardRestore(abstract_params),
      train_state=ocp.args.StandardRestore({'step': 0, 'opt_state': abstract_opt_state}),
    )
    if train_iter is not None:
      items['data'] = grain.checkpoint.CheckpointRestore(train_iter)
    if self._has_digest(step):
      items['digest'] = ocp.args.JsonRestore()
    restored = self.manager.restore(step, args=ocp.args.Composite(**items))
    if int(restored.train_state['step']) != step:
      raise ValueError(f'Checkpoint {step} holds step {restored.train_state["step"]}.')
    saved = restored.get('digest')
    checksum.verify(step, 'params', restored.params, saved)
    checksum.verify(step, 'opt_state', restored.train_state['opt_state'], saved)
    return restored.params, restored.train_state['opt_state']

  def _has_digest(self, step: int) -> bool:
    return storage.isdir(os.path.join(self.directory, str(step), 'digest'))

  def data_process_count(self, step: int) -> int | None:
    """How many processes wrote the data iterator states of `step` (None: unknown)."""
    directory = os.path.join(self.directory, str(step), 'data')
    counts = {
      name.rsplit('-of-', 1)[-1].split('.')[0]
      for name in storage.listdir(directory)
      if name.startswith('process_') and '-of-' in name
    }
    return int(counts.pop()) if len(counts) == 1 else None

  def restore_params(self, step: int, abstract_params):
    """The params of `step`, checked against their checksum."""
    items = dict(params=ocp.args.StandardRestore(abstract_params))
    if self._has_digest(step):
      items['digest'] = ocp.args.JsonRestore()
    restored = self.manager.restore(step, args=ocp.args.Composite(**items))
    checksum.verify(step, 'params', restored.params, restored.get('digest'))
    return restored.params

  def wait(self) -> None:
    self.manager.wait_until_finished()

  def close(self) -> None:
    """Waits for a running save and closes; a save error is logged, not raised (call
    `finish` first to get it)."""
    try:
      self.manager.close()
    except Exception as e:  # pylint: disable=broad-except
      logging.error(
        'A checkpoint save in %s failed: %s', self.directory, quiet.save_error_cause(e)
      )


def abstract_model(config: ml_collections.ConfigDict):
  """(graphdef, abstract pure-dict params) of the model, without allocating it."""
  abstract = nnx.eval_shape(lambda: model_lib.Transformer(config, rngs=nnx.Rngs(0)))
  graphdef, state = nnx.split(abstract)
  return graphdef, nnx.to_pure_dict(state)


def restore_model(workdir: str, step: int | None = None):
  """(model, config, step): the model of `workdir`'s checkpoint `step` (default latest).

  Rebuilds the Transformer from `<workdir>/config.json` and restores its parameters
  only (no optimizer or data state), on the first local device.
  """
  config = load_config(workdir)
  checkpointer = Checkpointer(
    workdir, save_every=0, keep=None, async_save=False, read_only=True
  )
  try:
    step = checkpointer.latest_step() if step is None else step
    if step is None:
      raise FileNotFoundError(f'No checkpoint in {checkpointer.directory}.')
    if step not in checkpointer.all_steps():
      raise FileNotFoundError(
        f'No checkpoint of step {step} in {checkpointer.directory}; '
        f'steps: {checkpointer.all_steps()}.'
      )
    graphdef, abstract = abstract_model(config.model)
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    abstract = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device), abstract
    )
    try:
      params = checkpointer.restore_params(step, abstract)
    except Exception as e:  # pylint: disable=broad-except
      others = [s for s in checkpointer.all_steps() if s != step]
      raise CheckpointRestoreError(
        f'The checkpoint of step {step} in {checkpointer.directory} does not restore '
        f'({quiet.root_cause(e)}); other steps: {others}.'
      ) from e
  finally:
    checkpointer.close()
  return nnx.merge(graphdef, params), config, step


def newest_that_restores(workdir: str, steps, fn, say=metrics.say):
  """`fn(step)` for the newest of `steps` for which it does not fail to restore
  (CheckpointRestoreError, FileNotFoundError); says why each newer one was passed
  over: deleted while it was read (a running training keeps only its newest
  checkpoints), or damaged. Raises the last step's error."""
  steps = sorted(steps, reverse=True)
  for i, step in enumerate(steps):
    try:
      return fn(step)
    except (CheckpointRestoreError, FileNotFoundError) as e:
      if i + 1 == len(steps):
        raise
      gone = not storage.isdir(os.path.join(checkpoint_dir(workdir), str(step)))
      say(
        f'WARNING: the checkpoint of step {step} '
        + (
          'was deleted while it was read (a running training keeps only its newest '
          'checkpoints)'
          if gone
          else f'does not restore ({quiet.root_cause(e)})'
        )
        + f'; using step {steps[i + 1]} instead.'
      )


def _on_all_processes(ok: bool) -> bool:
  """True if `ok` holds on every process."""
  if jax.process_count() == 1:
    return ok
  return bool(np.all(multihost_utils.process_allgather(np.int32(ok))))


def restore_newest(checkpointer: Checkpointer, layout, datasets, *, restore_data: bool):
  """(step, params, opt_state) of the newest checkpoint that restores, or None.

  A checkpoint that fails to restore (truncated or zeroed files, a missing iterator
  state) is reported; once an older one restores, the failed newer ones are moved to
  `<workdir>/corrupt_checkpoints/`. If none restores, nothing is moved (the cause may
  be this code or config, not the files) and CheckpointRestoreError lists them all.
  """
  failures = []
  for step in sorted(checkpointer.all_steps(), reverse=True):
    train_iter = datasets.train if restore_data else None
    saved_processes = checkpointer.data_process_count(step)
    if train_iter is not None and saved_processes not in (None, jax.process_count()):
      metrics.say(
        f'WARNING: the checkpoint of step {step} was written by {saved_processes} '
        f'processes, this run has {jax.process_count()}: the model and optimizer '
        'state are restored (resharded), but the training data order cannot be, so '
        'the data iterators start afresh.'
      )
      train_iter = None
    abstract = layout.abstract_state
    try:
      params, opt_state = checkpointer.restore(
        step,
        abstract_params=abstract.params,
        abstract_opt_state=abstract.opt_state,
        train_iter=train_iter,
      )
      error = None
    except Exception as e:  # pylint: disable=broad-except
      error = e
    if not _on_all_processes(error is None):
      why = quiet.root_cause(error) if error else 'failed on another process'
      failures.append((step, why))
      metrics.say(
        f'WARNING: the checkpoint of step {step} in {checkpointer.directory} does '
        f'not restore ({failures[-1][1]}); trying the previous one.'
      )
      continue
    for bad, _ in failures:
      where = checkpointer.move_aside(bad)
      metrics.say(f'Moved the unreadable checkpoint of step {bad} to {where}.')
    return step, params, opt_state
  if failures:
    raise CheckpointRestoreError(
      f'No checkpoint in {checkpointer.directory} restores:'
      + ''.join(f'\n  step {step}: {why}' for step, why in failures)
      + '\nNothing was moved. Move the broken steps away to start from an older one, '
      'or use another workdir.'
    )
  return None
