"""bench/trace_summary.py: the device-time summary of a profiler trace."""

import gzip
import json

from bench import trace_summary
from conftest import run_script


def _write_trace(directory, events):
  run_dir = directory / 'plugins' / 'profile' / 'run'
  run_dir.mkdir(parents=True)
  with gzip.open(run_dir / 'perfetto_trace.json.gz', 'wt') as f:
    json.dump({'displayTimeUnit': 'ns', 'traceEvents': events}, f)


def _lane(pid, tid, process, thread):
  return [
    {'ph': 'M', 'pid': pid, 'name': 'process_name', 'args': {'name': process}},
    {'ph': 'M', 'pid': pid, 'tid': tid, 'name': 'thread_name', 'args': {'name': thread}},
  ]


def _event(pid, tid, name, dur):
  return {'ph': 'X', 'pid': pid, 'tid': tid, 'ts': 0.0, 'dur': dur, 'name': name}


def test_gpu_trace_summary_counts_stream_kernels_per_step(tmp_path):
  # A GPU trace as jax.profiler exports it: the device's stream lane (each kernel
  # once), its derived 'XLA Ops' lane, and host lanes that must not be counted.
  events = (
    _lane(1, 10, '/device:GPU:0', 'Stream #14(Compute,Memset)')
    + _lane(1, 11, '/device:GPU:0', 'XLA Ops')
    + _lane(2, 20, '/host:CPU', 'python')
  )
  for _ in range(2):  # two steps
    events += [
      _event(1, 10, 'gemm_fusion_dot_3', 300.0),
      _event(1, 10, 'input_reduce_fusion_25', 100.0),
      _event(1, 10, 'loop_add_fusion', 50.0),
      _event(1, 10, 'memcpy128', 20.0),
      _event(1, 11, 'input_reduce_fusion.25', 100.0),
      _event(2, 20, 'PjitFunction(train_step)', 5000.0),
    ]
  _write_trace(tmp_path, events)
  summary = trace_summary.summarise(trace_summary.device_lanes(str(tmp_path)), steps=2)
  assert summary['launches_per_step'] == 4
  assert abs(summary['device_ms_per_step'] - 0.47) < 1e-9  # 470 us of kernels a step
  assert summary['by_kind_ms'] == {
    'matmul': 0.3,
    'reduction': 0.1,
    'elementwise loop': 0.05,
    'copy/transpose': 0.02,
  }
  assert [k['name'] for k in summary['kernels']][:2] == [
    'gemm_fusion_dot_3',
    'input_reduce_fusion_25',
  ]
  assert summary['kernels'][0]['calls_per_step'] == 1
  (op,) = summary['hlo_ops']
  assert op['name'] == 'input_reduce_fusion.25' and op['ms_per_step'] == 0.1


def test_profile_step_smoke(tmp_path):
  out = tmp_path / 'profile.json'
  hlo_dir = tmp_path / 'hlo'
  run_script(
    'bench/profile_step.py',
    '--layers=1',
    '--modes=standard,block:2',
    '--d_model=64',
    '--seq_len=8',
    '--batch_size=2',
    '--profile_steps=1',
    f'--out={out}',
    f'--hlo_dir={hlo_dir}',
    timeout=180,
  )
  rows = json.loads(out.read_text())
  assert [r['mode'] for r in rows] == ['standard', 'block:2']
  for row in rows:  # on the CPU: XLA's host threads' events
    assert row['launches_per_step'] > 0 and row['device_ms_per_step'] > 0
    assert row['kernels'] and row['temp_bytes'] > 0
  assert sorted(p.name for p in hlo_dir.iterdir()) == [
    'block:2_1L.txt',
    'standard_1L.txt',
  ]


def test_profile_decode_smoke(tmp_path):
  out = tmp_path / 'profile_decode.json'
  run_script(
    'bench/profile_decode.py',
    '--sizes=64x2',
    '--batches=2',
    '--prompt_len=8',
    '--new_tokens=4',
    '--modes=standard,block:2',
    f'--out={out}',
    timeout=180,
  )
  rows = json.loads(out.read_text())
  assert [(r['mode'], r['batch']) for r in rows] == [('standard', 2), ('block:2', 2)]
  for row in rows:
    assert row['launches_per_step'] > 0 and row['device_ms_per_step'] > 0
