"""bench/scaling.py recovers a known power law and compute multiplier from run dirs;
the ladder's token rule (configs/default.py) is one rule for every size."""

import json
import os

from flax import nnx
import jax
import numpy as np
import pytest

from attnres_jax import flops
from attnres_jax.models import transformer as model_lib
from attnres_jax.runs import checkpointing
from attnres_jax.training import loop as loop_lib
from attnres_jax.training import step as train
from bench import paired
from bench import scaling
from bench import scaling_report
from configs import ladders

LADDER = ladders.EARLY
WIDTHS = LADDER.widths


def ladder_config(run: str, width: int, ladder=LADDER):
  return scaling.run_config(ladder, run, width)


def write_runs(root, name, gain, noise, skip=()):
  """Synthetic finished runs: L = 40 (gain C)^-0.05 x noise[seed]."""
  for width in WIDTHS:
    run = LADDER.run(name, width)
    config = ladder_config(run, width)
    for seed, factor in noise.items():
      if (width, seed) in skip:
        continue
      workdir = root / run / f'seed_{seed}'
      os.makedirs(workdir)
      checkpointing.save_config(str(workdir), config)
      loss = 40.0 * (gain * flops.training_flops(config)) ** -0.05 * factor
      with open(workdir / train.EVAL_FINAL_JSON, 'w') as f:
        json.dump({'bits_per_byte': loss}, f)


def test_saved_records_give_the_points_of_the_run_dirs(tmp_path):
  # A study's saved records (bench/ladder.py's <name>_runs.json) re-fit without its run
  # root: the same losses, and the same compute as each run's saved config gives.
  noise = {0: 1.0, 1: 1.005, 2: 0.995}
  write_runs(tmp_path, 'block:4', 1.25, noise, skip={(WIDTHS[0], 1)})
  from_dirs = scaling.ladder_points(str(tmp_path), LADDER, 'block:4', WIDTHS, (0, 1, 2))
  records = [
    {'run': LADDER.run('block:4', width), 'seed': seed, 'bits_per_byte': loss}
    for width, (_, values) in from_dirs.items()
    for seed, loss in values.items()
  ]
  records.append({'run': 'standard_d24', 'seed': 0, 'bits_per_byte': 9.0})  # not it
  assert scaling.record_points(records, LADDER, 'block:4', WIDTHS, (0, 1, 2)) == from_dirs


def test_fit_recovers_a_power_law_and_the_multiplier(tmp_path):
  # "block:4" reaches the standard's loss with 1.25x less compute; seeds add +-0.5%.
  noise = {0: 1.0, 1: 1.005, 2: 0.995}
  write_runs(tmp_path, 'standard', 1.0, noise)
  write_runs(tmp_path, 'block:4', 1.25, noise)
  points = {
    name: scaling.ladder_points(str(tmp_path), LADDER, name, WIDTHS, (0, 1, 2))
    for name in ('standard', 'block:4')
  }
  assert sorted(points['standard']) == list(WIDTHS)
  result = scaling.analyse(points, 'standard', bootstrap=200)
  # The same seed noise at every rung multiplies A only: alpha and the multiplier are
  # recovered to float64 rounding. A resample draws different seeds at different rungs,
  # which tilts both fits alike, but not exactly alike (Block's FLOPs are not a fixed
  # multiple of the standard's across widths), so the intervals only contain 1.25.
  block = result['residuals']['block:4']
  np.testing.assert_allclose(result['residuals']['standard']['alpha'], 0.05, rtol=1e-9)
  np.testing.assert_allclose(block['multiplier_middle']['value'], 1.25, rtol=1e-9)
  low, high = block['multiplier_middle']['interval']
  assert low <= 1.25 <= high
  for entry in block['multiplier']:
    np.testing.assert_allclose(entry['value'], 1.25, rtol=1e-9)
    assert entry['low'] <= 1.25 + 1e-9 and entry['high'] >= 1.25 - 1e-9
  for entry in result['residuals']['standard']['multiplier']:
    np.testing.assert_allclose(entry['value'], 1.0, rtol=1e-9)
  table = scaling_report.report(result, str(tmp_path), 'ladder')
  assert '**1.250x**' in table
  assert os.path.exists(tmp_path / 'ladder.png')
  with open(tmp_path / 'ladder.json') as f:
    assert json.load(f)['residuals']['block:4']['multiplier_middle']['value'] > 1.2


