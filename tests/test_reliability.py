"""Hostile probes of a training run, against real processes where it matters: the
workdir lock (a live holder, kill -9, a holder on another host), SIGTERM and SIGINT, a
disk that fills up between saves, config errors on the command line."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import jax
import numpy as np
import pytest

from attnres_jax import checkpointing
from attnres_jax import metrics as metrics_lib
from attnres_jax import preemption
from attnres_jax import train as train_lib
from attnres_jax import workdir as workdir_lib
from configs import default as default_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _wait_for(condition, process, log, timeout=300):
  """Waits until `condition()` holds (polling: it is set by another process)."""
  deadline = time.monotonic() + timeout
  while not condition():
    if process.poll() is not None:
      raise AssertionError(
        f'The process exited ({process.returncode}):\n{log.read_text()}'
      )
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
    with pytest.raises(
      workdir_lib.WorkdirLockedError,
      match=f'in use by pid {os.getpid()} on host '
      f'{socket.gethostname()} \\(first, started ',
    ):
      workdir_lib.WorkdirLock(workdir, 'second')
  with workdir_lib.WorkdirLock(workdir, 'third') as lock:
    assert not lock.messages  # a clean release leaves no stale record


def _remote_record(**fields):
  """A lock record of a holder on another host (whose flock would not reach here)."""
  return dict(pid=1234, host='elsewhere', started='?', purpose='train', **fields)


def test_lock_record_of_another_host_without_a_lease_is_refused(tmp_path):
  with open(tmp_path / workdir_lib.LOCK_FILE, 'w') as f:
    json.dump(_remote_record(), f)
  with pytest.raises(
    workdir_lib.WorkdirLockedError,
    match='in use by pid 1234 on host elsewhere .* no lease.* delete .*workdir.lock',
  ):
    workdir_lib.WorkdirLock(str(tmp_path), 'train')


def test_expired_lease_of_another_host_is_taken_over(tmp_path):
  """A preempted VM's job left its record; its successor on a new host takes over."""
  with open(tmp_path / workdir_lib.LOCK_FILE, 'w') as f:
    json.dump(_remote_record(renewed=time.time() - 1.0, lease_seconds=0.5), f)
  with workdir_lib.WorkdirLock(str(tmp_path), 'train') as lock:
    (message,) = lock.messages
    assert message.startswith(
      'Taking over the lock of pid 1234 on host elsewhere '
      '(train, started ?): its lease expired '
    )
    record = json.loads((tmp_path / workdir_lib.LOCK_FILE).read_text())
    assert record['host'] == socket.gethostname() and record['pid'] == os.getpid()


def test_live_lease_of_another_host_is_refused_after_waiting(tmp_path):
  """A live holder elsewhere renews its record; waiting for its lease sees that."""
  path = tmp_path / workdir_lib.LOCK_FILE
  lease = 2.0
  path.write_text(json.dumps(_remote_record(renewed=time.time(), lease_seconds=lease)))
  stop = threading.Event()

  def renew():  # as the remote holder's renewal thread does, every lease / 4
    while not stop.wait(lease / 4):
      path.write_text(
        json.dumps(_remote_record(renewed=time.time(), lease_seconds=lease))
      )

  renewer = threading.Thread(target=renew)
  renewer.start()
  try:
    start = time.monotonic()
    with pytest.raises(
      workdir_lib.WorkdirLockedError,
      match='in use by pid 1234 on host elsewhere .* renews its lease',
    ):
      workdir_lib.WorkdirLock(str(tmp_path), 'train')
    assert time.monotonic() - start < lease  # refused at the first renewal seen
  finally:
    stop.set()
    renewer.join()


def test_holder_renews_its_lease(tmp_path):
  path = tmp_path / workdir_lib.LOCK_FILE
  with workdir_lib.WorkdirLock(str(tmp_path), 'train', lease_seconds=0.4):
    first = json.loads(path.read_text())['renewed']
    time.sleep(0.5)
    assert json.loads(path.read_text())['renewed'] > first
  assert path.read_text() == ''  # released: no record left


