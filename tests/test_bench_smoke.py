"""Smoke runs of the benchmarks at tiny settings: they run and write valid records."""

import importlib.util
import json
import math
import os
import subprocess
import sys

from absl import flags
from absl.testing import flagsaver

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load(name):
  spec = importlib.util.spec_from_file_location(
      f'bench_{name}', os.path.join(ROOT, 'bench', f'{name}.py'))
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
  with flagsaver.flagsaver(sizes=['64x2'], batches=['2'], prompt_len=8, new_tokens=4,
                           repeats=2, num_blocks=2,
                           variants=['standard', 'block_two_phase'],
                           jsonl_out=str(out), table_out=str(table)):
    decode_bench.main([])
  rows = _read_jsonl(out)
  assert [r['mode'] for r in rows] == ['standard', 'block_two_phase']
  for row in rows:
    assert row['batch'] == 2 and row['prefill_len'] == 8 and row['size'] == '64x2'
    assert row['step_compilations'] == 1
    for key in ('per_token_ms', 'prefill_tokens_per_s', 'per_token_ratio',
                'prefill_time_ratio'):
      assert math.isfinite(row[key]) and row[key] > 0, key
    for key in ('jax_version', 'backend', 'timestamp', 'git_commit'):
      assert row[key], key
  assert rows[0]['per_token_ratio'] == 1.0
  assert rows[1]['block_size'] == 2
  assert 'block_two_phase' in table.read_text()


def test_memory_benchmark_smoke(tmp_path):
  # A subprocess: bench/memory.py's flag names (batch_size, ...) clash with eval.py's.
  out = tmp_path / 'memory.jsonl'
  subprocess.run(
      [sys.executable, os.path.join(ROOT, 'bench', 'memory.py'), '--layers=1',
       '--modes=block:2', '--d_model=64', '--seq_len=8', '--batch_size=2', '--steps=1',
       f'--out={out}'],
      check=True, cwd=ROOT, timeout=120,
      env={**os.environ, 'PYTHONPATH': ROOT + os.pathsep + os.environ.get('PYTHONPATH', '')})
  (row,) = _read_jsonl(out)
  assert row['mode'] == 'block:2' and row['num_layers'] == 1
  assert row['temp_bytes'] > 0 and row['step_s'] > 0 and math.isfinite(row['loss'])
