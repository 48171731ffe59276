"""Metric writers: TensorBoard event files (tensorboardX) and `metrics.jsonl`.

One JSONL record per `write_scalars` call: {"step": s, "<tag>": value, ...}, with the
same tags as TensorBoard ('train/loss', 'eval/bits_per_byte', ...). Only process 0
writes; the other processes get a writer that does nothing.

A run that resumes from step s (0: from scratch) re-logs every step after s, so the
writer of that segment first drops them: `metrics.jsonl` keeps the records of steps
<= s, and TensorBoard gets a new event file that starts with a purge of steps > s
(TensorBoard's SessionLog.START). `metrics.jsonl` is flushed at every record; the
TensorBoard events every minute and at every checkpoint, so a killed run can lose its
last ones: the new segment re-writes the records of steps <= s that TensorBoard lacks
from `metrics.jsonl`. Both files are written in the caller's thread: a full disk
raises, never hangs. In a gs:// workdir, where objects cannot be appended to, both
are uploaded whole at each flush (every minute, at every checkpoint and at the end).
`read_tensorboard` reads the scalars back as TensorBoard shows them.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
import time
from collections.abc import Mapping

import jax
from absl import logging
from tensorboard.backend.event_processing import event_accumulator
from tensorboardX import event_file_writer
from tensorboardX.proto import event_pb2
from tensorboardX.proto import summary_pb2

from attnres_jax.runs import records as records_lib
from attnres_jax.runs import storage

JSONL = 'metrics.jsonl'
TENSORBOARD = 'tensorboard'
FLUSH_SECONDS = 60  # how often TensorBoard's events reach the file while a run runs


class MetricsWriteError(OSError):
  """Writing `metrics.jsonl` or the TensorBoard events failed; the run must stop."""


class MetricWriter:
  """Writes scalars to TensorBoard (`<workdir>/tensorboard`) and `<workdir>/metrics.jsonl`.

  Both are written synchronously in the calling thread, so a failing write (a full
  disk) raises OSError at once (tensorboardX's `SummaryWriter` writes from a thread
  that dies on such an error, after which its bounded queue blocks the caller forever).
  """

  def __init__(self, workdir: str, *, enabled: bool = True, resume_step: int = 0):
    """`resume_step`: the step this segment of the run starts after; records of
    later steps, from a segment that died, are dropped."""
    self.enabled = enabled
    self.jsonl_path = os.path.join(workdir, JSONL)
    self._tb = None
    self._jsonl = None
    # gs://: the records, and a local copy of the event file, uploaded whole at each
    # flush (objects cannot be appended to).
    self._remote_lines = self._staging = None
    self._flushed = time.monotonic()
    if enabled:
      truncate_jsonl(workdir, resume_step)
      logdir = os.path.join(workdir, TENSORBOARD)
      storage.makedirs(logdir)
      shown = read_tensorboard(workdir)
      # One event file per segment; the number keeps files of one second (same name
      # prefix) unique and in order, as TensorBoard reads them in name order.
      segment = len(_event_files(logdir))
      if storage.is_remote(workdir):
        self._staging, self._logdir = tempfile.mkdtemp(prefix='tensorboard'), logdir
      self._tb = event_file_writer.EventsWriter(
        os.path.join(self._staging or logdir, 'events'), f'.{segment:04d}'
      )
      # TensorBoard drops the events of steps > resume_step read before this one.
      self._tb.write_event(
        event_pb2.Event(
          step=resume_step + 1,
          wall_time=time.time(),
          session_log=event_pb2.SessionLog(status=event_pb2.SessionLog.START),
        )
      )
      if storage.is_remote(workdir):
        self._remote_lines = [json.dumps(r) + '\n' for r in read_jsonl(workdir)]
      else:
        self._jsonl = open(self.jsonl_path, 'a', encoding='utf-8')
      shown = {
        (tag, step)
        for tag, values in shown.items()
        for step, _ in values
        if step <= resume_step
      }
      for record in read_jsonl(workdir):  # steps <= resume_step, after the truncation
        for tag, value in record.items():
          if tag != 'step' and (tag, record['step']) not in shown:
            self._add_scalar(tag, float(value), record['step'])
      self._flush_events()

  def _flush_events(self) -> None:
    self._tb.flush()
    if self._staging is not None:
      local = self._tb._file_name  # pylint: disable=protected-access
      with open(local, 'rb') as f:
        storage.write_bytes(os.path.join(self._logdir, os.path.basename(local)), f.read())

  def _add_scalar(self, tag: str, value: float, step: int) -> None:
    self._tb.write_event(
      event_pb2.Event(
        step=step,
        wall_time=time.time(),
        summary=summary_pb2.Summary(
          value=[summary_pb2.Summary.Value(tag=tag, simple_value=value)]
        ),
      )
    )

  def write_scalars(self, step: int, scalars: Mapping[str, float]) -> None:
    """Appends one record; raises OSError if a write fails."""
    if not self.enabled:
      return
    record = {'step': int(step)}
    for tag, value in scalars.items():
      value = float(value)
      record[tag] = value if math.isfinite(value) else str(value)
      self._add_scalar(tag, value, int(step))
    if self._remote_lines is not None:
      self._remote_lines.append(json.dumps(record) + '\n')
    else:
      self._jsonl.write(json.dumps(record) + '\n')
      self._jsonl.flush()
    if time.monotonic() - self._flushed > FLUSH_SECONDS:
      self.flush()

  def flush(self) -> None:
    if self.enabled:
      self._flush_events()
      if self._remote_lines is not None:
        storage.write_text(self.jsonl_path, ''.join(self._remote_lines))
      else:
        self._jsonl.flush()
      self._flushed = time.monotonic()

  def close(self, *, failed: bool = False) -> None:
    """Flushes and closes; a failure is logged, not raised. `failed`: the run already
    stopped on an error (a full disk, which then fails this too): logged at INFO only,
    so that the run's one line stays the only one."""
    if not self.enabled:
      return
    report = logging.info if failed else logging.error
    if self._staging is not None:
      try:
        self.flush()
      except Exception as e:  # pylint: disable=broad-except
        report('Uploading the metrics of %s failed: %s', self.jsonl_path, e)
    self.enabled = False
    for closable in (self._tb, self._jsonl):
      try:
        if closable is not None:
          closable.close()
      except OSError as e:
        report('Closing the metrics of %s failed: %s', self.jsonl_path, e)
    if self._staging is not None:
      shutil.rmtree(self._staging, ignore_errors=True)

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close(failed=exc[0] is not None)


