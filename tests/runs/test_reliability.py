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

from attnres_jax.runs import checkpointing
from attnres_jax.runs import lock as lock_lib
from attnres_jax.runs import metrics as metrics_lib
from attnres_jax.runs import preemption
from attnres_jax.training import loop as loop_lib
from attnres_jax.runs import workdir as workdir_lib

from conftest import cached_child_env, start_logged, tiny_run_command, endless_run_config

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


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


def test_a_renewal_never_leaves_the_tail_of_a_longer_record(tmp_path):
  # A renewal rewrites the record in place. Had it to shrink the file (a record one
  # character shorter, say), a reader between the write and the truncation would see
  # the new record followed by the old one's last bytes: every record is written at
  # one fixed size instead, and parses whatever was in the file before.
  path = tmp_path / workdir_lib.LOCK_FILE
  fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
  try:
    lock_lib._write_record(fd, {'purpose': 'x' * 100, 'renewed': 1796403412.4076381})
    size = path.stat().st_size
    shorter = {'purpose': 'train', 'renewed': 1796403412.5}
    lock_lib._write_record(fd, shorter)
    assert path.stat().st_size == size  # rewritten over the old bytes, not shrunk
    assert json.loads(path.read_bytes()) == shorter
    assert lock_lib.read_holder(fd) == shorter
  finally:
    os.close(fd)


def test_a_rerun_drops_what_a_killed_run_logged_after_its_checkpoint(tmp_path):
  """A run killed (kill -9) before its first checkpoint had logged steps 1..5, some
  flushed to TensorBoard; its rerun starts from step 0: metrics.jsonl and TensorBoard
  then show each step once, with the rerun's values. (After a checkpoint of step s,
  the same with s: the end-to-end test below.)"""
  workdir = str(tmp_path)
  dead = metrics_lib.MetricWriter(workdir)
  for step in range(1, 6):
    dead.write_scalars(step, {'train/loss': 10.0 + step})
  dead.flush()  # and never closed: killed
  with metrics_lib.MetricWriter(workdir, resume_step=0) as rerun:
    for step in range(1, 4):
      rerun.write_scalars(step, {'train/loss': float(step)})
  expected = [(1, 1.0), (2, 2.0), (3, 3.0)]
  records = metrics_lib.read_jsonl(workdir)
  assert [(r['step'], r['train/loss']) for r in records] == expected
  assert metrics_lib.read_tensorboard(workdir)['train/loss'] == expected


# -- real train.py processes -----------------------------------------------------------

# Every child trains the same program (the tiny model, this schedule), so that with the
# shared compilation cache below only the first one compiles it; checkpoint_every is
# host-side and may differ. Their numbers are compared bitwise with runs in this
# process: the children keep this process's XLA flags.


@pytest.fixture(scope='module')
def child_env(compilation_cache) -> dict[str, str]:  # pylint: disable=redefined-outer-name
  return cached_child_env(compilation_cache)


def _stop(process, signum, timeout=120) -> None:
  """Sends `signum` and waits for the process to exit (a hang fails here)."""
  try:
    process.send_signal(signum)
    process.wait(timeout=timeout)
  finally:
    process.kill()
    process.wait()


def test_stop_signal_catches_the_first_signal_and_restores_the_handlers():
  previous = signal.getsignal(signal.SIGINT)
  previous_term = signal.getsignal(signal.SIGTERM)
  with preemption.StopSignal() as stop:
    assert not stop.reached(1)
    os.kill(os.getpid(), signal.SIGINT)  # as Ctrl-C does
    assert stop.reached(2) and stop.signum == signal.SIGINT
    # A second signal acts as without the handler (here: KeyboardInterrupt).
    assert signal.getsignal(signal.SIGINT) is previous
  assert signal.getsignal(signal.SIGINT) is previous
  assert signal.getsignal(signal.SIGTERM) is previous_term


