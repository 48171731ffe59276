"""gs:// workdirs, offline: a local GCS emulator stands in for Cloud Storage.

`gcp_storage_emulator` serves GCS's JSON API on localhost; gcsfs and
google-cloud-storage reach it through STORAGE_EMULATOR_HOST, TensorStore (orbax's
array writes) through TENSORSTORE_GCS_HTTP_URL. The emulator ignores generation
preconditions, which the lease and TensorStore rely on, so `_enforce_preconditions`
adds GCS's rule to it: a write or delete with `ifGenerationMatch=g` fails with 412
unless the object is at generation g (0: absent); and its downloads get the
`x-goog-generation` header GCS sends. Everything a run writes goes through it: checkpoints
(TensorStore), config.json, metrics.jsonl, TensorBoard events, the lease and eval.py's
outputs.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from http import HTTPStatus

import jax
import fsspec
import numpy as np
import pytest
from etils import epath
from gcp_storage_emulator import server as emulator_server
from gcp_storage_emulator.exceptions import NotFound
from gcp_storage_emulator.handlers import objects as emulator_objects

from attnres_jax.runs import checkpointing
from attnres_jax.runs import lease as lease_lib
from attnres_jax.runs import metrics as metrics_lib
from attnres_jax.runs import storage
from attnres_jax.training import step as train_lib
from attnres_jax.training import loop as loop_lib
from attnres_jax.runs import workdir as workdir_lib
from configs import default as default_config
from conftest import ROOT

BUCKET = 'bucket'


# The emulator serves requests from threads; its handlers below run one at a time.
_EMULATOR_LOCK = threading.Lock()


def _generation(storage, request) -> str:
  """The generation of the object a request names ('0': absent)."""
  data = request.data
  name = (
    request.params.get('object_id')
    or (request.query.get('name') or [None])[0]
    or (data.get('meta', {}).get('name') if isinstance(data, dict) else None)
  )
  try:
    return str(storage.get_file_obj(request.params['bucket_name'], name)['generation'])
  except NotFound:
    return '0'


def _enforce_preconditions(handler):
  """`handler` (an emulator insert or delete) that first checks `ifGenerationMatch`
  as GCS does: 412 unless the object is at that generation (0: absent)."""

  def checked(request, response, storage, *args, **kwargs):
    wanted = request.query.get('ifGenerationMatch')
    with _EMULATOR_LOCK:
      if wanted and _generation(storage, request) != wanted[0]:
        response.status = HTTPStatus.PRECONDITION_FAILED
        response.json({'error': {'code': 412, 'message': 'conditionNotMet'}})
        return None
      return handler(request, response, storage, *args, **kwargs)

  return checked


def _with_generation_header(download):
  """The emulator's download, with the `x-goog-generation` header GCS sends (TensorStore
  reads an object's generation from it before a conditional rewrite)."""

  def handler(request, response, storage, *args, **kwargs):
    with _EMULATOR_LOCK:
      result = download(request, response, storage, *args, **kwargs)
      response['x-goog-generation'] = _generation(storage, request)
      return result

  return handler


@pytest.fixture(scope='module')
def gcs():
  """A GCS emulator on localhost with bucket 'bucket', in memory, for the module; the
  environment points gcsfs, google-cloud-storage and TensorStore (here and in child
  processes) at it."""
  sock = socket.socket()
  sock.bind(('127.0.0.1', 0))
  port = sock.getsockname()[1]
  sock.close()
  url = f'http://127.0.0.1:{port}'
  with pytest.MonkeyPatch.context() as mp:
    checked = {
      f: _enforce_preconditions(f)
      for f in (emulator_objects.insert, emulator_objects.delete)
    }
    checked[emulator_objects.download] = _with_generation_header(
      emulator_objects.download
    )
    for name in ('insert', 'download'):  # also called by name inside the emulator
      mp.setattr(emulator_objects, name, checked[getattr(emulator_objects, name)])
    for _, handlers in emulator_server.HANDLERS:
      for method, handler in list(handlers.items()):
        if handler in checked:
          mp.setitem(handlers, method, checked[handler])
    mp.setenv('STORAGE_EMULATOR_HOST', url)
    mp.setenv('TENSORSTORE_GCS_HTTP_URL', url)
    mp.setenv('GOOGLE_AUTH_TOKEN_FOR_TESTING', 'test')  # TensorStore: no credentials
    # gcsfs: no credentials (which would probe the metadata server), and no bucket-type
    # lookup (a gRPC API the emulator lacks); children read both from the environment.
    mp.setitem(fsspec.config.conf.setdefault('gs', {}), 'token', 'anon')
    mp.setenv('FSSPEC_GS_TOKEN', 'anon')
    mp.setenv('GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT', 'false')
    # The emulator logs every absent object TensorStore looks for.
    mp.setattr(logging.getLogger('gcp_storage_emulator'), 'level', logging.CRITICAL)
    server = emulator_server.create_server(
      '127.0.0.1', port, in_memory=True, default_bucket=BUCKET
    )
    server.start()
    try:
      yield f'gs://{BUCKET}'
    finally:
      server.stop()


