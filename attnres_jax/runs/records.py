"""Reading a run's records: JSON files (`config.json`, `eval.json`, `eval_final.json`)
and JSON-lines files (`metrics.jsonl`, `config_history.jsonl`).

A JSON-lines file is appended to, a record at a time, so a run killed or stopped by a
full disk in the middle of an append leaves its last line cut off. That line is
dropped with one warning naming the file and the step it held: the record belongs to
a step after the last checkpoint (or to an evaluation a resumed run redoes), so the
resumed run writes it again. A line that does not parse anywhere else is damage no
write of ours can leave, and is refused in one line naming the file and the line.
"""

from __future__ import annotations

import json
import re
from typing import Any

from absl import logging

from attnres_jax.runs import storage

_STEP = re.compile(r'"step":\s*(\d+)')
_warned: set[tuple[str, str]] = set()  # (path, cut-off line): warned once per process


class RecordError(ValueError):
  """A run record that does not parse (one line naming the file and where)."""


def read_json(path: str) -> Any:
  """The JSON value in `path`; RecordError naming the file if it does not parse."""
  text = storage.read_text(path)
  try:
    return json.loads(text)
  except ValueError as e:
    raise RecordError(f'{path} is damaged ({e}); it is not a JSON record.') from None


def read_jsonl(path: str, *, say=None) -> tuple[list[dict], bool]:
  """(records, cut_off) of the JSON-lines file `path` ([] if there is none).

  A last line that does not parse is cut off: dropped, with one warning (through
  `say`, default a log warning) naming the file and the step it held; `cut_off` says
  so, for a writer that rewrites the file. Any other line that does not parse, or that
  holds no JSON object, raises RecordError naming the file and the line.
  """
  if not storage.exists(path):
    return [], False
  lines = storage.read_text(path).split('\n')
  numbered = [(i, line) for i, line in enumerate(lines, 1) if line.strip('\0 \t\r')]
  records = []
  for position, (number, line) in enumerate(numbered):
    try:
      record = json.loads(line)
      if not isinstance(record, dict):
        raise ValueError(f'a JSON {type(record).__name__}, not an object')
    except ValueError as e:
      if position < len(numbered) - 1:
        raise RecordError(
          f'{path} is damaged at line {number} of {len(lines)} ({e}): only a cut-off '
          'last line can be left by a stopped run; repair or remove that line.'
        ) from None
      _warn_cut_off(path, line, say)
      return records, True
    records.append(record)
  return records, False


def _warn_cut_off(path: str, line: str, say) -> None:
  if (path, line) in _warned:
    return
  _warned.add((path, line))
  step = _STEP.search(line)
  held = f'step {step.group(1)}' if step else 'an unknown step'
  message = (
    f'WARNING: the last line of {path} is cut off (a write that was interrupted); '
    f'dropping it (it held {held}).'
  )
  if say is None:
    logging.warning(message)
  else:
    say(message)


def append_jsonl(path: str, record: dict, *, say=None) -> None:
  """Appends `record` as one line to `path`; a cut-off last line (see `read_jsonl`)
  is dropped first, so that the new record does not continue it."""
  line = json.dumps(record, sort_keys=True) + '\n'
  if storage.exists(path):
    records, cut_off = read_jsonl(path, say=say)
    if cut_off:
      kept = ''.join(json.dumps(r, sort_keys=True) + '\n' for r in records)
      storage.write_text(path, kept + line)
      return
  storage.append_text(path, line)