def write_jsonl(path: str, records) -> None:
  """One JSON record per line into `path` (its directory created); prints what it wrote.
  For the benchmarks' result files."""
  os.makedirs(os.path.dirname(path) or '.', exist_ok=True)
  with open(path, 'w', encoding='utf-8') as f:
    for record in records:
      f.write(json.dumps(record) + '\n')
  print(f'wrote {len(records)} records to {path}')


def read_jsonl(workdir: str) -> list[dict]:
  """All records of `<workdir>/metrics.jsonl` (empty if there is none). A cut-off last
  line (a write interrupted by a kill or a full disk) is dropped with one warning;
  damage anywhere else raises `records.RecordError` naming the file and the line."""
  return records_lib.read_jsonl(os.path.join(workdir, JSONL), say=say)[0]


def truncate_jsonl(workdir: str, after_step: int) -> None:
  """Drops records of steps > `after_step` (all: 0), which a resumed run re-logs, and
  a cut-off last line."""
  path = os.path.join(workdir, JSONL)
  records, cut_off = records_lib.read_jsonl(path, say=say)
  kept = [r for r in records if r['step'] <= after_step]
  if len(kept) == len(records) and not cut_off:
    return
  storage.write_text(path, ''.join(json.dumps(r) + '\n' for r in kept))


def read_tensorboard(workdir: str) -> dict[str, list[tuple[int, float]]]:
  """{tag: [(step, value), ...]} of `<workdir>/tensorboard`, as TensorBoard shows it.

  Read by TensorBoard's own event accumulator: event files in name order, a resumed
  segment's SessionLog.START at step s drops the events read so far of steps >= s,
  and the truncated tail of a killed run's file is skipped.
  """
  logdir = os.path.join(workdir, TENSORBOARD)
  if not _event_files(logdir):
    return {}
  accumulator = event_accumulator.EventAccumulator(
    logdir, size_guidance={event_accumulator.SCALARS: 0}
  )  # 0: keep every event
  accumulator.Reload()
  return {
    tag: [(e.step, e.value) for e in accumulator.Scalars(tag)]
    for tag in accumulator.Tags()[event_accumulator.SCALARS]
  }


def _event_files(logdir: str) -> list[str]:
  return [n for n in storage.listdir(logdir) if n.startswith('events.out.tfevents.')]


def say(message: str, bar=None) -> None:
  """Logs `message` and prints it on process 0 (above a tqdm progress bar, if any)."""
  logging.info(message)
  if jax.process_index() == 0:
    (bar.write if bar is not None else print)(message)


class IntervalStats:
  """The training steps since the last record: their losses, gradient norms and tokens
  (means go into the record), and the time of the steps that were timed."""

  def __init__(self):
    self.reset()
    self.last_time = None

  def reset(self):
    self.losses, self.grad_norms, self.tokens = [], [], []
    self.timed_steps, self.timed_seconds = 0, 0.0

  def add(self, loss, grad_norm, tokens):
    now = time.perf_counter()
    if self.last_time is not None:  # the first step of a run includes compilation
      self.timed_steps += 1
      self.timed_seconds += now - self.last_time
    self.last_time = now
    self.losses.append(loss)
    self.grad_norms.append(grad_norm)
    self.tokens.append(tokens)

  def pause(self):
    """Excludes host-side work (eval, checkpointing) from the next step time."""
    self.last_time = None