def _lease_record(path: str) -> dict:
  # The holder rewrites the record every lease / 4 seconds, and a path read takes the
  # object's size and its bytes in separate requests: a read across a renewal can come
  # back cut to the old length (seen once, with the host loaded). Read again then; the
  # lease's own reads pin one generation (`GcsLease._read`).
  for _ in range(20):
    try:
      return json.loads(epath.Path(path).read_text())
    except json.JSONDecodeError:
      time.sleep(0.01)
  return json.loads(epath.Path(path).read_text())


def _write_record(path: str, **record) -> None:
  epath.Path(path).write_text(json.dumps(record))


def _other_host(renewed: float, lease_seconds: float) -> dict:
  return dict(
    pid=1234,
    host='another-vm',
    started='earlier',
    purpose='train',
    renewed=renewed,
    lease_seconds=lease_seconds,
  )


def test_lease_is_taken_renewed_refused_while_live_and_released(gcs):
  workdir = f'{gcs}/lease_live'
  path = f'{workdir}/{workdir_lib.LOCK_FILE}'
  with lease_lib.acquire(workdir, 'train', lease_seconds=0.4) as held:
    assert isinstance(held, lease_lib.GcsLease) and not held.messages
    first = _lease_record(path)
    assert first['pid'] == os.getpid() and first['purpose'] == 'train'
    with pytest.raises(workdir_lib.WorkdirLockedError, match='in use by pid'):
      lease_lib.acquire(workdir, 'second')  # a live process on this host
    time.sleep(0.3)  # renewed every 0.1 s
    assert _lease_record(path)['renewed'] > first['renewed']
  assert not epath.Path(path).exists()  # released: no record left
  with lease_lib.acquire(workdir, 'third') as again:
    assert not again.messages


def test_lease_of_another_host_is_refused_while_renewed_and_taken_over_once_stale(gcs):
  workdir = f'{gcs}/lease_hosts'
  path = f'{workdir}/{workdir_lib.LOCK_FILE}'
  _write_record(path, **_other_host(time.time(), lease_seconds=2.0))
  renewer = threading.Timer(
    0.5, lambda: _write_record(path, **_other_host(time.time(), lease_seconds=2.0))
  )
  renewer.start()
  start = time.monotonic()
  with pytest.raises(workdir_lib.WorkdirLockedError, match='renews its lease'):
    lease_lib.acquire(workdir, 'train')
  assert time.monotonic() - start < 2.0  # refused at the renewal, not after the lease
  renewer.join()
  # A preempted VM's record: its last renewal is older than its lease.
  _write_record(path, **_other_host(time.time() - 100, lease_seconds=2.0))
  with lease_lib.acquire(workdir, 'train') as taken:
    (message,) = taken.messages
    assert 'pid 1234 on host another-vm' in message and 'lease expired' in message
    assert _lease_record(path)['pid'] == os.getpid()
  # A dead process of this host: taken over at once.
  dead = subprocess.run(
    [sys.executable, '-c', 'import os; print(os.getpid())'],
    capture_output=True,
    text=True,
    check=True,
  )
  _write_record(
    path,
    **dict(
      _other_host(time.time(), 60.0), host=socket.gethostname(), pid=int(dead.stdout)
    ),
  )
  with lease_lib.acquire(workdir, 'train') as taken:
    assert 'no longer running' in taken.messages[0]


