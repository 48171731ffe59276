"""What a requeued job meets, through `train.py` and `eval.py` as a user runs them: a
cut-off last line in `metrics.jsonl`, a stop signal during the first compilation or an
evaluation, a bucket that cannot be reached, Ctrl-C while starting or waiting for a
lease, and usage errors. Every stop must leave a workdir the same command resumes."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest

from attnres_jax.runs import checkpointing
from attnres_jax.runs import metrics as metrics_lib
from attnres_jax.runs import preemption
from attnres_jax.runs import storage
from attnres_jax.runs import workdir as workdir_lib
from attnres_jax.training import loop as loop_lib

from conftest import ROOT, cached_child_env, start_logged, tiny_run_command
from conftest import FAST_COMPILE, endless_run_config

EXIT_SECONDS = 5.0  # a stop signal is acted on within this (issue 56)


@pytest.fixture(scope='module')
def child_env(compilation_cache) -> dict[str, str]:  # pylint: disable=redefined-outer-name
  return cached_child_env(compilation_cache)


def _wait_for(condition, process, log, timeout=300):
  deadline = time.monotonic() + timeout
  while not condition():
    if process.poll() is not None:
      raise AssertionError(f'exited ({process.returncode}):\n{log.read_text()}')
    if time.monotonic() > deadline:
      raise AssertionError(f'Timed out; the process wrote:\n{log.read_text()}')
    time.sleep(0.05)


def _signal_and_time(process, signum) -> float:
  """Sends `signum`; the seconds until the process exited (a hang fails)."""
  try:
    sent = time.monotonic()
    process.send_signal(signum)
    process.wait(timeout=120)
    return time.monotonic() - sent
  finally:
    process.kill()
    process.wait()


def _lines(text: str) -> list[str]:
  """The lines a user reads (tqdm's redrawn bar as its last state)."""
  return [line.rsplit('\r', 1)[-1] for line in text.splitlines() if line.strip()]


def _steps(workdir):
  return [r['step'] for r in metrics_lib.read_jsonl(workdir)] or [0]


def _run(args, env, timeout=300):
  started = time.monotonic()
  done = subprocess.run(
    [sys.executable, *args],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=timeout,
  )
  return done, time.monotonic() - started


def test_cut_off_metrics_line_resumes_and_equals_an_uninterrupted_run(
  tfds_dir, child_env, tmp_path
):
  """A full disk (or a kill) cut the last record of metrics.jsonl in half: the rerun
  drops it with one warning naming the file and its step, and equals a run never
  interrupted; eval.py --compare reads it the same way. Damage before the last line
  is refused in one line naming the file and the line, by train.py and eval.py."""
  workdir = str(tmp_path / 'run')
  command = tiny_run_command(workdir, tfds_dir)
  log = tmp_path / 'first.log'
  process = start_logged(command, log, child_env)
  _wait_for(lambda: max(_steps(workdir)) >= 3, process, log)
  assert _signal_and_time(process, signal.SIGTERM) < 60
  assert process.returncode == 143, log.read_text()
  saved = max(_steps(workdir))
  jsonl = os.path.join(workdir, metrics_lib.JSONL)
  with open(jsonl, 'a') as f:  # the record of the next step, cut off by a full disk
    f.write(f'{{"step": {saved + 1}, "train/loss": 3.1415, "train/learn')
  damaged = str(tmp_path / 'damaged')
  shutil.copytree(workdir, damaged)
  lines = open(os.path.join(damaged, metrics_lib.JSONL)).read().split('\n')
  lines[1] = lines[1][: len(lines[1]) // 2]  # damage no stopped write can leave
  open(os.path.join(damaged, metrics_lib.JSONL), 'w').write('\n'.join(lines))

  eval_env = {**child_env, 'PYTHONPATH': ROOT}
  checks = {
    name: subprocess.Popen(
      [sys.executable, *args],
      cwd=ROOT,
      env=eval_env,
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
    )
    for name, args in {
      'compare': ['eval.py', '--compare', workdir, f'--output_dir={tmp_path}/c1'],
      'compare_damaged': [
        'eval.py',
        '--compare',
        damaged,
        f'--output_dir={tmp_path}/c2',
      ],
      'train_damaged': tiny_run_command(damaged, tfds_dir)[1:],
    }.items()
  }
  outputs = {name: p.communicate(timeout=300)[0] for name, p in checks.items()}
  warning = (
    f'WARNING: the last line of {jsonl} is cut off (a write that was interrupted); '
    f'dropping it (it held step {saved + 1}).'
  )
  assert checks['compare'].returncode == 0, outputs['compare']
  assert warning in outputs['compare'] and 'Traceback' not in outputs['compare']
  for name in ('compare_damaged', 'train_damaged'):
    assert checks[name].returncode == 1, outputs[name]
    (fatal,) = [line for line in _lines(outputs[name]) if 'FATAL' in line]
    assert fatal.startswith(
      f'FATAL: {damaged}/{metrics_lib.JSONL} is damaged at line 2 of '
    ), fatal
    assert 'Traceback' not in outputs[name], outputs[name]

  log = tmp_path / 'resumed.log'
  process = start_logged(command, log, child_env)
  _wait_for(lambda: max(_steps(workdir)) >= saved + 3, process, log)
  _signal_and_time(process, signal.SIGTERM)
  output = log.read_text()
  assert process.returncode == 143, output
  assert output.count(warning) == 1, output  # one warning, naming file and step
  stop = max(_steps(workdir))
  reference = str(tmp_path / 'reference')
  loop_lib.train_and_evaluate(endless_run_config(tfds_dir), reference, max_steps=stop)
  losses = lambda w: [(r['step'], r['train/loss']) for r in metrics_lib.read_jsonl(w)]
  assert losses(workdir) == losses(reference)  # every step once, bitwise the same
  shown = metrics_lib.read_tensorboard(workdir)['train/loss']
  assert [s for s, _ in shown] == list(range(1, stop + 1))


def test_sigterm_during_the_first_compile_exits_at_once_and_resumes(
  tfds_dir, child_env, tmp_path, capsys
):
  """A requeued run compiles its step before it trains (minutes on a TPU): SIGTERM
  2 s into that compilation ends it within seconds, exit 143, one line; the lock is
  released, nothing the workdir held changes, and the same command resumes."""
  workdir = str(tmp_path / 'run')
  config = endless_run_config(tfds_dir, checkpoint_every=2)
  loop_lib.train_and_evaluate(config, workdir, max_steps=2)
  capsys.readouterr()
  before = {
    name: open(os.path.join(workdir, name), 'rb').read()
    for name in (metrics_lib.JSONL, checkpointing.CONFIG_JSON)
  }
  ckpt_dir = checkpointing.checkpoint_dir(workdir)
  # A fresh compilation cache and XLA's default compile settings (not the session's
  # fast ones, which compile this step in under 2 s): the child compiles its train
  # step as a new VM does.
  env = dict(child_env, JAX_COMPILATION_CACHE_DIR=str(tmp_path / 'cache'))
  env['XLA_FLAGS'] = env['XLA_FLAGS'].replace(FAST_COMPILE, '').strip()
  env['JAX_LOG_COMPILES'] = '1'  # says when XLA compiles what
  log = tmp_path / 'train.log'
  process = start_logged(
    tiny_run_command(workdir, tfds_dir, checkpoint_every=2), log, env
  )

  def compiling_the_step():  # the bar shows once set up; then the step compiles
    text = log.read_text()
    return 'train:' in text and 'Compiling jit(' in text[text.index('train:') :]

  _wait_for(compiling_the_step, process, log)
  time.sleep(2.0)
  seconds = _signal_and_time(process, signal.SIGTERM)
  output = log.read_text()
  after_bar = output[output.index('train:') :]
  assert 'Finished XLA compilation' not in after_bar, (
    'the step compiled in under 2 s: the signal missed the compilation\n' + output
  )
  with capsys.disabled():  # (the resumed run below reads capsys)
    print(f'SIGTERM 2 s into the compilation: exited {seconds:.2f} s after it')
  assert process.returncode == 143, output
  assert seconds < EXIT_SECONDS, output
  stop_line = (
    f'Stopped by SIGTERM before step 3 (setting up or compiling): nothing new to '
    f'save, the latest checkpoint is step 2 in {ckpt_dir}; run the same command to '
    'resume.'
  )
  assert [line for line in _lines(output) if line.startswith('Stopped')] == [stop_line]
  assert 'Traceback' not in output and 'FATAL' not in output
  assert open(os.path.join(workdir, workdir_lib.LOCK_FILE)).read() == ''  # released
  for name, data in before.items():
    assert open(os.path.join(workdir, name), 'rb').read() == data, name
  assert sorted(os.listdir(ckpt_dir)) == ['2']
  loop_lib.train_and_evaluate(config, workdir, max_steps=3)
  out = capsys.readouterr().out
  assert 'Resuming from the checkpoint of step 2' in out and 'Taking over' not in out


def test_sigterm_during_an_evaluation_stops_between_batches_with_the_step_saved(
  tfds_dir, child_env, tmp_path
):
  """An evaluation of the whole eval split (1527 batches, ~18 s here) is stopped
  between two batches: exit 143 within seconds, the step saved, its evaluation left
  for the resumed run (test_evaluation_cut_by_a_signal_is_redone_on_resume)."""
  workdir = str(tmp_path / 'run')
  log = tmp_path / 'train.log'
  command = tiny_run_command(workdir, tfds_dir, eval_every=2, max_eval_batches=100_000)
  process = start_logged(command, log, child_env)
  _wait_for(lambda: max(_steps(workdir)) >= 2, process, log)  # logged, then evaluated
  time.sleep(1.0)
  seconds = _signal_and_time(process, signal.SIGTERM)
  output = log.read_text()
  print(f'SIGTERM during the evaluation: exited {seconds:.2f} s after it')
  assert process.returncode == 143, output
  assert seconds < EXIT_SECONDS, output
  ckpt_dir = checkpointing.checkpoint_dir(workdir)
  assert (
    f'Stopped by SIGTERM during the evaluation of step 2: its checkpoint is saved in '
    f'{ckpt_dir}; run the same command to resume (the evaluation is done again).'
  ) in _lines(output), output
  assert 'Traceback' not in output and 'held-out' not in output
  assert os.listdir(ckpt_dir) == ['2']
  assert not any('eval/loss' in r for r in metrics_lib.read_jsonl(workdir))
  assert open(os.path.join(workdir, workdir_lib.LOCK_FILE)).read() == ''


def test_evaluation_cut_by_a_signal_is_redone_on_resume(tfds_dir, tmp_path):
  """In process (the library's StopSignal: a flag): SIGINT as step 4's evaluation
  starts stops it at its first batch with step 4 saved; the resumed run evaluates
  step 4 first, and its records equal an uninterrupted run's."""
  config = endless_run_config(tfds_dir, eval_every=2, max_eval_batches=4)

  def interrupt(step, record):
    if step == 4 and 'train/loss' in record:
      os.kill(os.getpid(), signal.SIGINT)

  workdir = str(tmp_path / 'run')
  with pytest.raises(preemption.Preempted, match='during the evaluation of step 4') as e:
    loop_lib.train_and_evaluate(config, workdir, on_metrics=interrupt)
  assert e.value.step == 4 and e.value.exit_code == 130
  assert [r['step'] for r in metrics_lib.read_jsonl(workdir) if 'eval/loss' in r] == [2]
  loop_lib.train_and_evaluate(config, workdir, max_steps=6)
  reference = str(tmp_path / 'reference')
  loop_lib.train_and_evaluate(config, reference, max_steps=6)

  def numbers(w):
    return [
      (r['step'], r.get('train/loss'), r.get('eval/loss'))
      for r in metrics_lib.read_jsonl(w)
    ]

  assert numbers(workdir) == numbers(reference)
  assert [s for s, _, e in numbers(workdir) if e is not None] == [2, 4, 6]


def _closed_port() -> int:
  sock = socket.socket()
  sock.bind(('127.0.0.1', 0))
  port = sock.getsockname()[1]
  sock.close()  # nothing listens there: a connection is refused at once
  return port


def test_gs_workdir_without_network_or_credentials_fails_fast_in_one_line(tmp_path):
  """No network (the GCS endpoint a closed local port) and no credentials (Application
  Default Credentials pointing at no file): train.py and eval.py exit 1 with one
  FATAL line naming the workdir and the cause, in seconds (gcsfs retried for a
  minute and printed 54 to 191 lines). No external address is contacted."""
  base = {
    k: v
    for k, v in os.environ.items()
    if not k.startswith(('STORAGE_EMULATOR', 'GCE', 'GOOGLE_', 'FSSPEC_GS'))
  }
  base.update(JAX_PLATFORMS='cpu', NO_GCE_CHECK='true')
  offline = dict(
    base,
    STORAGE_EMULATOR_HOST=f'http://127.0.0.1:{_closed_port()}',
    FSSPEC_GS_TOKEN='anon',
  )
  no_credentials = dict(
    base, GOOGLE_APPLICATION_CREDENTIALS=str(tmp_path / 'no_such_key.json')
  )
  workdir = 'gs://bucket/run'
  cases = {
    'train_offline': (['train.py', '--config=configs/default.py:tiny'], offline),
    'eval_offline': (['eval.py'], offline),
    'train_no_credentials': (
      ['train.py', '--config=configs/default.py:tiny'],
      no_credentials,
    ),
    # A refusal that needs no network, at the same time: what starting Python and
    # importing JAX take on this machine now (2 cores, shared).
    'baseline': (['train.py', '--config=configs/default.py:tiny'], base),
  }
  started = time.monotonic()
  runs = {
    name: subprocess.Popen(
      [
        sys.executable,
        *args,
        f'--workdir={"s3://bucket/run" if name == "baseline" else workdir}',
      ],
      cwd=ROOT,
      env=env,
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
    )
    for name, (args, env) in cases.items()
  }
  results = {}
  for name, run in runs.items():
    output = run.communicate(timeout=300)[0]
    results[name] = (run.returncode, time.monotonic() - started, _lines(output))
  print(
    {name: (rc, f'{s:.1f} s', len(lines)) for name, (rc, s, lines) in results.items()}
  )
  baseline = results.pop('baseline')
  assert baseline[0] == 1 and 's3:// is not supported' in baseline[2][-1], baseline
  for name, (returncode, seconds, lines) in results.items():
    assert returncode == 1, (name, lines)
    assert len(lines) <= 3, (name, lines)
    (fatal,) = [line for line in lines if line.startswith('FATAL')]
    what = 'Directory' if name.startswith('eval') else 'Workdir'
    assert fatal.startswith(f"FATAL: {what} '{workdir}' cannot be used: "), fatal
    if name.endswith('offline'):
      assert 'cannot reach http://127.0.0.1:' in fatal and 'Connection refused' in fatal
    else:
      assert 'no credentials' in fatal and 'no_such_key.json' in fatal
    # The check waits at most REACH_TIMEOUT_SECONDS (10 s) beyond the imports.
    assert seconds < baseline[1] + storage.REACH_TIMEOUT_SECONDS, (name, seconds)


def test_ctrl_c_while_starting_or_waiting_for_a_lease_and_eval_usage_are_one_line(
  tmp_path,
):
  """Ctrl-C during the imports, or while waiting out another host's lease: exit 130,
  one line, no traceback, another host's lock record untouched. eval.py's usage
  errors are one line (the usage only on --help)."""
  env = dict(os.environ, JAX_PLATFORMS='cpu')
  workdir = tmp_path / 'run'
  workdir.mkdir()
  other_host = dict(
    pid=1234,
    host='elsewhere',
    started='?',
    purpose='train',
    renewed=time.time(),
    lease_seconds=600.0,
  )
  (workdir / workdir_lib.LOCK_FILE).write_text(json.dumps(other_host))
  lease_log = tmp_path / 'lease.log'
  waiting = start_logged(
    [
      sys.executable,
      'train.py',
      '--config=configs/default.py:tiny',
      f'--workdir={workdir}',
    ],
    lease_log,
    env,
  )
  importing = subprocess.Popen(
    [sys.executable, 'train.py', f'--workdir={tmp_path / "other"}'],
    cwd=ROOT,
    env=env,
    stdout=subprocess.PIPE,
    stderr=subprocess.STDOUT,
    text=True,
  )
  time.sleep(1.5)  # Python is importing JAX (its start takes a fraction of that)
  importing.send_signal(signal.SIGINT)
  out = importing.communicate(timeout=60)[0]
  assert importing.returncode == 130, out
  assert _lines(out) == ['Stopped by SIGINT while starting; nothing was written.']
  usage = {
    'empty': _run(['eval.py'], env),
    'help': _run(['eval.py', '--help'], env),
  }
  (line,) = _lines(usage['empty'][0].stdout + usage['empty'][0].stderr)
  assert line == 'FATAL: --workdir is required (or --compare DIR1 DIR2 ...).'
  assert usage['empty'][0].returncode == 1
  assert '--output_dir' in usage['help'][0].stdout + usage['help'][0].stderr

  _wait_for(lambda: 'waiting up to' in lease_log.read_text(), waiting, lease_log)
  seconds = _signal_and_time(waiting, signal.SIGINT)
  output = lease_log.read_text()
  assert waiting.returncode == 130, output
  assert seconds < EXIT_SECONDS, output
  assert 'Traceback' not in output, output
  assert [line for line in _lines(output) if line.startswith('Stopped')] == [
    'Stopped by SIGINT while setting up the run; nothing new to save; run the same '
    'command to resume.'
  ], output
  assert json.loads((workdir / workdir_lib.LOCK_FILE).read_text()) == other_host
  assert storage.exists(str(workdir))  # not this run's to remove
