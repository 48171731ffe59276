"""One run, end to end (`eval.py`): held-out metrics and the paper's analysis in one
evaluation pass, figures, and comparisons of several runs.

`evaluate_and_analyze` restores a checkpoint, evaluates it over the eval split with
`evaluate.eval_sums(collect_stats=True)` (loss, bits per byte and the depth
statistics from the same forward pass), adds the gradient norms
(`evaluation/statistics.py`) and writes eval.json, analysis.npz and the figures
(`evaluation/plots.py`). `compare_runs` overlays several runs' loss curves and
magnitude profiles and tabulates their evaluations.
"""

from __future__ import annotations

import io
import json
import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np
from flax import nnx

from attnres_jax import residuals
from attnres_jax.data import pipeline as data_lib
from attnres_jax.evaluation import evaluate as evaluate_lib
from attnres_jax.runs import records
from attnres_jax.evaluation import plots
from attnres_jax.evaluation import statistics
from attnres_jax.models import transformer as model_lib
from attnres_jax.runs import checkpointing
from attnres_jax.runs import metrics as metrics_lib
from attnres_jax.runs import storage

Batch = Mapping[str, np.ndarray]

EVAL_DIR = 'eval'
EVAL_JSON = 'eval.json'
ANALYSIS_NPZ = 'analysis.npz'
# The final evaluation that training writes into the workdir (training/step.py's
# EVAL_FINAL_JSON; training sits above this package).
EVAL_FINAL_JSON = 'eval_final.json'


# -- one model ------------------------------------------------------------------------


def write_analysis(
  arrays: Mapping[str, np.ndarray], cfg, out_dir: str, *, title: str | None = None
) -> list[str]:
  """analysis.npz and the figures of one model's statistics; returns the paths."""
  arrays = dict(arrays)
  residual = residuals.make(cfg)
  if 'depth_weights' in residual.figures:
    arrays['valid_sources'] = statistics.valid_source_mask(cfg)[0]
  with storage.staged(out_dir) as local:  # gs://: written here, then uploaded
    files = [os.path.join(local, ANALYSIS_NPZ)]
    np.savez(files[0], **arrays)
    name = (f'{title}: ' if title else '') + residual.label
    files.append(
      plots.plot_magnitudes(
        arrays,
        cfg,
        os.path.join(local, 'magnitudes.png'),
        f'{name}: magnitudes across depth',
      )
    )
    files.append(
      plots.plot_grad_norms(
        arrays['grad_norm'],
        cfg,
        os.path.join(local, 'grad_norms.png'),
        f'{name}: gradient norm per sublayer',
      )
    )
    for figure in residual.figures:  # e.g. AttnRes depth weights, HC/mHC streams
      draw, suffix = plots.FIGURES[figure]
      files.append(draw(arrays, cfg, os.path.join(local, f'{figure}.png'), name + suffix))
  return [os.path.join(out_dir, os.path.basename(f)) for f in files]


def analyze(
  model: nnx.Module,
  batches: Iterable[Batch] | Callable[[], Iterable[Batch]],
  out_dir: str,
  *,
  max_batches: int | None = None,
  grad_batches: int | None = 8,
  title: str | None = None,
) -> dict[str, Any]:
  """Held-out metrics, statistics, gradient norms, figures and `analysis.npz` of one
  model in `out_dir`: the one analysis path (`eval.py`, notebooks, benchmarks).

  `batches`: eval batches, or a function returning a fresh pass over them; they are
  read twice: once for the evaluation and the statistics (at most `max_batches`),
  once for the gradients (the first `grad_batches`).
  Returns {'metrics': held-out metrics, 'arrays': the saved arrays, 'files': paths}.
  """
  if not callable(batches):
    kept = list(batches) if iter(batches) is batches else batches
    batches = lambda: kept
  metrics = evaluate_lib.evaluate_model(
    model, batches(), collect_stats=True, max_batches=max_batches
  )
  arrays = metrics.pop('stats')
  arrays.update(statistics.gradient_norms(model, batches(), max_batches=grad_batches))
  files = write_analysis(arrays, model.cfg, out_dir, title=title)
  return {'metrics': metrics, 'arrays': arrays, 'files': files}