def test_unpaired_runs_are_left_out_and_one_seed_prints_na(tmp_path):
  # Seed 2 of block at the first rung is missing: that rung is fitted on seeds 0 and 1
  # for both residuals; a residual's different seed noise per rung widens the interval.
  write_runs(tmp_path, 'standard', 1.0, {0: 1.0, 1: 1.01, 2: 0.99})
  write_runs(tmp_path, 'block:4', 1.0, {0: 0.99, 1: 1.0, 2: 1.01}, skip={(WIDTHS[0], 2)})
  points = {
    name: scaling.ladder_points(str(tmp_path), LADDER, name, WIDTHS, (0, 1, 2))
    for name in ('standard', 'block:4')
  }
  result = scaling.analyse(points, 'standard', bootstrap=300)
  first = result['residuals']['standard']['points'][str(WIDTHS[0])]
  assert first['seeds'] == [0, 1]
  mid = result['residuals']['block:4']['multiplier_middle']
  assert mid['interval'][0] < mid['interval'][1]
  # The per-rung difference pairs the runs by seed, over the seeds both finished.
  for w, rung in result['residuals']['block:4']['points'].items():
    block, standard = points['block:4'][int(w)][1], points['standard'][int(w)][1]
    np.testing.assert_allclose(
      rung['difference'],
      np.mean([block[s] - standard[s] for s in rung['seeds']]),
      rtol=1e-12,
    )
    assert rung['difference_interval'][0] < rung['difference_interval'][1]
    # The t interval: mean +- t(0.975, n - 1) s / sqrt(n) of the same paired differences.
    d = [block[s] - standard[s] for s in rung['seeds']]
    t = {2: 12.7062047, 3: 4.3026527}[len(d)]  # t(0.975, n - 1), to 8 digits
    half = t * np.std(d, ddof=1) / np.sqrt(len(d))
    np.testing.assert_allclose(
      rung['difference_t_interval'], [np.mean(d) - half, np.mean(d) + half], rtol=1e-7
    )  # the quantiles' 8 digits
  assert scaling_report.spread([2.5]) == '2.5000 +- n/a'
  assert scaling_report.spread([2.0, 3.0]) == '2.5000 +- 0.7071'


def test_report_draws_an_estimate_that_lies_outside_its_interval(tmp_path):
  # A bootstrap percentile interval need not contain the point estimate. The report
  # must still draw and tabulate it (errorbar offsets would be negative and raise).
  rung = lambda c, v: dict(
    flops=c,
    seeds=[0, 1],
    bits_per_byte=v,
    difference=-0.01,
    difference_interval=[-0.02, 0.0],
  )
  points = {'64': rung(1e12, [3.0, 3.1]), '128': rung(4e12, [2.8, 2.9])}
  row = dict(
    A=40.0,
    alpha=0.05,
    alpha_interval=[0.04, 0.06],
    points=points,
    alpha_minus_reference=0.0,
    alpha_minus_reference_interval=[-0.01, 0.01],
    fit_rms_relative_residual=0.01,
    multiplier_middle=dict(flops=2e12, value=1.2, interval=[1.1, 1.3]),
    multiplier=[
      dict(flops=1e12, value=1.10, low=1.12, high=1.30),  # below
      dict(flops=4e12, value=1.40, low=1.05, high=1.30),
    ],
  )  # above
  result = dict(
    reference='standard',
    interval_percent=95.0,
    bootstrap=10,
    middle_flops=2e12,
    residuals={
      'standard': dict(
        row,
        multiplier=[dict(flops=c, value=1.0, low=1.0, high=1.0) for c in (1e12, 4e12)],
      ),
      'block:4': row,
    },
  )
  table = scaling_report.report(result, str(tmp_path), 'scaling')
  assert '1.100x (1.120-1.300)' in table and '1.400x (1.050-1.300)' in table
  assert os.path.getsize(tmp_path / 'scaling.png') > 0


