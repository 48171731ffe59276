"""Residual plug-ins: a config names a residual outside the package as
'package.module:Class' or 'path/to/file.py:Class', and the registry imports it on first
use, so every entry point runs it with no library edit: here in-process, and through
train.py and eval.py on a residual written to a temporary directory."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from attnres_jax import config as config_lib
from attnres_jax import residuals
from attnres_jax.residuals import registry
from conftest import ROOT, child_env, tiny_model_config

# A residual as a user would write it, outside the repository, from the template
# residual (ReZero): h <- h + s * f(h) with a learned scale s per sublayer from 1/2.
# Its parameter is named `query`, as AttnRes's pseudo-queries, which AttnRes spares
# weight decay and this residual does not.
PLUGIN = """
import dataclasses

import jax.numpy as jnp
from flax import nnx

from attnres_jax.residuals import base
from attnres_jax.residuals import rezero


class Scales(nnx.Module):
  def __init__(self, cfg):
    self.query = base.param(
      lambda shape, dtype: jnp.full(shape, 0.5, dtype), (2,), ('sublayers',),
      jnp.dtype(cfg.param_dtype),
    )


@dataclasses.dataclass(frozen=True)
class HalfResidual(rezero.ReZeroResidual):
  no_decay = frozenset()

  @property
  def label(self):
    return 'Half'

  def layer_params(self):
    return Scales(self.cfg)

  def write(self, inner, params, per_layer, layer_in_segment, which, out_BTD):
    return inner + params.query[...][which].astype(out_BTD.dtype) * out_BTD
"""


def _write(path, text):
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(textwrap.dedent(text))
  return str(path)


def test_a_module_plugin_is_imported_and_registered_under_its_name(tmp_path, monkeypatch):
  _write(tmp_path / 'half_module_plugin.py', PLUGIN)
  monkeypatch.syspath_prepend(str(tmp_path))
  name = 'half_module_plugin:HalfResidual'
  cfg = tiny_model_config(residual=name)  # validation builds it: no edit of config.py
  residual = residuals.make(cfg)
  assert type(residual).__name__ == 'HalfResidual'
  assert registry.factory(name) is type(residual) and name in residuals.names()


def test_a_file_plugin_is_imported_once_by_path(tmp_path):
  path = _write(tmp_path / 'half_file_plugin.py', PLUGIN)
  name = f'{path}:HalfResidual'
  cls = type(residuals.make(tiny_model_config(residual=name)))
  assert cls.__module__ in sys.modules  # dataclasses and pickling look it up there
  # Another spelling of the same file: the same module, so the same class.
  relative = os.path.relpath(path)
  assert registry.factory(f'{relative}:HalfResidual') is cls


def test_an_unknown_residual_is_one_line_that_says_how_to_add_one():
  with pytest.raises(ValueError) as error:
    config_lib.model_config(residual='dense')
  message = str(error.value)
  assert '\n' not in message
  assert "residual must be one of ('standard', 'full', 'block'" in message
  assert "'rezero'" in message and "'dense'" in message
  assert 'residuals.register(name, cls)' in message
  assert '--config.model.residual=my_package.my_residual:MyResidual' in message


@pytest.mark.parametrize(
  'module,attribute,cause',
  [
    ('no_such_module_of_residuals', 'R', "ModuleNotFoundError: No module named 'no_such"),
    ('FILE', 'R', 'ImportError: this residual needs torch'),
    ('MISSING.py', 'R', 'FileNotFoundError: no such file'),
    ('attnres_jax.residuals.rezero', 'NoSuchClass', "has no 'NoSuchClass'"),
    ('attnres_jax.residuals.rezero', 'ReZeroScales', 'is not a subclass of'),
  ],
)
def test_a_plugin_that_fails_to_import_is_one_line_naming_module_and_cause(
  tmp_path, module, attribute, cause
):
  if module == 'FILE':
    module = _write(
      tmp_path / 'needs_torch.py', "raise ImportError('this residual needs torch')"
    )
  elif module == 'MISSING.py':
    module = str(tmp_path / 'missing.py')
  name = f'{module}:{attribute}'
  with pytest.raises(ValueError) as error:
    config_lib.model_config(residual=name)
  message = str(error.value)
  assert '\n' not in message and cause in message
  assert message.startswith(f'Invalid model config: residual plug-in {name!r}')
  assert name not in residuals.names()  # a later, fixed attempt imports it afresh


def test_a_residual_in_a_file_outside_the_repository_trains_evaluates_and_decodes(
  tfds_dir, tmp_path
):
  """train.py and eval.py (evaluation, and sampling with the KV cache), as a user runs
  them, on a residual no library file names: the run record keeps the plug-in name,
  and eval.py --workdir imports it again."""
  plugin = _write(tmp_path / 'outside' / 'my_residual.py', PLUGIN)
  workdir = str(tmp_path / 'run')
  train_args = [
    '--config=configs/default.py:tiny',
    f'--config.model.residual={plugin}:HalfResidual',
    f'--config.data.tfds_data_dir={tfds_dir}',
    f'--workdir={workdir}',
    '--config.train.num_steps=4',
    '--config.train.warmup_steps=1',
    '--config.train.checkpoint_every=4',
    '--config.train.log_every=2',
    '--config.train.max_eval_batches=1',
  ]
  outputs = []
  for args in (
    ['train.py', *train_args],
    ['eval.py', f'--workdir={workdir}', '--max_eval_batches=1', '--grad_batches=1'],
    ['eval.py', f'--workdir={workdir}', '--prompt=ROMEO:', '--max_new_tokens=4'],
  ):
    proc = subprocess.run(
      [sys.executable, *args],
      cwd=ROOT,
      env=child_env(1),
      capture_output=True,
      text=True,
      timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    outputs.append(proc.stdout)
  assert 'ROMEO:' in outputs[-1]  # the prompt and its continuation, decoded
  with open(os.path.join(workdir, 'config.json'), encoding='utf-8') as f:
    assert json.load(f)['model']['residual'] == f'{plugin}:HalfResidual'
  with open(os.path.join(workdir, 'eval', 'step_4', 'eval.json'), encoding='utf-8') as f:
    record = json.load(f)
  assert record['step'] == 4 and 0 < record['loss'] < 10
