"""The residual-mode vocabulary of the command-line tools (attnres_jax/modes.py)."""

import pytest

from attnres_jax import config as config_lib
from attnres_jax import modes
from configs import default as default_config
from configs import ladders


@pytest.mark.parametrize(
  'mode, fields, run_name',
  [
    ('standard', dict(residual='standard'), 'standard'),
    ('full', dict(residual='full'), 'full'),
    ('full@2', dict(residual='full', schedule_layers=2), 'full_g2'),
    ('standard@2', dict(residual='standard', schedule_layers=2), 'standard_g2'),
    ('block:4', dict(residual='block', block_size=4), 'block_s4'),
    ('block:2@3', dict(residual='block', block_size=2, schedule_layers=3), 'block_s2_g3'),
    ('hc', dict(residual='hc', hc_streams=4), 'hc'),
    ('mhc:4', dict(residual='mhc', hc_streams=4), 'mhc'),
    ('hc:2', dict(residual='hc', hc_streams=2), 'hc_m2'),
    ('full/xla', dict(residual='full', depth_kernel='xla'), 'full_xla'),
    (
      'block:4/bf16',
      dict(residual='block', block_size=4, depth_dtype='bfloat16'),
      'block_s4_bf16',
    ),
    (
      'block:4@2/f32',
      dict(residual='block', block_size=4, schedule_layers=2, depth_dtype='float32'),
      'block_s4_g2_f32',
    ),
    (
      'full/bf16/pallas',
      dict(residual='full', depth_dtype='bfloat16', depth_kernel='pallas'),
      'full_bf16_pallas',
    ),
    ('mhc/xla', dict(residual='mhc', hc_streams=4, depth_kernel='xla'), 'mhc_xla'),
  ],
)
def test_mode_fields_and_run_names(mode, fields, run_name):
  assert modes.fields(mode) == fields
  assert modes.run_name(mode) == run_name
  # Every mode builds a valid model config.
  config_lib.ModelConfig(num_layers=4, **modes.fields(mode))


@pytest.mark.parametrize(
  'mode, why',
  [
    ('block', 'needs its block size'),
    ('block:0', 'positive integer'),
    ('block:x', 'positive integer'),
    ('block_s4', "got 'block_s4'; add one with residuals.register"),
    ('no_such.module:Residual', "importing 'no_such.module' failed"),
    ('standard:2', 'takes no size'),
    ('hc@2', 'full and block only'),
    ('full@', 'positive integer'),
    ('hc/bf16', 'apply to full and block only'),
    ('full/fast', "got 'fast'"),
    ('full/pallas/xla', 'depth_kernel given twice'),
    ('full/one_shot', "got 'one_shot'"),  # the options that became automatic rules
    ('full/prefixes:4', "got 'prefixes:4'"),
  ],
)
def test_bad_modes_are_refused_with_the_syntax(mode, why):
  with pytest.raises(ValueError, match=why) as error:
    modes.fields(mode)
  assert modes.SYNTAX in str(error.value)


def test_the_options_are_storage_and_kernel_only():
  """How the rest is computed follows automatic rules (docs/design_choices.md)."""
  assert set(modes.OPTIONS) == {'bf16', 'f32', 'pallas', 'xla'}


def test_a_bare_block_takes_the_size_the_tool_supplies():
  assert modes.fields('block/bf16', block_size=2) == dict(
    residual='block', block_size=2, depth_dtype='bfloat16'
  )
  assert modes.fields('block:4', block_size=2)['block_size'] == 4  # given wins
  assert modes.parse_list('standard,block', block_size=3) == ['standard', 'block']


def test_parse_list_checks_every_mode():
  assert modes.parse_list('standard, block:4,mhc') == ['standard', 'block:4', 'mhc']
  with pytest.raises(ValueError, match='block:'):
    modes.parse_list('standard,block:')
  with pytest.raises(ValueError, match='No residual mode'):
    modes.parse_list(' , ')


def test_study_runs_are_named_after_their_modes():
  assert default_config.SWEEP_MODES['block_s4'] == dict(residual='block', block_size=4)
  assert default_config.SWEEP_COMPARATORS['mhc'] == dict(residual='mhc', hc_streams=4)
  assert ladders.EARLY.run('block:4', 32) == 'block_s4_d32'
  assert ladders.OPTIMAL.run('block', 32) == 'opt_block_n4_d32_l6'
  for ladder in ladders.LADDERS.values():
    for mode in ladder.residuals:
      for width in ladder.widths:
        run = default_config.SWEEP_RUNS[ladder.run(mode, width)]
        expected = modes.fields(mode, block_size=ladder.block_size(width))
        assert {k: run[k] for k in expected} == expected


def test_registered_residuals_and_plug_ins_are_modes(tmp_path):
  """Any residual the registry knows is a mode by its name, and a plug-in by its
  reference (the bench scripts take them as they take the built-in modes)."""
  assert modes.fields('rezero') == dict(residual='rezero')
  assert modes.run_name('rezero') == 'rezero'
  source = tmp_path / 'my_residual.py'
  source.write_text(
    'from attnres_jax.residuals import standard\n\n\n'
    'class MyResidual(standard.StandardResidual):\n  pass\n'
  )
  plugin = f'{source}:MyResidual'
  assert modes.fields(plugin) == dict(residual=plugin)
  assert modes.run_name(plugin) == 'myresidual'
  assert modes.parse_list(f'standard,{plugin}') == ['standard', plugin]
  config_lib.ModelConfig(num_layers=2, **modes.fields(plugin))