def eval_dir(workdir: str, step: int) -> str:
  """Where `eval.py` writes the evaluation of `workdir`'s checkpoint `step`."""
  return os.path.join(workdir, EVAL_DIR, f'step_{step}')


def latest_eval_dir(workdir: str) -> str | None:
  """The evaluation directory of the highest evaluated step, or None."""
  root = os.path.join(workdir, EVAL_DIR)
  steps = [
    int(name[5:])
    for name in storage.listdir(root)
    if name.startswith('step_')
    and name[5:].isdigit()
    and storage.exists(os.path.join(root, name, EVAL_JSON))
  ]
  return eval_dir(workdir, max(steps)) if steps else None


def read_metrics(workdir: str) -> list[dict[str, Any]]:
  """The records of `<workdir>/metrics.jsonl`, non-finite values ('nan') as floats."""

  def number(key, value):
    if key != 'step' and isinstance(value, str):
      try:
        return float(value)
      except ValueError:
        return value
    return value

  return [
    {k: number(k, v) for k, v in record.items()}
    for record in metrics_lib.read_jsonl(workdir)
  ]


# -- comparing runs -----------------------------------------------------------------


TABLE_COLUMNS = (  # (title, eval.json key, format)
  ('run', 'run', '{}'),
  ('residual', 'residual', '{}'),
  ('S', 'block_size', '{}'),
  ('step', 'step', '{:d}'),
  ('params', 'num_params', '{:,d}'),
  ('held-out loss', 'loss', '{:.4f}'),
  ('bits/byte', 'bits_per_byte', '{:.4f}'),
  ('perplexity', 'perplexity', '{:.4f}'),
  ('eval tokens', 'num_tokens', '{:,d}'),
)


def _cell(value, fmt: str) -> str:
  if value is None:
    return '-'
  if fmt.endswith('d}'):
    value = int(value)
  return fmt.format(value)


def markdown_table(rows: Sequence[Mapping[str, Any]]) -> str:
  """A markdown table of held-out results, one row per run (missing values: '-')."""
  header = '| ' + ' | '.join(column[0] for column in TABLE_COLUMNS) + ' |'
  rule = (
    '|' + '|'.join('---' if i < 3 else '---:' for i in range(len(TABLE_COLUMNS))) + '|'
  )
  lines = [header, rule]
  for row in rows:
    cells = [_cell(row.get(key), fmt) for _, key, fmt in TABLE_COLUMNS]
    if row.get('whole_split') is False:
      cells[-1] += ' (partial)'
    lines.append('| ' + ' | '.join(cells) + ' |')
  return '\n'.join(lines) + '\n'


def run_name(workdir: str) -> str:
  return os.path.basename(os.path.normpath(workdir))


def training_eval_record(workdir: str) -> dict[str, Any] | None:
  """The final evaluation of training (`eval_final.json`) with the table's fields
  that training does not write, from the run's config (residual, block size,
  parameter count, whole split); None if training wrote none."""
  path = os.path.join(workdir, EVAL_FINAL_JSON)
  if not storage.exists(path):
    return None
  record = records.read_json(path)
  config = checkpointing.load_config(workdir)
  abstract = nnx.eval_shape(lambda: model_lib.Transformer(config.model, rngs=nnx.Rngs(0)))
  record.update(
    residual=abstract.cfg.residual,
    block_size=None,
    num_params=int(model_lib.count_params(abstract)),
    whole_split=config.train.get('max_eval_batches') is None,
  )
  record.update(abstract.residual.describe())
  return record


def latest_record(workdir: str) -> tuple[dict[str, Any] | None, str | None]:
  """(the latest evaluation of a run, its eval.py directory or None): eval.py's
  latest, or training's final one where that is of a later step or the only one."""
  latest = latest_eval_dir(workdir)
  record = records.read_json(os.path.join(latest, EVAL_JSON)) if latest else None
  final = training_eval_record(workdir)
  if final is not None and (record is None or final['step'] > record['step']):
    return final, None
  return record, latest


