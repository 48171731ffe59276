"""Smoke runs of the benchmarks at tiny settings: they run and write valid records."""

import importlib.util
import json
import math
import os
import shutil

from absl import flags
from absl.testing import flagsaver
from conftest import run_script

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _load(name):
  spec = importlib.util.spec_from_file_location(
    f'bench_{name}', os.path.join(ROOT, 'bench', f'{name}.py')
  )
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


decode_bench = _load('decode')  # defines its absl flags once, at import


def _read_jsonl(path):
  with open(path) as f:
    return [json.loads(line) for line in f]


def test_decode_benchmark_smoke(tmp_path):
  if not flags.FLAGS.is_parsed():
    flags.FLAGS.mark_as_parsed()
  out = tmp_path / 'decode.jsonl'
  table = tmp_path / 'decode.md'
  # 2 layers = 4 sublayers; num_blocks=2 gives S = 2, a real two-phase block.
  with flagsaver.flagsaver(
    sizes=['64x2'],
    batches=['2'],
    prompt_len=8,
    new_tokens=4,
    repeats=2,
    num_blocks=2,
    modes=['standard', 'block'],
    jsonl_out=str(out),
    table_out=str(table),
  ):
    decode_bench.main([])
  rows = _read_jsonl(out)
  assert [r['mode'] for r in rows] == ['standard', 'block']
  for row in rows:
    assert row['batch'] == 2 and row['prefill_len'] == 8 and row['size'] == '64x2'
    assert row['step_compilations'] == 1
    for key in (
      'per_token_ms',
      'prefill_tokens_per_s',
      'per_token_ratio',
      'prefill_time_ratio',
      'roofline_ms',
      'per_token_over_roofline',
      'read_bandwidth_gb_s',
    ):
      assert math.isfinite(row[key]) and row[key] > 0, key
    for key in ('jax_version', 'backend', 'timestamp', 'git_commit'):
      assert row[key], key
  assert rows[0]['per_token_ratio'] == 1.0
  assert rows[1]['block_size'] == 2
  assert rows[1]['depth_read'] == 'two_phase'
  assert '| block |' in table.read_text()


def test_prefill_memory_benchmark_smoke(tmp_path):
  if not flags.FLAGS.is_parsed():
    flags.FLAGS.mark_as_parsed()
  out = tmp_path / 'prefill_memory.jsonl'
  with flagsaver.flagsaver(prefill_memory=True, quick=True, memory_jsonl_out=str(out)):
    decode_bench.main([])
  rows = _read_jsonl(out)
  assert [(r['mode'], r['prompt_len']) for r in rows] == [
    ('standard', 32),
    ('block', 32),
    ('standard', 64),
    ('block', 64),
  ]
  for row in rows:
    assert row['temp_mib_chunked'] > 0 and row['temp_mib_one_shot'] > 0
    # A chunk of 16 tokens never needs more than the whole prompt in one call.
    assert row['temp_mib_chunked'] <= row['temp_mib_one_shot']


def test_memory_benchmark_smoke(tmp_path):
  # A subprocess: bench/memory.py's flag names (batch_size, ...) clash with eval.py's.
  out = tmp_path / 'memory.jsonl'
  run_script(
    'bench/memory.py',
    '--layers=1',
    '--modes=block:2',
    '--d_model=64',
    '--seq_len=8',
    '--batch_size=2',
    '--steps=1',
    f'--out={out}',
    timeout=120,
  )
  (row,) = _read_jsonl(out)
  assert row['mode'] == 'block:2' and row['num_layers'] == 1
  assert row['temp_bytes'] > 0 and row['step_s'] > 0 and math.isfinite(row['loss'])


def test_memory_io_table_smoke(tmp_path):
  """bench/memory.py --io: the counted model and XLA's bytes accessed per mode."""
  out = tmp_path / 'io.json'
  run_script(
    'bench/memory.py',
    '--io',
    '--layers=1',
    '--modes=standard,hc:2',
    '--d_model=64',
    '--seq_len=8',
    '--batch_size=2',
    f'--io_out={out}',
    timeout=300,
  )
  rows = {row['mode']: row for row in json.load(open(out))}
  assert rows['standard']['total'] == 3.0 and rows['standard']['hlo_total'] == 3.0
  # HC with m = 2 streams, 2 sublayers: counted (2m + 1) + m / L read, (m + 1) + 1 / L.
  assert rows['hc:2']['read'] == 5 + 2 / 2 and rows['hc:2']['write'] == 3 + 1 / 2
  assert rows['hc:2']['hlo_total'] > 3.0  # the streams cost XLA more than one stream


