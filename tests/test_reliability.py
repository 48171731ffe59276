"""The workdir lock, against real processes: a live holder, a holder killed with -9."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from attnres_jax import metrics as metrics_lib
from attnres_jax import train as train_lib
from attnres_jax import workdir as workdir_lib
from configs import default as default_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _wait_for(condition, process, log, timeout=300):
  """Waits until `condition()` holds (polling: it is set by another process)."""
  deadline = time.monotonic() + timeout
  while not condition():
    if process.poll() is not None:
      raise AssertionError(f'The process exited ({process.returncode}):\n{log.read_text()}')
    if time.monotonic() > deadline:
      raise AssertionError(f'Timed out; the process wrote:\n{log.read_text()}')
    time.sleep(0.05)


def test_lock_is_exclusive_released_and_recorded(tmp_path):
  workdir = str(tmp_path)
  with workdir_lib.WorkdirLock(workdir, 'first') as lock:
    assert not lock.messages
    record = json.loads(open(os.path.join(workdir, workdir_lib.LOCK_FILE)).read())
    assert record['pid'] == os.getpid() and record['host'] == socket.gethostname()
    assert record['purpose'] == 'first'
    # flock is per open file: a second lock in this very process is refused too.
    with pytest.raises(workdir_lib.WorkdirLockedError,
                       match=f'in use by pid {os.getpid()} on host '
                             f'{socket.gethostname()} \\(first, started '):
      workdir_lib.WorkdirLock(workdir, 'second')
  with workdir_lib.WorkdirLock(workdir, 'third') as lock:
    assert not lock.messages  # a clean release leaves no stale record


def test_stale_lock_of_another_host_is_refused(tmp_path):
  with open(tmp_path / workdir_lib.LOCK_FILE, 'w') as f:
    json.dump({'pid': 1234, 'host': 'elsewhere', 'started': '?', 'purpose': 'train'}, f)
  with pytest.raises(workdir_lib.WorkdirLockedError,
                     match='locked by pid 1234 on host elsewhere .* delete .*workdir.lock'):
    workdir_lib.WorkdirLock(str(tmp_path), 'train')


def test_concurrent_run_refused_and_kill_9_before_first_checkpoint(tmp_path, capsys):
  """A live `train.py` holds its workdir; after kill -9 (before any checkpoint) a rerun
  takes the lock over and logs every step exactly once, in metrics.jsonl and in
  TensorBoard."""
  workdir = str(tmp_path / 'run')
  tfds_dir = str(tmp_path / 'tfds')
  command = [sys.executable, 'train.py', '--config=configs/default.py:tiny', f'--workdir={workdir}',
             f'--config.data.tfds_data_dir={tfds_dir}', '--config.train.log_every=1',
             '--config.train.warmup_steps=1', '--config.train.num_steps=100000',
             '--config.train.checkpoint_every=100000']
  log = tmp_path / 'first.log'
  with open(log, 'w') as out:
    first = subprocess.Popen(command, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
  try:
    # Until TensorBoard holds steps too (its writer flushes when its buffer fills).
    _wait_for(lambda: len(metrics_lib.read_jsonl(workdir)) >= 25 and len(
        metrics_lib.read_tensorboard(workdir).get('train/loss', ())) >= 10, first, log)
    second = subprocess.run(command, cwd=REPO, capture_output=True, text=True,
                            timeout=300)
    assert second.returncode == 1
    assert (f'FATAL: Workdir {workdir!r} is in use by pid {first.pid} on host '
            f'{socket.gethostname()} (train, started ') in second.stderr
    assert 'Traceback' not in second.stderr
  finally:
    first.kill()  # SIGKILL: no clean-up runs
    first.wait()
  assert first.returncode == -signal.SIGKILL
  dead_steps = [r['step'] for r in metrics_lib.read_jsonl(workdir)]
  assert dead_steps == list(range(1, len(dead_steps) + 1))  # the second run wrote none
  assert len(metrics_lib.read_tensorboard(workdir)['train/loss']) >= 10

  config = default_config.get_config('tiny')
  config.data.tfds_data_dir = tfds_dir
  config.train.update(num_steps=6, checkpoint_every=3, log_every=1, warmup_steps=1)
  result = train_lib.train_and_evaluate(config, workdir)

  assert f'Taking over the stale lock of pid {first.pid}' in capsys.readouterr().out
  assert result.step == 6
  records = metrics_lib.read_jsonl(workdir)
  assert [r['step'] for r in records if 'train/loss' in r] == [1, 2, 3, 4, 5, 6]
  steps = [s for s, _ in metrics_lib.read_tensorboard(workdir)['train/loss']]
  assert steps == [1, 2, 3, 4, 5, 6]
  assert ([v for _, v in metrics_lib.read_tensorboard(workdir)['train/loss']]
          == pytest.approx([r['train/loss'] for r in records if 'train/loss' in r]))


def test_unknown_config_field_on_the_command_line(tmp_path):
  result = subprocess.run(
      [sys.executable, 'train.py', '--config=configs/default.py:tiny', '--config.model.nope=1',
       f'--workdir={tmp_path}'], cwd=REPO, capture_output=True, text=True, timeout=300)
  assert result.returncode == 1
  assert ("Flags parsing error: unknown config field 'model.nope' in "
          "'--config.model.nope=1'. The fields of model are: ") in result.stderr
  assert 'Traceback' not in result.stderr
