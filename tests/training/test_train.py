"""Training end to end (offline, tiny models): the embedded corpus, a catalog dataset,
checkpoints, resumption bitwise, and eval.py on a trained run."""

from __future__ import annotations

import functools
import glob
import json
import math
import os
import shutil
import subprocess
import sys
import threading

import grain
import jax
import numpy as np
import pytest
import tensorflow_datasets as tfds
from flax import nnx

from attnres_jax.runs import checkpointing
from attnres_jax.runs import metrics as metrics_lib
from attnres_jax.training import step as train_lib
from attnres_jax.training import loop as loop_lib
from attnres_jax.runs import workdir as workdir_lib
from configs import default as default_config

from conftest import tiny_run_config
from conftest import child_env


def _train_records(workdir) -> list[dict]:
  return [r for r in metrics_lib.read_jsonl(workdir) if 'train/loss' in r]


def _assert_trees_equal(a, b):
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(a), jax.device_get(b))


def _checkpoint_entries(workdir) -> list[str]:
  return sorted(os.listdir(checkpointing.checkpoint_dir(workdir)))


def _tensorboard_steps(workdir, tag='train/loss') -> list[int]:
  """The steps of `tag` as TensorBoard shows them (purges applied)."""
  return [step for step, _ in metrics_lib.read_tensorboard(str(workdir))[tag]]


# -- end to end -----------------------------------------------------------------------


def test_trains_on_embedded_corpus(tfds_dir, tmp_path):
  config = tiny_run_config(tfds_dir)
  seen = []
  result = loop_lib.train_and_evaluate(
    config, str(tmp_path), on_metrics=lambda step, record: seen.append((step, record))
  )

  records = _train_records(tmp_path)
  # The hook saw every written record, as written (metrics.jsonl rounds nothing).
  assert [{'step': step, **record} for step, record in seen] == list(
    metrics_lib.read_jsonl(tmp_path)
  )
  assert [r['step'] for r in records] == [5, 10, 15, 20, 25, 30]
  first, last = records[0]['train/loss'], records[-1]['train/loss']
  # Untrained byte model: about ln 256 = 5.55 nats; 30 small steps reach below 3.6.
  assert first > 4.5 and last < 3.6 and last < first - 1.5
  assert result.train_loss == last
  for r in records:
    assert r['train/bits_per_byte'] == pytest.approx(r['train/loss'] / math.log(2))
    assert r['train/grad_norm'] > 0 and r['train/learning_rate'] > 0
  assert all(
    r['train/tokens_per_sec'] > 0 and r['train/step_time'] > 0 for r in records[1:]
  )
  # Held-out evaluation, printed and written to metrics.jsonl and eval_final.json.
  evals = [r for r in metrics_lib.read_jsonl(tmp_path) if 'eval/loss' in r]
  assert [r['step'] for r in evals] == [30]
  with open(tmp_path / train_lib.EVAL_FINAL_JSON) as f:
    final = json.load(f)
  assert final['loss'] == evals[0]['eval/loss'] == result.eval['loss']
  assert final['bits_per_byte'] == pytest.approx(final['loss'] / math.log(2))
  assert final['loss'] < first - 1.5
  assert final['num_batches'] == config.train.max_eval_batches
  assert (
    final['num_tokens'] > 0.9 * final['num_batches'] * 8 * 32
  )  # weights: document bytes
  assert os.listdir(tmp_path / 'tensorboard')
  assert _checkpoint_entries(tmp_path) == ['20', '30']  # every 10, keep 2
  # restore_model rebuilds the model from config.json and the last checkpoint.
  model, saved_config, step = checkpointing.restore_model(str(tmp_path))
  assert step == 30 and saved_config.model == config.model
  _assert_trees_equal(nnx.to_pure_dict(nnx.state(model)), result.state.params)
  assert checkpointing.restore_model(str(tmp_path), step=20)[2] == 20
  with pytest.raises(FileNotFoundError, match='steps: \\[20, 30\\]'):
    checkpointing.restore_model(str(tmp_path), step=10)


