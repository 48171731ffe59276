"""Metric writers: TensorBoard event files (tensorboardX) and `metrics.jsonl`.

One JSONL record per `write_scalars` call: {"step": s, "<tag>": value, ...}, with the
same tags as TensorBoard ('train/loss', 'eval/bits_per_byte', ...). Only process 0
writes; the other processes get a writer that does nothing.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping

import tensorboardX

JSONL = 'metrics.jsonl'
LN2 = math.log(2.0)


def bits_per_byte(loss_nats_per_token: float, bytes_per_token: float = 1.0) -> float:
  """Bits per byte from a mean loss in nats per token (1 byte per token for bytes)."""
  return loss_nats_per_token / LN2 / bytes_per_token


class MetricWriter:
  """Writes scalars to TensorBoard (`<workdir>/tensorboard`) and `<workdir>/metrics.jsonl`."""

  def __init__(self, workdir: str, *, enabled: bool = True):
    self.enabled = enabled
    self.jsonl_path = os.path.join(workdir, JSONL)
    self._tb = None
    self._jsonl = None
    if enabled:
      self._tb = tensorboardX.SummaryWriter(os.path.join(workdir, 'tensorboard'))
      self._jsonl = open(self.jsonl_path, 'a', encoding='utf-8')

  def write_scalars(self, step: int, scalars: Mapping[str, float]) -> None:
    if not self.enabled:
      return
    record = {'step': int(step)}
    for tag, value in scalars.items():
      value = float(value)
      record[tag] = value if math.isfinite(value) else str(value)
      self._tb.add_scalar(tag, value, int(step))
    self._jsonl.write(json.dumps(record) + '\n')
    self._jsonl.flush()

  def flush(self) -> None:
    if self.enabled:
      self._tb.flush()
      self._jsonl.flush()

  def close(self) -> None:
    if self.enabled:
      self._tb.close()
      self._jsonl.close()
      self.enabled = False

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()


def read_jsonl(workdir: str) -> list[dict]:
  """All records of `<workdir>/metrics.jsonl` (empty if there is none)."""
  path = os.path.join(workdir, JSONL)
  if not os.path.exists(path):
    return []
  with open(path, encoding='utf-8') as f:
    return [json.loads(line) for line in f if line.strip()]


def truncate_jsonl(workdir: str, after_step: int) -> None:
  """Drops records of steps > `after_step`: a resumed run re-logs them."""
  records = read_jsonl(workdir)
  kept = [r for r in records if r['step'] <= after_step]
  if len(kept) == len(records):
    return
  path = os.path.join(workdir, JSONL)
  tmp = path + '.tmp'
  with open(tmp, 'w', encoding='utf-8') as f:
    f.writelines(json.dumps(r) + '\n' for r in kept)
  os.replace(tmp, path)