# Every sweep run shrunk to seconds; the data dir is the test's own.
TINY_SWEEP = (
  'model.d_model=16',
  'model.num_heads=2',
  'model.mlp_dim=32',
  'model.num_layers=2',
  'train.seq_len=16',
  'train.batch_size=4',
  'train.num_steps=4',
  'train.warmup_steps=1',
  'train.log_every=2',
  'train.checkpoint_every=2',
  'train.max_eval_batches=2',
)


def _sweep(root, tfds_dir, seeds):
  result = run_script(
    'bench/sweep.py',
    f'--root={root}',
    '--runs=standard,abl_window2',
    f'--seeds={seeds}',
    f'--set=data.tfds_data_dir={tfds_dir}',
    *(f'--set={override}' for override in TINY_SWEEP),
    timeout=600,
    capture_output=True,
    text=True,
  )
  return result.stdout


def test_sweep_runs_resumes_and_reports(tmp_path, tfds_dir):
  root = tmp_path / 'sweep'
  out = _sweep(root, tfds_dir, '0')
  assert '2 runs to train (0 done)' in out and out.count(' ok') == 2
  # A second seed, finished: each run's seed-0 directory copied with another held-out
  # result (training it would prove nothing more), so the report has two seeds to pool.
  for name in ('standard', 'abl_window2'):
    shutil.copytree(root / name / 'seed_0', root / name / 'seed_1')
    final = root / name / 'seed_1' / 'eval_final.json'
    record = json.load(open(final))
    record['bits_per_byte'] += 0.25
    final.write_text(json.dumps(record))
  # Finished runs are skipped; an interrupted one resumes from its last checkpoint.
  resumed = root / 'abl_window2' / 'seed_0'
  os.remove(resumed / 'eval_final.json')
  out = _sweep(root, tfds_dir, '0,1')
  assert '1 runs to train (3 done)' in out and out.count(' ok') == 1
  assert 'abl_window2 seed 0: ' in out
  assert 'Resuming from the checkpoint of step 4' in (resumed / 'train.log').read_text()
  # Evaluated again, it still reports the training loss it logged before.
  logged = [r for r in _read_jsonl(resumed / 'metrics.jsonl') if 'train/loss' in r]
  assert (
    json.load(open(resumed / 'eval_final.json'))['train_loss']
    == (logged[-1]['train/loss'])
  )

  rows = {row['run']: row for row in json.load(open(root / 'results.json'))}
  assert set(rows) == {'standard', 'abl_window2'}
  for name, row in rows.items():
    finals = [
      json.load(open(root / name / f'seed_{seed}' / 'eval_final.json')) for seed in (0, 1)
    ]
    assert row['bits_per_byte'] == [f['bits_per_byte'] for f in finals]
    assert math.isclose(
      row['bits_per_byte_std'],
      abs(finals[0]['bits_per_byte'] - finals[1]['bits_per_byte']) / math.sqrt(2),
      rel_tol=1e-9,
    )
    # Reported from what ran (the overrides), not from the unmodified grid.
    assert (row['d_model'], row['num_layers'], row['num_steps']) == (16, 2, 4)
    assert row['training_flops'] < 1e9
  assert rows['abl_window2']['model']['depth_window'] == 2
  assert math.isclose(
    rows['abl_window2']['vs_standard'],
    rows['abl_window2']['bits_per_byte_mean'] / rows['standard']['bits_per_byte_mean']
    - 1,
  )
  assert (
    rows['standard']['depth_read_share'] == 0 < rows['abl_window2']['depth_read_share']
  )
  table = (root / 'results.md').read_text()
  assert '| abl_window2 | 2 x 16 |' in table
  assert (root / 'loss_vs_compute.png').stat().st_size > 0
  assert (root / 'depth.png').stat().st_size > 0
