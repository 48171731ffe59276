"""Device time by kernel from a `jax.profiler` trace: the summary that
bench/profile_step.py (a training step) and bench/profile_decode.py (a decoding step)
print."""

from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import re
import tempfile

import jax

# The kind of a kernel, from its name: XLA names fusions after their root and kind
# (loop_add_fusion, input_reduce_fusion, gemm_fusion_dot), library kernels after the
# library (cuBLAS/CUTLASS 'gemm', 'xmma'), copies 'copy'/'memcpy'.
KINDS = (
  ('matmul', re.compile(r'gemm|xmma|cutlass|cublas|dot|conv|matmul', re.I)),
  ('collective', re.compile(r'nccl|all-reduce|all_reduce|collective', re.I)),
  ('copy/transpose', re.compile(r'copy|memcpy|memset|transpose', re.I)),
  ('dynamic slice', re.compile(r'dynamic[-_]update[-_]slice|dynamic[-_]slice', re.I)),
  ('reduction', re.compile(r'reduce|softmax|norm', re.I)),
  ('elementwise loop', re.compile(r'loop|fusion|convert|broadcast', re.I)),
)


def kind_of(name: str) -> str:
  for kind, pattern in KINDS:
    if pattern.search(name):
      return kind
  return 'other'


def device_lanes(trace_dir: str) -> dict[str, list[dict]]:
  """The complete events ('X') of the trace's device, by lane: on a GPU, 'kernels'
  (the streams' lanes: each kernel once) and 'hlo_ops' (the derived 'XLA Ops' lane,
  named after the HLO instruction: a fusion, a while loop's body op); on a host
  without a device, 'kernels' holds what XLA's CPU threads ran (nested: they
  overlap)."""
  (path,) = glob.glob(
    os.path.join(trace_dir, '**', '*perfetto_trace.json.gz'), recursive=True
  )
  with gzip.open(path) as f:
    events = json.load(f)['traceEvents']
  meta = [e for e in events if e.get('ph') == 'M']
  processes = {e['pid']: e['args']['name'] for e in meta if e['name'] == 'process_name'}
  threads = {
    (e['pid'], e['tid']): e['args']['name'] for e in meta if e['name'] == 'thread_name'
  }
  device = {pid for pid, name in processes.items() if re.search(r'GPU|TPU', name)}

  def lane(select):
    return [
      e
      for e in events
      if e.get('ph') == 'X'
      and select(e['pid'], threads.get((e['pid'], e.get('tid')), ''))
    ]

  if device:
    print(
      'device lanes:', sorted({t for (pid, _), t in threads.items() if pid in device})
    )
    kernels = lane(lambda pid, thread: pid in device and thread.startswith('Stream'))
    return dict(
      # A trace whose lanes are named otherwise: every device event (may overlap).
      kernels=kernels or lane(lambda pid, thread: pid in device),
      hlo_ops=lane(lambda pid, thread: pid in device and thread == 'XLA Ops'),
    )
  return dict(kernels=lane(lambda pid, thread: thread.startswith('tf_XLA')), hlo_ops=[])


def per_step(events: list[dict], steps: int) -> tuple[collections.Counter, dict]:
  """(microseconds per step by name, calls per step by name)."""
  time_us, calls = collections.Counter(), collections.Counter()
  for e in events:
    time_us[e['name']] += e.get('dur', 0.0)
    calls[e['name']] += 1
  return (
    collections.Counter({name: us / steps for name, us in time_us.items()}),
    {name: count / steps for name, count in calls.items()},
  )


def summarise(lanes: dict[str, list[dict]], steps: int) -> dict:
  """Device milliseconds per step by kernel, by kind of kernel and by HLO op, and the
  kernel launches per step."""
  kernel_us, kernel_calls = per_step(lanes['kernels'], steps)
  by_kind = collections.Counter()
  for name, us in kernel_us.items():
    by_kind[kind_of(name)] += us / 1e3
  op_us, op_calls = per_step(lanes['hlo_ops'], steps)
  return dict(
    device_ms_per_step=sum(kernel_us.values()) / 1e3,
    launches_per_step=sum(kernel_calls.values()),
    by_kind_ms=dict(by_kind.most_common()),
    kernels=[
      dict(name=name, ms_per_step=us / 1e3, calls_per_step=kernel_calls[name])
      for name, us in kernel_us.most_common()
    ],
    hlo_ops=[
      dict(name=name, ms_per_step=us / 1e3, calls_per_step=op_calls[name])
      for name, us in op_us.most_common()
    ],
  )


def traced(run, steps: int) -> dict:
  """`summarise` of `steps` calls of `run` (a function that blocks until its step is
  done), traced with `jax.profiler`."""
  with tempfile.TemporaryDirectory() as trace_dir:
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
      for _ in range(steps):
        run()
    return summarise(device_lanes(trace_dir), steps)


def print_summary(title: str, row: dict, top: int) -> None:
  print(
    f'\n{title}: {row["device_ms_per_step"]:.3f} ms of device time a step, '
    f'{row["launches_per_step"]:.0f} kernel launches',
    flush=True,
  )
  print('  by kind: ' + ', '.join(f'{k} {v:.3f}' for k, v in row['by_kind_ms'].items()))
  for lane in ('kernels', 'hlo_ops'):
    if row[lane]:
      print(f'  top {lane}:')
    for entry in row[lane][:top]:
      print(
        f'  {entry["ms_per_step"]:>8.3f} ms {entry["calls_per_step"]:>6.0f}x  '
        f'{entry["name"][:100]}'
      )


def write_rows(path: str, rows: list[dict]) -> None:
  os.makedirs(os.path.dirname(path) or '.', exist_ok=True)
  with open(path, 'w') as f:
    json.dump(rows, f, indent=1)
  print(f'wrote {len(rows)} records to {path}')