def _mock_lm1b(data_dir):
  """Metadata of a prepared array_record lm1b, so mock_data can stand in for it."""
  builder = tfds.builder('lm1b', data_dir=data_dir, file_format='array_record')
  builder.info.set_splits(
    tfds.core.SplitDict(
      [
        tfds.core.SplitInfo(
          name=split, shard_lengths=[64], num_bytes=0, filename_template=None
        )
        for split in ('train', 'test')
      ]
    )
  )
  builder.data_path.mkdir(parents=True)
  builder.info.write_to_directory(builder.data_path)


def test_trains_on_mock_catalog_dataset_with_restore(tmp_path):
  data_dir = str(tmp_path / 'tfds')
  _mock_lm1b(data_dir)
  config = default_config.get_config('tiny')
  config.data.update(name='lm1b', eval_split='test', tfds_data_dir=data_dir)
  config.train.update(num_steps=12, log_every=2, checkpoint_every=6)
  workdir = str(tmp_path / 'work')
  with tfds.testing.mock_data(
    num_examples=64, policy=tfds.testing.MockPolicy.USE_FILES, data_dir=data_dir
  ):
    stopped = loop_lib.train_and_evaluate(config, workdir, max_steps=6)
    assert stopped.step == 6 and stopped.eval is None
    result = loop_lib.train_and_evaluate(config, workdir)  # resumes at 6
  records = _train_records(workdir)
  assert [r['step'] for r in records] == [2, 4, 6, 8, 10, 12]
  assert records[-1]['train/loss'] < records[0]['train/loss'] - 0.5
  assert math.isfinite(result.eval['loss']) and result.eval['num_tokens'] > 0
  assert _checkpoint_entries(workdir) == ['12', '6']


# -- resumption -----------------------------------------------------------------------

N = 4  # resume tests: 2N steps, checkpoint every N


@pytest.fixture(scope='module')
def uninterrupted(tfds_dir, tmp_path_factory):
  """(config, workdir, result) of a 2N-step run that was never interrupted."""
  config = tiny_run_config(
    tfds_dir, num_steps=2 * N, checkpoint_every=N, log_every=1, warmup_steps=2
  )
  workdir = str(tmp_path_factory.mktemp('uninterrupted'))
  return config, workdir, loop_lib.train_and_evaluate(config, workdir)


def _assert_same_run(reference, workdir, result):
  _, ref_workdir, ref_result = reference
  ref_records, records = _train_records(ref_workdir), _train_records(workdir)
  assert [r['step'] for r in records] == list(range(1, 2 * N + 1))
  assert [r['train/loss'] for r in records] == [
    r['train/loss'] for r in ref_records
  ]  # exactly
  assert [r['train/grad_norm'] for r in records] == [
    r['train/grad_norm'] for r in ref_records
  ]
  _assert_trees_equal(result.state.params, ref_result.state.params)
  _assert_trees_equal(result.state.opt_state, ref_result.state.opt_state)
  assert result.eval == ref_result.eval
  model, _, step = checkpointing.restore_model(workdir)
  assert step == 2 * N
  _assert_trees_equal(nnx.to_pure_dict(nnx.state(model)), ref_result.state.params)