def compare_runs(
  workdirs: Sequence[str], out_dir: str, *, names: Sequence[str] | None = None
) -> str:
  """Overlays several runs and tabulates their latest evaluations (`eval.py`'s, or
  training's final one, `latest_record`).

  Writes `loss_curves.png` (from each run's metrics.jsonl), `magnitudes.png` (from
  each run's latest analysis.npz) and `compare.md` into `out_dir`; returns the table.
  Runs without an evaluation still get their loss curves and a row of dashes.
  """
  names = list(names) if names is not None else [run_name(w) for w in workdirs]
  if len(names) != len(workdirs):
    raise ValueError('names and workdirs differ in length.')
  if len(set(names)) != len(names):  # e.g. runs/a/1 and runs/b/1: use the full paths
    names = [os.path.normpath(w) for w in workdirs]
  curves, magnitudes, rows = {}, {}, []
  for name, workdir in zip(names, workdirs):
    curves[name] = read_metrics(workdir)
    row: dict[str, Any] = {'run': name}
    record, latest = latest_record(workdir)
    row.update(record or {}, run=name)
    if latest is not None:
      npz = os.path.join(latest, ANALYSIS_NPZ)
      if storage.exists(npz):
        with np.load(io.BytesIO(storage.read_bytes(npz))) as data:
          magnitudes[name] = {k: data[k] for k in data.files}
    rows.append(row)
  table = markdown_table(rows)
  with storage.staged(out_dir) as local:  # gs://: written here, then uploaded
    plots.plot_loss_curves(curves, os.path.join(local, 'loss_curves.png'))
    plots.plot_magnitude_overlay(magnitudes, os.path.join(local, 'magnitudes.png'))
    with open(os.path.join(local, 'compare.md'), 'w', encoding='utf-8') as f:
      f.write(table)
  return table


# -- one run, end to end (eval.py) ----------------------------------------------------


def evaluate_and_analyze(
  workdir: str,
  step: int | None = None,
  *,
  output_dir: str | None = None,
  batch_size: int | None = None,
  max_eval_batches: int | None = None,
  grad_batches: int | None = 16,
) -> dict[str, Any]:
  """Restores `workdir`'s checkpoint `step` (default latest), evaluates it on the whole
  eval split and writes eval.json, analysis.npz and the figures.

  Output: `output_dir`, default `<workdir>/eval/step_<step>/`. The eval batches are
  those of training (`config.train.seq_len`, batch size `config.train.batch_size`
  unless `batch_size` is given). `max_eval_batches` limits the metrics and statistics
  to the first batches (default: the whole split; eval.json records `whole_split`).
  Returns the eval.json record.
  """
  start = time.perf_counter()
  model, config, step = checkpointing.restore_model(workdir, step)
  tc = config.train
  datasets = data_lib.build_datasets(
    config.data,
    seq_len=tc.seq_len,
    global_batch_size=batch_size or tc.batch_size,
    seed=tc.seed,
    process_index=0,
    process_count=1,
    workdir=workdir,
  )
  out_dir = output_dir or eval_dir(workdir, step)
  name = run_name(workdir)
  result = analyze(
    model,
    datasets.eval_batches,
    out_dir,
    max_batches=max_eval_batches,
    grad_batches=grad_batches,
    title=name,
  )
  metrics, arrays, files = result['metrics'], result['arrays'], result['files']
  cfg = config.model
  record = dict(
    metrics,
    run=name,
    workdir=storage.absolute(workdir),
    step=int(step),
    dataset=config.data.name,
    split=config.data.eval_split,
    whole_split=max_eval_batches is None,
    split_tokens=int(datasets.num_eval_tokens),
    seq_len=int(tc.seq_len),
    batch_size=int(batch_size or tc.batch_size),
    residual=cfg.residual,
    block_size=None,
    num_layers=int(cfg.num_layers),
    d_model=int(cfg.d_model),
    num_params=int(model_lib.count_params(model)),
    grad_tokens=float(arrays['grad_tokens']),
    files=[os.path.basename(f) for f in files],
    seconds=time.perf_counter() - start,
  )
  record.update(model.residual.describe())  # e.g. the AttnRes block size
  if record['whole_split'] and record['num_tokens'] != record['split_tokens']:
    raise AssertionError(
      f'Evaluated {record["num_tokens"]} tokens but the split has '
      f'{record["split_tokens"]}: the eval batches do not cover the split exactly.'
    )
  storage.write_text(os.path.join(out_dir, EVAL_JSON), json.dumps(record, indent=2))
  return record
