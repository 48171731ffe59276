"""bench/gap.py pairs runs by seed across the studies of each training length;
bench/lr_check.py reads a ladder's rungs at several learning rates."""

import json

import numpy as np

from attnres_jax.training import step as train
from bench import gap
from bench import lr_check
from configs import ladders


def test_gap_pairs_seeds_and_takes_a_run_from_the_first_file(tmp_path):
  old = tmp_path / 'old.jsonl'  # one seed of each, the older study
  old.write_text(
    '\n'.join(
      json.dumps(dict(run=run, bits_per_byte=[v]))
      for run, v in (('standard', 2.0), ('full', 1.9), ('block_s4', 1.0))
    )
  )
  new = tmp_path / 'new.json'  # seeds 0 and 2 finished of the newer study
  new.write_text(
    json.dumps(
      [
        dict(run='standard', bits_per_byte=[2.0, 2.2], seed_ids=[0, 2]),
        dict(run='block_s4', bits_per_byte=[1.9, 2.0], seed_ids=[0, 2]),
      ]
    )
  )
  by_length = gap.collect([f'1200:{new}', f'1200:{old}', f'300:{old}'])
  assert by_length[1200]['block_s4'] == {0: 1.9, 2: 2.0}  # the first file wins
  assert by_length[1200]['full'] == {0: 1.9}  # only the older file has it
  rows = gap.analyse(by_length, ['full', 'block_s4'], 'standard')
  block = next(r for r in rows if r['steps'] == 1200 and r['run'] == 'block_s4')
  # Paired differences -0.1 and -0.2 over a reference mean of 2.1.
  np.testing.assert_allclose(block['vs_reference']['relative'], -0.15 / 2.1, rtol=1e-12)
  table = gap.markdown(rows, 'standard')
  assert '| 1200 | full | 0 | 1.9000 +- n/a | -5.00% (one seed: no interval) |' in table
  assert '| 300 | block_s4 | 0 |' in table
  gap.plot(rows, 'standard', str(tmp_path / 'gap.png'))
  assert (tmp_path / 'gap.png').stat().st_size > 0


def test_lr_check_reads_each_rate_and_compares_at_the_best(tmp_path):
  ladder = ladders.OPTIMAL
  losses = {  # (rate, residual) -> bits per byte at d = 24; Block is best at 0.006
    ('0.0015', 'standard'): 3.4,
    ('0.003', 'standard'): 3.3,
    ('0.006', 'standard'): 3.35,
    ('0.003', 'block'): 3.28,
    ('0.006', 'block'): 3.2,
  }
  for (rate, residual), value in losses.items():
    run = tmp_path / rate / ladder.run(residual, 24) / 'seed_0'
    run.mkdir(parents=True)
    (run / train.EVAL_FINAL_JSON).write_text(json.dumps({'bits_per_byte': value}))
  rates = [(r, str(tmp_path / r)) for r in ('0.0015', '0.003', '0.006')]
  values = lr_check.collect(ladder, [24, 40], 0, rates)
  assert list(values) == [24]  # nothing at d = 40
  assert values[24]['block'] == {'0.003': 3.28, '0.006': 3.2}
  table = lr_check.markdown(ladder, values, [r for r, _ in rates], '0.003')
  assert '| 24, 4 | standard | 3.4000 | 3.3000 | 3.3500 | 0.003 |  |  |' in table
  # At the default rate -0.02; at each best rate 3.2 - 3.3 = -0.1.
  assert '| 24, 4 | block | - | 3.2800 | 3.2000 | 0.006 | -0.0200 | -0.1000 |' in table