def test_sigterm_sigint_kill_9_then_resume_equals_a_straight_run(
  tfds_dir, child_env, tmp_path, capsys
):
  """One workdir, real train.py processes one after another, then a rerun here:
  1. SIGTERM: the step in flight is saved, one line, exit 143, the lock released.
  2. The same command resumes there; SIGINT (Ctrl-C) does the same, exit 130.
  3. The next run resumes from that and dies by kill -9 before its next checkpoint;
     while it runs, a second run on the workdir is refused in one line.
  4. A rerun here takes the dead run's lock over, drops what it logged after the
     checkpoint, and equals a run never interrupted, bitwise, with every step logged
     exactly once in metrics.jsonl and in TensorBoard."""
  workdir = str(tmp_path / 'run')
  ckpt_dir = checkpointing.checkpoint_dir(workdir)
  command = tiny_run_command(workdir, tfds_dir)
  steps = lambda: [r['step'] for r in metrics_lib.read_jsonl(workdir)] or [0]

  log = tmp_path / 'sigterm.log'
  process = start_logged(command, log, child_env)
  _wait_for(lambda: len(steps()) >= 3, process, log)
  _stop(process, signal.SIGTERM)
  output = log.read_text()
  assert process.returncode == 128 + signal.SIGTERM == 143, output
  saved = max(steps())  # no step it trained and logged is lost
  assert (
    f'Stopped by SIGTERM after step {saved}: its checkpoint is saved in '
    f'{ckpt_dir}; run the same command to resume.\n' in output
  ), output
  assert 'Traceback' not in output and 'FATAL' not in output
  assert os.listdir(ckpt_dir) == [str(saved)]
  assert (tmp_path / 'run' / workdir_lib.LOCK_FILE).read_text() == ''  # released
  assert (tmp_path / 'run' / checkpointing.CONFIG_JSON).exists()

  log = tmp_path / 'sigint.log'
  process = start_logged(command, log, child_env)
  _wait_for(lambda: max(steps()) >= saved + 2, process, log)
  _stop(process, signal.SIGINT)
  output = log.read_text()
  assert process.returncode == 128 + signal.SIGINT == 130, output
  assert f'Resuming from the checkpoint of step {saved} in {ckpt_dir}.' in output
  interrupted = max(steps())
  assert f'Stopped by SIGINT after step {interrupted}: ' in output, output
  assert 'Traceback' not in output and 'FATAL' not in output
  assert sorted(map(int, os.listdir(ckpt_dir))) == [saved, interrupted]
  assert steps() == list(range(1, interrupted + 1))  # each step once

  log = tmp_path / 'killed.log'
  killed = start_logged(command, log, child_env)
  try:
    # Until TensorBoard holds its steps too (its writer flushes when its buffer fills).
    _wait_for(
      lambda: (
        max(steps()) >= interrupted + 20
        and max(s for s, _ in metrics_lib.read_tensorboard(workdir)['train/loss'])
        > interrupted + 5  # the runs before left TensorBoard steps
      ),
      killed,
      log,
    )
    refused = subprocess.run(
      command, cwd=REPO, env=child_env, capture_output=True, text=True, timeout=300
    )
  finally:
    killed.kill()  # SIGKILL: no clean-up runs
    killed.wait()
  assert killed.returncode == -signal.SIGKILL
  assert refused.returncode == 1
  assert (
    f'FATAL: Workdir {workdir!r} is in use by pid {killed.pid} on host '
    f'{socket.gethostname()} (train, started '
  ) in refused.stderr
  assert 'Traceback' not in refused.stderr
  dead_steps = steps()
  assert dead_steps == list(range(1, len(dead_steps) + 1))  # the refused run wrote none
  assert sorted(map(int, os.listdir(ckpt_dir))) == [saved, interrupted]

  config, stop = endless_run_config(tfds_dir), interrupted + 4
  resumed = loop_lib.train_and_evaluate(config, workdir, max_steps=stop)
  out = capsys.readouterr().out
  assert f'Taking over the stale lock of pid {killed.pid}' in out
  assert f'Resuming from the checkpoint of step {interrupted}' in out
  reference_dir = str(tmp_path / 'reference')
  reference = loop_lib.train_and_evaluate(config, reference_dir, max_steps=stop)
  jax.tree.map(
    np.testing.assert_array_equal,
    jax.device_get(resumed.state.params),
    jax.device_get(reference.state.params),
  )
  losses = lambda w: [(r['step'], r['train/loss']) for r in metrics_lib.read_jsonl(w)]
  assert losses(workdir) == losses(reference_dir)  # every step once, the same values
  shown = metrics_lib.read_tensorboard(workdir)['train/loss']
  assert [s for s, _ in shown] == list(range(1, stop + 1))
  assert [v for _, v in shown] == pytest.approx([v for _, v in losses(workdir)])