def test_concurrent_run_refused_and_kill_9_before_first_checkpoint(tmp_path, capsys):
  """A live `train.py` holds its workdir; after kill -9 (before any checkpoint) a rerun
  takes the lock over and logs every step exactly once, in metrics.jsonl and in
  TensorBoard."""
  workdir = str(tmp_path / 'run')
  tfds_dir = str(tmp_path / 'tfds')
  command = [
    sys.executable,
    'train.py',
    '--config=configs/default.py:tiny',
    f'--workdir={workdir}',
    f'--config.data.tfds_data_dir={tfds_dir}',
    '--config.train.log_every=1',
    '--config.train.warmup_steps=1',
    '--config.train.num_steps=100000',
    '--config.train.checkpoint_every=100000',
  ]
  log = tmp_path / 'first.log'
  with open(log, 'w') as out:
    first = subprocess.Popen(command, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
  try:
    # Until TensorBoard holds steps too (its writer flushes when its buffer fills).
    _wait_for(
      lambda: (
        len(metrics_lib.read_jsonl(workdir)) >= 25
        and len(metrics_lib.read_tensorboard(workdir).get('train/loss', ())) >= 10
      ),
      first,
      log,
    )
    second = subprocess.run(
      command, cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert second.returncode == 1
    assert (
      f'FATAL: Workdir {workdir!r} is in use by pid {first.pid} on host '
      f'{socket.gethostname()} (train, started '
    ) in second.stderr
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
  assert [
    v for _, v in metrics_lib.read_tensorboard(workdir)['train/loss']
  ] == pytest.approx([r['train/loss'] for r in records if 'train/loss' in r])


def test_unknown_config_field_on_the_command_line(tmp_path):
  result = subprocess.run(
    [
      sys.executable,
      'train.py',
      '--config=configs/default.py:tiny',
      '--config.model.nope=1',
      f'--workdir={tmp_path}',
    ],
    cwd=REPO,
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert result.returncode == 1
  assert (
    "Flags parsing error: unknown config field 'model.nope' in "
    "'--config.model.nope=1'. The fields of model are: "
  ) in result.stderr
  assert 'Traceback' not in result.stderr


def _tiny(tfds_dir, **train):
  config = default_config.get_config('tiny')
  config.data.tfds_data_dir = tfds_dir
  config.train.update(train)
  return config


def test_sigterm_saves_the_step_in_flight_and_sigint_too_then_resume_is_exact(
  tfds_dir, tmp_path, capsys
):
  """SIGTERM to a real train.py: the step in flight is saved, one line, exit 143; the
  rerun resumes there. SIGINT (sent in-process, at a known step) does the same with
  130. The run resumed twice equals a run never interrupted, bitwise."""
  workdir = str(tmp_path / 'run')
  train = dict(num_steps=1000, checkpoint_every=1000, log_every=1, warmup_steps=1)
  command = [
    sys.executable,
    'train.py',
    '--config=configs/default.py:tiny',
    f'--workdir={workdir}',
    f'--config.data.tfds_data_dir={tfds_dir}',
    *(f'--config.train.{k}={v}' for k, v in train.items()),
  ]
  log = tmp_path / 'train.log'
  with open(log, 'w') as out:
    process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.DEVNULL, stderr=out)
  try:
    _wait_for(lambda: len(metrics_lib.read_jsonl(workdir)) >= 3, process, log)
    process.send_signal(signal.SIGTERM)
    process.wait(timeout=120)
  finally:
    process.kill()
  assert process.returncode == 128 + signal.SIGTERM == 143
  logged = [r['step'] for r in metrics_lib.read_jsonl(workdir)]
  saved = max(logged)  # no step it trained and logged is lost
  stderr = log.read_text()
  assert (
    f'Stopped by SIGTERM after step {saved}: its checkpoint is saved in '
    f'{checkpointing.checkpoint_dir(workdir)}; run the same command to resume.'
    in stderr.splitlines()
  ), stderr
  assert 'Traceback' not in stderr and 'FATAL' not in stderr
  assert sorted(os.listdir(checkpointing.checkpoint_dir(workdir))) == [str(saved)]
  assert (tmp_path / 'run' / workdir_lib.LOCK_FILE).read_text() == ''  # released
  assert (tmp_path / 'run' / checkpointing.CONFIG_JSON).exists()

  config = _tiny(tfds_dir, **train)
  previous = signal.getsignal(signal.SIGINT)

  def interrupt(step, record):
    if step == saved + 1 and 'train/loss' in record:
      os.kill(os.getpid(), signal.SIGINT)  # as Ctrl-C does

  with pytest.raises(preemption.Preempted) as stopped:
    train_lib.train_and_evaluate(config, workdir, on_metrics=interrupt)
  assert capsys.readouterr().out.count(f'Resuming from the checkpoint of step {saved}')
  # Step s's metrics are read after step s + 1 is dispatched: s + 1 was in flight.
  assert stopped.value.exit_code == 130 and stopped.value.step == saved + 2
  assert str(stopped.value).startswith(f'Stopped by SIGINT after step {saved + 2}: ')
  assert sorted(map(int, os.listdir(checkpointing.checkpoint_dir(workdir)))) == [
    saved,
    saved + 2,
  ]
  assert signal.getsignal(signal.SIGINT) is previous  # handlers restored

  stop = saved + 4
  resumed = train_lib.train_and_evaluate(config, workdir, max_steps=stop)
  reference_dir = str(tmp_path / 'reference')
  reference = train_lib.train_and_evaluate(config, reference_dir, max_steps=stop)
  jax.tree.map(
    np.testing.assert_array_equal,
    jax.device_get(resumed.state.params),
    jax.device_get(reference.state.params),
  )
  losses = lambda w: [(r['step'], r['train/loss']) for r in metrics_lib.read_jsonl(w)]
  assert losses(workdir) == losses(reference_dir)  # every step once, the same values


@pytest.fixture
def small_filesystem(tmp_path):
  """A 16 MiB tmpfs (mounting needs root; skipped elsewhere)."""
  mount = tmp_path / 'small_fs'
  mount.mkdir()
  done = subprocess.run(
    ['mount', '-t', 'tmpfs', '-o', 'size=16m', 'tmpfs', str(mount)],
    capture_output=True,
    text=True,
    check=False,
  )
  if done.returncode:
    pytest.skip(f'cannot mount a tmpfs here: {done.stderr.strip()}')
  try:
    yield mount
  finally:
    subprocess.run(['umount', '-l', str(mount)], check=False)


def _fill(directory) -> None:
  """Writes zeros into `directory` until its file system is full."""
  with open(os.path.join(directory, 'filler'), 'wb', buffering=0) as f:
    try:
      while True:
        f.write(bytes(1 << 16))
    except OSError as e:
      assert e.errno == 28  # ENOSPC


def test_disk_full_between_saves_stops_with_one_line(
  tfds_dir, small_filesystem, tmp_path
):
  """The disk fills up after the first checkpoint: whichever writer meets it first
  (metrics, TensorBoard, the background save), the run stops within seconds with one
  FATAL line naming the cause and the last good checkpoint; nothing hangs."""
  workdir = str(small_filesystem / 'run')
  command = [
    sys.executable,
    'train.py',
    '--config=configs/default.py:tiny',
    f'--workdir={workdir}',
    f'--config.data.tfds_data_dir={tfds_dir}',
    '--config.train.num_steps=100000',
    '--config.train.checkpoint_every=4',
    '--config.train.log_every=1',
    '--config.train.warmup_steps=1',
  ]
  log = tmp_path / 'train.log'
  with open(log, 'w') as out:
    process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.DEVNULL, stderr=out)
  try:
    ckpt_dir = checkpointing.checkpoint_dir(workdir)
    _wait_for(
      lambda: (
        os.path.isdir(ckpt_dir) and any(name.isdigit() for name in os.listdir(ckpt_dir))
      ),
      process,
      log,
    )
    _fill(small_filesystem)
    filled = time.monotonic()
    process.wait(timeout=120)  # a hang fails here
    seconds = time.monotonic() - filled
  finally:
    process.kill()
  stderr = log.read_text()
  assert process.returncode == 1, stderr
  fatal = [line for line in stderr.splitlines() if line.startswith('FATAL')]
  assert len(fatal) == 1, stderr
  assert (
    'No space left on device' in fatal[0] and 'last good checkpoint is step ' in fatal[0]
  ), fatal[0]
  assert 'Traceback' not in stderr, stderr
  print(f'stopped {seconds:.1f} s after the disk filled: {fatal[0]}')
  assert seconds < 60  # seconds, not a hang (generous: 2 shared cores)


def test_config_error_is_one_line_and_debug_shows_the_traceback(tmp_path):
  command = [
    sys.executable,
    'train.py',
    '--config=configs/default.py:tiny',
    '--config.train.num_steps=0',
    f'--workdir={tmp_path / "work"}',
  ]
  plain = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
  assert plain.returncode == 1
  (line,) = plain.stderr.strip().splitlines()  # one line, naming the field
  assert line.startswith('FATAL: ') and 'num_steps must be a positive integer' in line
  debug = subprocess.run(
    command + ['--debug'], cwd=REPO, capture_output=True, text=True, timeout=300
  )
  assert debug.returncode == 1
  assert 'Traceback (most recent call last)' in debug.stderr
  assert debug.stderr.strip().splitlines()[-1] == line
  assert not (tmp_path / 'work').exists()


def test_sigterm_to_one_of_two_processes_stops_both_after_the_same_step(
  tfds_dir, tmp_path
):
  """Two train.py processes (jax.distributed on localhost, 2 x 2 CPU devices); a
  SIGTERM to process 1 alone, as a preemption notice reaches one host: both stop after
  the same step (JAX's preemption sync point), save it together and exit 143."""
  # A test module (its children's environment), imported only by this test.
  from test_multiprocess import _child_env, _free_port  # pylint: disable=g-import-not-at-top

  workdir = str(tmp_path / 'run')
  port = _free_port()
  logs = [tmp_path / f'process_{i}.log' for i in range(2)]
  processes = []
  for i, log in enumerate(logs):
    with open(log, 'w') as out:
      processes.append(
        subprocess.Popen(
          [
            sys.executable,
            'train.py',
            '--config=configs/default.py:tiny',
            f'--workdir={workdir}',
            f'--config.data.tfds_data_dir={tfds_dir}',
            f'--coordinator_address=localhost:{port}',
            '--num_processes=2',
            f'--process_id={i}',
            '--config.train.num_steps=1000',
            '--config.train.checkpoint_every=1000',
            '--config.train.log_every=1',
            '--config.train.warmup_steps=1',
            '--config.mesh.shape=(4,1,1)',
          ],
          cwd=REPO,
          env=_child_env(2),
          stdout=subprocess.DEVNULL,
          stderr=out,
        )
      )
  try:
    _wait_for(lambda: len(metrics_lib.read_jsonl(workdir)) >= 3, processes[0], logs[0])
    processes[1].send_signal(signal.SIGTERM)
    for process in processes:
      process.wait(timeout=180)
  finally:
    for process in processes:
      process.kill()
  outputs = [log.read_text() for log in logs]
  assert [p.returncode for p in processes] == [143, 143], outputs
  (saved,) = os.listdir(checkpointing.checkpoint_dir(workdir))
  for output in outputs:
    assert f'Stopped by SIGTERM after step {saved}: ' in output, output
  assert max(r['step'] for r in metrics_lib.read_jsonl(workdir)) == int(saved)
  data_dir = os.path.join(checkpointing.checkpoint_dir(workdir), saved, 'data')
  assert sorted(n for n in os.listdir(data_dir) if n.startswith('process_')) == [
    'process_0-of-2.json',
    'process_1-of-2.json',
  ]