def test_lease_writes_are_conditional_on_the_generation_read(gcs, monkeypatch):
  workdir = f'{gcs}/lease_race'
  path = f'{workdir}/{workdir_lib.LOCK_FILE}'
  # Two processes read "no lease" at once; the other one writes first.
  read = lease_lib.GcsLease._read

  def read_then_lose_the_race(self):
    seen = read(self)
    _write_record(path, **dict(_other_host(time.time(), 60.0), pid=999))
    return seen

  monkeypatch.setattr(lease_lib.GcsLease, '_read', read_then_lose_the_race)
  with pytest.raises(workdir_lib.WorkdirLockedError, match='at the same moment'):
    lease_lib.acquire(workdir, 'train')
  monkeypatch.undo()
  assert _lease_record(path)['pid'] == 999  # the winner's record stands
  epath.Path(path).unlink()
  # A holder whose record another process replaced stops renewing and keeps off it.
  held = lease_lib.acquire(workdir, 'train', lease_seconds=0.4)
  _write_record(path, **dict(_other_host(time.time(), 60.0), pid=777))
  time.sleep(0.3)
  assert held.lost
  held.release()
  assert _lease_record(path)['pid'] == 777


def test_train_resume_and_eval_py_in_a_gs_workdir(gcs, tfds_dir, tmp_path, capsys):
  config = default_config.get_config('tiny')
  config.data.tfds_data_dir = tfds_dir
  # The schedule of test_train's resumed runs and test_eval's evaluated one: their
  # programs, compiled once for the session (compilation_cache), are loaded here.
  config.train.update(num_steps=8, warmup_steps=2, checkpoint_every=4, log_every=1)
  workdir = f'{gcs}/run'
  assert loop_lib.train_and_evaluate(config, workdir, max_steps=4).step == 4
  resumed = loop_lib.train_and_evaluate(config, workdir)
  assert f'Resuming from the checkpoint of step 4 in {workdir}/checkpoints' in (
    capsys.readouterr().out
  )
  straight = loop_lib.train_and_evaluate(config, str(tmp_path / 'local'))
  # Resumed from the bucket (params, optimizer and data iterator state), the run
  # equals a straight local one bitwise.
  jax.tree.map(
    np.testing.assert_array_equal,
    jax.device_get((resumed.state.params, resumed.state.opt_state)),
    jax.device_get((straight.state.params, straight.state.opt_state)),
  )
  assert resumed.eval == straight.eval

  def losses(records):  # timings differ between runs, the numbers may not
    return [(r['step'], r.get('train/loss'), r.get('eval/loss')) for r in records]

  assert losses(metrics_lib.read_jsonl(workdir)) == losses(
    metrics_lib.read_jsonl(tmp_path / 'local')
  )
  shown = metrics_lib.read_tensorboard(workdir)
  assert [s for s, _ in shown['train/loss']] == list(range(1, 9))  # each step once
  assert checkpointing.Checkpointer(
    workdir, save_every=0, keep=None, read_only=True
  ).all_steps() == [4, 8]
  saved = checkpointing.load_config(workdir)
  assert json.loads(saved.to_json()) == json.loads(config.to_json())
  assert not epath.Path(f'{workdir}/{workdir_lib.LOCK_FILE}').exists()
  final = json.loads(epath.Path(f'{workdir}/{train_lib.EVAL_FINAL_JSON}').read_text())

  out = subprocess.run(
    [
      sys.executable,
      'eval.py',
      f'--workdir={workdir}',
      f'--max_eval_batches={config.train.max_eval_batches}',
      '--grad_batches=1',
    ],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=300,
    env={**os.environ, 'PYTHONPATH': ROOT},
  )
  assert out.returncode == 0, out.stdout + out.stderr
  record = json.loads(epath.Path(f'{workdir}/eval/step_8/eval.json').read_text())
  assert record['step'] == 8 and record['workdir'] == workdir
  # The same eval batches of the same parameters, restored from the bucket.
  assert record['bits_per_byte'] == pytest.approx(final['bits_per_byte'], rel=1e-5)
  names = {p.name for p in epath.Path(f'{workdir}/eval/step_8').iterdir()}
  assert {'eval.json', 'analysis.npz', 'magnitudes.png'} <= names
  assert not epath.Path(f'{workdir}/{workdir_lib.LOCK_FILE}').exists()  # released


def test_missing_bucket_is_one_line(gcs, no_compilation):
  """The bucket check (train.py, eval.py and train_and_evaluate run it first): a
  bucket the emulator does not have is one line naming the workdir and the cause,
  before anything is built; the emulator's bucket passes."""
  storage.check_reachable(f'{gcs}/run')
  with pytest.raises(OSError) as error:
    loop_lib.train_and_evaluate(
      default_config.get_config('tiny'), 'gs://no_such_bucket/run'
    )
  message = str(error.value)
  assert message.startswith(
    "Workdir 'gs://no_such_bucket/run' cannot be used: no such bucket: "
    "'no_such_bucket' (HTTP 404"
  ), message
  assert '\n' not in message