def test_config_errors_are_one_line_and_debug_shows_the_traceback(tmp_path):
  """A bad value and an unknown field: one FATAL line naming the field, exit 1, no
  workdir left; --debug adds the traceback. (Three processes at once: none compiles.)"""
  bad_value = [
    sys.executable,
    'train.py',
    '--config=configs/default.py:tiny',
    '--config.train.num_steps=0',
    f'--workdir={tmp_path / "work"}',
  ]
  runs = [
    subprocess.Popen(
      command,
      cwd=REPO,
      env={**os.environ, 'JAX_PLATFORMS': 'cpu'},
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      text=True,
    )
    for command in (
      bad_value,
      bad_value + ['--debug'],
      [*bad_value[:3], '--config.model.nope=1', f'--workdir={tmp_path}'],
    )
  ]
  (plain, debug, unknown) = [(run, *run.communicate(timeout=300)) for run in runs]
  assert [run.returncode for run, _, _ in (plain, debug, unknown)] == [1, 1, 1]
  (line,) = plain[2].strip().splitlines()  # one line, naming the field
  assert line.startswith('FATAL: ') and 'num_steps must be a positive integer' in line
  assert 'Traceback (most recent call last)' in debug[2]
  assert debug[2].strip().splitlines()[-1] == line
  assert not (tmp_path / 'work').exists()
  assert (
    "Flags parsing error: unknown config field 'model.nope' in "
    "'--config.model.nope=1'. The fields of model are: "
  ) in unknown[2]
  assert 'Traceback' not in unknown[2]


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
  tfds_dir, child_env, small_filesystem, tmp_path
):
  """The disk fills up after the first checkpoint: whichever writer meets it first
  (metrics, TensorBoard, the background save), the run stops within seconds with one
  FATAL line naming the cause and the last good checkpoint; nothing hangs."""
  workdir = str(small_filesystem / 'run')
  log = tmp_path / 'train.log'
  process = start_logged(
    tiny_run_command(workdir, tfds_dir, checkpoint_every=4), log, child_env
  )
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
    process.wait()
  output = log.read_text()
  assert process.returncode == 1, output
  fatal = [line for line in output.splitlines() if line.startswith('FATAL')]
  assert len(fatal) == 1, output
  assert (
    'No space left on device' in fatal[0] and 'last good checkpoint is step ' in fatal[0]
  ), fatal[0]
  assert 'Traceback' not in output, output
  assert 'Closing the metrics' not in output, output  # the one line, not a log too
  print(f'stopped {seconds:.1f} s after the disk filled: {fatal[0]}')
  assert seconds < 60  # seconds, not a hang (generous: 2 shared cores)
  # A rerun on the still full disk: one line, and no temporary file left behind (the
  # write probe's atomic write left a 0-byte .write_test.*.tmp.* file per rerun).
  with open(os.path.join(small_filesystem, 'filler'), 'ab', buffering=0) as f:
    try:  # what the stopped run's clean-up freed
      while True:
        f.write(bytes(1 << 12))
    except OSError as e:
      assert e.errno == 28  # ENOSPC
  rerun = subprocess.run(
    tiny_run_command(workdir, tfds_dir, checkpoint_every=4),
    cwd=REPO,
    env=child_env,
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert rerun.returncode == 1, rerun.stderr
  lines = [line for line in rerun.stderr.splitlines() if line.strip()]
  assert len(lines) == 1, rerun.stderr
  assert lines[0].startswith('FATAL: ') and 'No space left on device' in lines[0]
  assert not [name for name in os.listdir(workdir) if '.tmp.' in name]