def test_paired_comparison_of_seeds():
  # Differences 0.1, 0.2, 0.3 over a reference of mean 2: mean 0.2, s = 0.1, t(0.975, 2)
  # = 4.3026527 (8 digits: the tolerance), relative to the reference's mean.
  result = paired.compare({0: 2.1, 1: 2.2, 2: 2.3}, {0: 2.0, 1: 2.0, 2: 2.0, 3: 9.0})
  assert result['seeds'] == [0, 1, 2]
  np.testing.assert_allclose(result['difference'], 0.2, rtol=1e-12)
  half = 4.3026527 * 0.1 / np.sqrt(3)
  np.testing.assert_allclose(result['t_interval'], [0.2 - half, 0.2 + half], rtol=1e-7)
  np.testing.assert_allclose(result['relative'], 0.1, rtol=1e-12)
  assert np.isnan(paired.t_interval([0.5])).all()  # one pair: no spread measured


@pytest.mark.parametrize('ladder', ladders.LADDERS.values(), ids=list(ladders.LADDERS))
def test_the_ladder_follows_one_token_rule(ladder):
  # Tokens per non-embedding parameter are the same at every rung (up to rounding the
  # steps to integers: half a step), and the residuals of a rung differ
  # in their residual only.
  for width in ladder.widths:
    steps = ladder.train_overrides(width)['train.num_steps']
    tokens = steps * ladder.batch_tokens
    rule = ladder.tokens_per_param * ladder.params(width)
    assert abs(tokens - rule) <= ladder.batch_tokens / 2
    standard, block = (
      ladder_config(ladder.run(mode, width), width, ladder) for mode in ladder.compared
    )
    assert standard.model.d_model == block.model.d_model == width
    assert standard.model.num_layers == block.model.num_layers == ladder.layers(width)
    assert standard.train.num_steps == block.train.num_steps == steps
  if ladder.blocks is not None:  # N blocks at every depth: S = 2L / N
    for width in ladder.widths:
      block = ladder_config(ladder.run('block', width), width, ladder)
      assert block.model.block_size * ladder.blocks == 2 * ladder.layers(width)


@pytest.mark.parametrize('ladder', ladders.LADDERS.values(), ids=list(ladders.LADDERS))
def test_the_rule_counts_the_models_non_embedding_parameters(ladder):
  # Ladder.params is the standard model's parameter count less the embedding table
  # (tied) and the RMSNorm gains (two per layer and the final one), at the deepest rung.
  width = ladder.widths[-1]
  config = ladder_config(ladder.run('standard', width), width, ladder)
  # Abstract: shapes only, nothing initialised or compiled.
  model = nnx.eval_shape(lambda: model_lib.Transformer(config.model, rngs=nnx.Rngs(0)))
  total = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
  norms = (2 * config.model.num_layers + 1) * width
  assert total - config.model.vocab_size * width - norms == ladder.params(width)


def test_the_gpu_ladder_trains_at_tiny_size(tfds_dir, tmp_path):
  # The 10x ladder's deepest rung's model (10 layers, Block with N = 4 blocks: S = 5)
  # and its train fields, at a tiny width, batch and step count: the variant a GPU
  # host runs is a valid run config end to end (train, checkpoint, held-out eval).
  ladder = ladders.OPTIMAL_10X
  width = ladder.widths[-1]
  config = ladder_config(ladder.run('block', width), width, ladder)
  assert (config.model.num_layers, config.model.block_size) == (10, 5)
  assert config.train.batch_size == 64
  config.model.update(d_model=16, num_heads=2, mlp_dim=48)
  config.data.tfds_data_dir = tfds_dir
  config.train.update(batch_size=2, seq_len=16, num_steps=2, warmup_steps=1)
  config.train.update(checkpoint_every=2, max_eval_batches=1, log_every=1)
  result = loop_lib.train_and_evaluate(config, str(tmp_path))
  assert np.isfinite(result.train_loss)
  assert os.path.exists(tmp_path / train.EVAL_FINAL_JSON)