def test_resume_equals_uninterrupted_bitwise(uninterrupted, tmp_path):
  config = uninterrupted[0]
  stopped = loop_lib.train_and_evaluate(config, str(tmp_path), max_steps=N)
  assert stopped.step == N and _checkpoint_entries(tmp_path) == [str(N)]
  # As if killed before TensorBoard's writer flushed its last steps: a truncated file.
  (event_file,) = glob.glob(str(tmp_path / 'tensorboard' / 'events.*'))
  os.truncate(event_file, os.path.getsize(event_file) // 2)
  assert _tensorboard_steps(tmp_path)[-1] < N
  result = loop_lib.train_and_evaluate(config, str(tmp_path))
  _assert_same_run(uninterrupted, str(tmp_path), result)
  # The lost steps are re-written from metrics.jsonl, each step once.
  for tag, values in metrics_lib.read_tensorboard(str(tmp_path)).items():
    records = [r for r in metrics_lib.read_jsonl(tmp_path) if tag in r]
    assert values == [(r['step'], pytest.approx(r[tag])) for r in records], tag


def test_run_killed_during_save_resumes_from_previous_checkpoint(
  uninterrupted, tmp_path, monkeypatch
):
  config = uninterrupted[0]
  save = grain.checkpoint.CheckpointHandler.save
  calls = []

  def dies_on_second_save(self, directory, *args, **kwargs):
    calls.append(directory)
    if len(calls) == 2:  # the save of step 2N, after the other items started writing
      raise KeyboardInterrupt('simulated kill during the save')
    return save(self, directory, *args, **kwargs)

  monkeypatch.setattr(grain.checkpoint.CheckpointHandler, 'save', dies_on_second_save)
  with pytest.raises(KeyboardInterrupt, match='simulated kill'):
    loop_lib.train_and_evaluate(config, str(tmp_path))
  monkeypatch.setattr(grain.checkpoint.CheckpointHandler, 'save', save)

  entries = _checkpoint_entries(tmp_path)
  assert str(N) in entries and str(2 * N) not in entries
  assert any(e.startswith(f'{2 * N}.') and 'tmp' in e for e in entries), entries
  assert (
    checkpointing.restore_model(str(tmp_path))[2] == N
  )  # the unfinished one is ignored
  # The dead segment logged steps 1..2N to TensorBoard; the resumed one re-logs N+1..2N.
  assert _tensorboard_steps(tmp_path) == list(range(1, 2 * N + 1))
  result = loop_lib.train_and_evaluate(config, str(tmp_path))  # resumes from N
  assert _checkpoint_entries(tmp_path) == [str(N), str(2 * N)]  # tmp dir cleaned up
  _assert_same_run(uninterrupted, str(tmp_path), result)
  assert _tensorboard_steps(tmp_path) == list(range(1, 2 * N + 1))  # each step once
  assert len(glob.glob(str(tmp_path / 'tensorboard' / 'events.*'))) == 2  # 2 segments


def _copy_run(uninterrupted, tmp_path) -> str:
  """A copy of the uninterrupted run's workdir (checkpoints N and 2N, metrics 1..2N)."""
  workdir = str(tmp_path / 'run')
  shutil.copytree(uninterrupted[1], workdir)
  return workdir


def _params_chunk(workdir, step) -> str:
  """The largest parameter data file of checkpoint `step`."""
  files = glob.glob(
    os.path.join(
      checkpointing.checkpoint_dir(workdir),
      str(step),
      'params',
      'ocdbt.process_0',
      'd',
      '*',
    )
  )
  return max(files, key=os.path.getsize)


def _corrupt(workdir, step, how):
  if how == 'truncated_chunk':
    path = _params_chunk(workdir, step)
    os.truncate(path, os.path.getsize(path) // 2)
  elif how == 'zeroed_chunk':
    path = _params_chunk(workdir, step)
    with open(path, 'r+b') as f:
      f.write(bytes(os.path.getsize(path)))
  elif how == 'flipped_bytes':  # decodes fine: only the checksum can tell
    path = _params_chunk(workdir, step)
    with open(path, 'r+b') as f:
      f.seek(os.path.getsize(path) // 2)
      data = f.read(64)
      f.seek(os.path.getsize(path) // 2)
      f.write(bytes(b ^ 0xFF for b in data))
  elif how == 'no_iterator_state':
    os.remove(
      os.path.join(
        checkpointing.checkpoint_dir(workdir), str(step), 'data', 'process_0-of-1.json'
      )
    )


@pytest.mark.parametrize(
  'how', ['truncated_chunk', 'zeroed_chunk', 'flipped_bytes', 'no_iterator_state']
)
def test_corrupt_latest_checkpoint_falls_back_to_previous(
  uninterrupted, tmp_path, capsys, how
):
  config = uninterrupted[0]
  workdir = _copy_run(uninterrupted, tmp_path)
  _corrupt(workdir, 2 * N, how)

  # max_steps=N: restore only (the resumed run is checked to the end below).
  result = loop_lib.train_and_evaluate(config, workdir, max_steps=N)

  out = capsys.readouterr().out
  assert (
    f'checkpoint of step {2 * N} in {checkpointing.checkpoint_dir(workdir)} does '
    'not restore (' in out
  )
  assert f'Resuming from the checkpoint of step {N}' in out
  moved = os.path.join(workdir, checkpointing.CORRUPT, str(2 * N))
  assert f'Moved the unreadable checkpoint of step {2 * N} to {moved}' in out
  assert os.path.isdir(moved)  # kept for inspection, not deleted
  assert _checkpoint_entries(workdir) == [str(N)]
  assert result.step == N
  model, _, _ = checkpointing.restore_model(workdir, step=N)
  _assert_trees_equal(result.state.params, nnx.to_pure_dict(nnx.state(model)))
  assert max(r['step'] for r in metrics_lib.read_jsonl(workdir)) == N


def test_run_resumed_past_a_corrupt_checkpoint_equals_uninterrupted(
  uninterrupted, tmp_path
):
  config = uninterrupted[0]
  workdir = _copy_run(uninterrupted, tmp_path)
  _corrupt(workdir, 2 * N, 'truncated_chunk')
  result = loop_lib.train_and_evaluate(config, workdir)  # from N, as if 2N never was
  assert _checkpoint_entries(workdir) == [str(N), str(2 * N)]  # 2N saved afresh
  _assert_same_run(uninterrupted, workdir, result)
  assert _tensorboard_steps(workdir) == list(range(1, 2 * N + 1))


def test_evaluation_falls_back_past_a_damaged_or_deleted_checkpoint(
  uninterrupted, tmp_path, capfd
):
  """eval.py's way to the newest checkpoint that restores; it tells damage from a
  checkpoint deleted while it was read (by a running training's `keep_checkpoints`)."""
  workdir = _copy_run(uninterrupted, tmp_path)
  _corrupt(workdir, 2 * N, 'flipped_bytes')
  restore = functools.partial(checkpointing.restore_model, workdir)
  _, _, step = checkpointing.newest_that_restores(workdir, [N, 2 * N], restore)
  assert step == N
  output = capfd.readouterr()
  assert (
    f'WARNING: the checkpoint of step {2 * N} does not restore (ChecksumError: '
    f'the params of checkpoint {2 * N} do not match their checksum'
  ) in output.out
  assert 'read only' not in output.err  # orbax's notice on every read-only manager

  def deleted_while_read(step):
    if step == 2 * N:
      shutil.rmtree(os.path.join(checkpointing.checkpoint_dir(workdir), str(step)))
    return restore(step)

  _, _, step = checkpointing.newest_that_restores(workdir, [N, 2 * N], deleted_while_read)
  assert step == N
  assert (
    f'WARNING: the checkpoint of step {2 * N} was deleted while it was read'
    in capfd.readouterr().out
  )


def test_no_restorable_checkpoint_is_a_clear_error(uninterrupted, tmp_path):
  config = uninterrupted[0]
  workdir = _copy_run(uninterrupted, tmp_path)
  _corrupt(workdir, N, 'zeroed_chunk')
  _corrupt(workdir, 2 * N, 'no_iterator_state')
  with pytest.raises(
    checkpointing.CheckpointRestoreError,
    match=f'(?s)No checkpoint in {checkpointing.checkpoint_dir(workdir)} '
    f'restores:\n  step {2 * N}: .*process_0-of-1.json.*\n'
    f'  step {N}: .*Nothing was moved',
  ):
    loop_lib.train_and_evaluate(config, workdir)
  assert _checkpoint_entries(workdir) == [str(N), str(2 * N)]
  with pytest.raises(
    checkpointing.CheckpointRestoreError,
    match=f'The checkpoint of step {N} in .* does not restore '
    f'\\(ValueError: .*\\); other steps: \\[{2 * N}\\]',
  ):
    checkpointing.restore_model(workdir, step=N)  # eval.py's way in


@pytest.mark.parametrize(
  'field, value',
  [
    ('train.seq_len', 64),  # data pipeline
    ('train.batch_size', 4),  # batch
    ('train.num_steps', 3 * N),  # schedule
    ('train.learning_rate', 5e-3),  # schedule
    ('train.b2', 0.99),  # optimizer
    ('train.seed', 1),  # data order
    ('data.shuffle_window', 16),  # data
    ('train.max_eval_batches', 2),  # what the eval numbers mean
  ],
)
def test_resume_with_a_changed_run_config_is_refused(
  uninterrupted, no_compilation, field, value
):
  config, workdir, _ = uninterrupted
  other = config.copy_and_resolve_references()
  section, name = field.split('.')
  old = other[section][name]
  other[section][name] = value
  with pytest.raises(
    ValueError, match='holds checkpoints of a run with another config'
  ) as error:
    loop_lib.train_and_evaluate(other, workdir)
  assert f'\n  {field}: {old!r} -> {value!r}\n' in str(error.value)  # the only change
  assert f'--allow_config_change={field} ' in str(error.value)
  assert checkpointing.load_config(workdir).train == config.train  # not overwritten


def test_misspelt_allowed_field_is_an_error(uninterrupted, no_compilation):
  config, workdir, _ = uninterrupted
  with pytest.raises(ValueError, match="'num_step' matches no config field"):
    loop_lib.train_and_evaluate(config, workdir, allow_config_change=['num_step'])


def test_allowed_config_change_resumes_and_is_recorded(uninterrupted, tmp_path):
  config = uninterrupted[0]
  workdir = _copy_run(uninterrupted, tmp_path)
  longer = config.copy_and_resolve_references()
  longer.train.num_steps = 2 * N + 2
  longer.train.log_every = 2  # harmless: needs no flag, but is recorded too
  result = loop_lib.train_and_evaluate(longer, workdir, allow_config_change=['num_steps'])
  assert result.step == 2 * N + 2
  assert checkpointing.load_config(workdir).train.num_steps == 2 * N + 2  # current
  with open(os.path.join(workdir, workdir_lib.CONFIG_HISTORY)) as f:
    (entry,) = [json.loads(line) for line in f]
  assert entry['latest_checkpoint'] == 2 * N
  assert entry['changes'] == {
    'train.num_steps': {'old': 2 * N, 'new': 2 * N + 2},
    'train.log_every': {'old': 1, 'new': 2},
  }
  assert entry['previous_config']['train'] == config.train.to_dict()  # kept whole


def test_failed_attempt_leaves_the_run_record_and_a_fresh_workdir_as_they_were(
  uninterrupted, tmp_path, monkeypatch
):
  """config.json and config_history.jsonl are written with a segment's first
  checkpoint: an attempt that fails before it (here: at compilation) leaves them, so
  the original command still resumes; a workdir the attempt created is removed."""
  config = uninterrupted[0]
  workdir = _copy_run(uninterrupted, tmp_path)
  with open(os.path.join(workdir, checkpointing.CONFIG_JSON)) as f:
    record = f.read()
  events = sorted(os.listdir(os.path.join(workdir, metrics_lib.TENSORBOARD)))
  changed = config.copy_and_resolve_references()
  changed.train.learning_rate = 5e-3

  def fails_to_compile(*args, **kwargs):
    raise RuntimeError('simulated compile failure')

  monkeypatch.setattr(train_lib, 'jit_train_step', fails_to_compile)
  with pytest.raises(RuntimeError, match='simulated compile failure'):
    loop_lib.train_and_evaluate(changed, workdir, allow_config_change=['learning_rate'])
  with open(os.path.join(workdir, checkpointing.CONFIG_JSON)) as f:
    assert f.read() == record
  assert not os.path.exists(os.path.join(workdir, workdir_lib.CONFIG_HISTORY))
  assert sorted(os.listdir(os.path.join(workdir, metrics_lib.TENSORBOARD))) == events
  workdir_lib.check_run_config(workdir, config)  # the original command is accepted

  fresh = tmp_path / 'fresh'
  with pytest.raises(RuntimeError, match='simulated compile failure'):
    loop_lib.train_and_evaluate(config, str(fresh))
  assert not fresh.exists()  # no config.json, lock or empty directories left behind


def test_resume_with_a_different_model_is_refused(uninterrupted, no_compilation):
  config, workdir, _ = uninterrupted
  other = config.copy_and_resolve_references()
  other.model.d_model = 64
  with pytest.raises(ValueError, match=r"different model \(fields \['d_model'\]"):
    loop_lib.train_and_evaluate(other, workdir)


def test_eval_cli_failure_leaves_no_empty_output_directory(uninterrupted, tmp_path):
  """eval.py on a run none of whose checkpoints restores: one FATAL line, exit 1, and
  no empty eval/step_N/ left behind."""
  workdir = _copy_run(uninterrupted, tmp_path)
  _corrupt(workdir, N, 'flipped_bytes')
  _corrupt(workdir, 2 * N, 'flipped_bytes')
  done = subprocess.run(
    [sys.executable, 'eval.py', f'--workdir={workdir}'],
    cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
    env=child_env(1),
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert done.returncode == 1, done.stderr
  assert (
    f'WARNING: the checkpoint of step {2 * N} does not restore (ChecksumError'
    in done.stdout
  )
  (line,) = [l for l in done.stderr.splitlines() if l.strip()]
  assert (
    line.startswith(f'FATAL: The checkpoint of step {N} in ') and 'ChecksumError' in line
  )
  assert not os.path.exists(os.path.join(workdir, 'eval'))


def _eval_prompt(workdir, prompt: str, log) -> tuple[int, str, int]:
  """Runs eval.py --prompt; (exit code, its output, its own peak memory in bytes)."""
  with open(log, 'w') as out:
    child = subprocess.Popen(
      [
        sys.executable,
        'eval.py',
        f'--workdir={workdir}',
        f'--prompt={prompt}',
        '--max_new_tokens=4',
        '--temperature=0',
      ],
      cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
      env=child_env(1),
      stdout=out,
      stderr=subprocess.STDOUT,
    )
  timer = threading.Timer(300, child.kill)  # a hang fails below, not forever
  timer.start()
  try:
    _, status, usage = os.wait4(child.pid, 0)  # this child's own peak memory
  finally:
    timer.cancel()
  child.returncode = os.waitstatus_to_exitcode(status)  # reaped: Popen must not wait
  return child.returncode, log.read_text(), usage.ru_maxrss * 1024  # ru_maxrss: KiB


def test_eval_cli_reads_a_prompt_longer_than_the_trained_length_in_chunks(
  uninterrupted, tmp_path
):
  """eval.py --prompt far past the trained length (a 42,000-byte prompt once died out
  of memory in one prefill): a warning naming the trained length, the prompt read in
  chunks of it, a continuation, and less memory than one layer's attention scores of
  a one-shot prefill would take. (12,000 bytes: chunks still attend over the whole
  cache, so the compute grows with the square of the length.)"""
  config, workdir, _ = uninterrupted
  trained, length = config.train.seq_len, 12_000
  prompt = ('ROMEO: ' * length)[:length]
  code, output, peak = _eval_prompt(workdir, prompt, tmp_path / 'long.log')
  assert code == 0, output[-3000:]
  assert (
    f'WARNING: prompt and continuation reach {length + 4} tokens, past the {trained} '
    'the model was trained on (train.seq_len): positions beyond it were never seen. '
    f'The prompt is read in chunks of {trained} tokens'
  ) in output
  assert f'[step {2 * N}, temperature 0.0, top_k None, seed 0]\n{prompt}' in output
  assert 'Traceback' not in output and 'read only' not in output  # no orbax notice
  # A one-shot prefill holds at least one layer's float32 scores at once on top of
  # what the process needs anyway (JAX, TFDS, orbax: about 1 GB of its own, measured
  # by the same command with a short prompt); read in chunks, the long prompt adds
  # far less than that.
  code, output, baseline = _eval_prompt(workdir, 'ROMEO:', tmp_path / 'short.log')
  assert code == 0, output[-3000:]
  one_shot_scores = config.model.num_heads * length**2 * 4
  assert peak - baseline < one_shot_scores, (peak, baseline)
