"""The paper's analysis of a trained model, as arrays, PNG figures and .npz files.

* Depth-attention weights (paper Fig. 8): sublayer (rows) by source (columns),
  averaged over held-out tokens, for the pre-attention reads, the pre-MLP reads and
  the final read. Sources are buffer slots: slot 0 = token embedding, slot n = block n
  (Full: slot i + 1 = the output of sublayer i). Cells a sublayer cannot read are
  blank.
* Magnitudes across depth (paper Fig. 5): mean over tokens of the RMS of each
  sublayer's raw output and of the hidden state it reads.
* Gradient norm per sublayer (paper Fig. 5): the L2 norm of the gradient of the
  held-out loss (token-weighted mean over the analysed batches) with respect to each
  sublayer's parameters: attention = attention_norm + attention + row 0 of the
  layer's residual parameters (AttnRes query and gain), MLP = mlp_norm + mlp + row 1.
* Entropy (nats) of each sublayer's depth weights, mean over tokens.
* `compare_runs`: loss curves (from `metrics.jsonl`) and magnitude profiles of several
  runs overlaid, and a markdown table of their final held-out metrics.

Padding. The model averages its statistics over every position of a batch, so the
statistics are computed on padding-free rows only: a row is kept when its last target
has weight > 0 (padding is a suffix of the eval stream, so a row containing any
padding has a padded last target). Kept rows are re-batched to the eval batch size.
Rows that end exactly on a document separator are also dropped, which is harmless.
The gradient uses the weights directly, so it sees every batch it is given.
"""

from __future__ import annotations

import functools
import json
import os
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import matplotlib
import matplotlib.ticker
import numpy as np
from flax import nnx

from attnres_jax import config as config_lib
from attnres_jax import depth
from attnres_jax import evaluate as evaluate_lib
from attnres_jax import metrics as metrics_lib

matplotlib.use('Agg')
from matplotlib import pyplot as plt  # pylint: disable=g-import-not-at-top,wrong-import-position

Batch = Mapping[str, np.ndarray]
Batches = Iterable[Batch] | Callable[[], Iterable[Batch]]

EVAL_DIR = 'eval'
EVAL_JSON = 'eval.json'
ANALYSIS_NPZ = 'analysis.npz'
SUBLAYER_NAMES = ('attention', 'MLP')


# -- depth bookkeeping for plots ----------------------------------------------------


def is_attnres(cfg) -> bool:
  return cfg.residual != 'standard'


def valid_source_mask(cfg) -> tuple[np.ndarray, np.ndarray]:
  """Which slots each sublayer reads: bool [num_layers, 2, num_slots], and the final
  read's bool [num_slots] (all slots)."""
  num_sub = config_lib.num_sublayers(cfg)
  size = config_lib.effective_block_size(cfg)
  slots = depth.num_slots(num_sub, size)
  counts = np.array([depth.num_valid_sources(l, size) for l in range(num_sub)])
  mask = np.arange(slots)[None, :] < counts[:, None]
  return mask.reshape(cfg.num_layers, 2, slots), np.ones(slots, bool)


def source_labels(cfg) -> list[str]:
  """Column labels: 'emb', then the sublayer outputs (Full: 'A0', 'M0', ...) or the
  blocks ('B1', 'B2', ...)."""
  num_sub = config_lib.num_sublayers(cfg)
  size = config_lib.effective_block_size(cfg)
  if size == 1:
    return ['emb'] + [f'{"AM"[i % 2]}{i // 2}' for i in range(num_sub)]
  return ['emb'] + [f'B{n}' for n in range(1, depth.num_blocks(num_sub, size) + 1)]


def sublayer_labels(cfg) -> list[str]:
  return [f'{"AM"[i % 2]}{i // 2}' for i in range(config_lib.num_sublayers(cfg))]


# -- batches ------------------------------------------------------------------------


def _reiterable(batches: Batches) -> Callable[[], Iterable[Batch]]:
  """A zero-argument function giving a fresh pass over the batches."""
  if callable(batches):
    return batches
  if iter(batches) is batches:  # a one-shot iterator: keep what it yields
    batches = list(batches)
  return lambda: batches


def padding_free_batches(batches: Iterable[Batch], *,
                         max_batches: int | None = None) -> Iterator[Batch]:
  """Rows whose last target has weight > 0, re-batched to the input batch size.

  Yields at most `max_batches` batches; the last one may be smaller.
  """
  pending: list[dict[str, np.ndarray]] = []
  batch_size, emitted = None, 0

  def take(n):
    rows = pending[:n]
    del pending[:n]
    return {k: np.stack([r[k] for r in rows]) for k in rows[0]}

  for batch in batches:
    batch = {k: np.asarray(batch[k]) for k in ('inputs', 'targets', 'weights')}
    batch_size = batch_size or batch['inputs'].shape[0]
    for r in np.flatnonzero(batch['weights'][:, -1] > 0):
      pending.append({k: v[r] for k, v in batch.items()})
    while len(pending) >= batch_size:
      if max_batches is not None and emitted >= max_batches:
        return
      yield take(batch_size)
      emitted += 1
  if pending and (max_batches is None or emitted < max_batches):
    yield take(len(pending))


# -- statistics ---------------------------------------------------------------------


@functools.partial(jax.jit, static_argnums=0)
def _stats_step(graph, state, inputs_BT):
  _, stats = nnx.merge(graph.graphdef, state)(inputs_BT, collect_stats=True)
  return stats


def collect_statistics(model: nnx.Module, batches: Iterable[Batch], *,
                       max_batches: int | None = None) -> dict[str, np.ndarray]:
  """The model's per-sublayer statistics, averaged over the padding-free eval tokens.

  Returns float64 arrays: input_rms, output_rms [num_layers, 2]; for AttnRes also
  depth_weights [num_layers, 2, num_slots], depth_entropy [num_layers, 2] and
  final_depth_weights [num_slots]; final_input_rms []; num_tokens [].
  """
  graph, state = evaluate_lib.split_model(model)
  per_batch, sizes = [], []  # read back at the end: batches are dispatched ahead
  for batch in padding_free_batches(batches, max_batches=max_batches):
    per_batch.append(_stats_step(graph, state, jnp.asarray(batch['inputs'], jnp.int32)))
    sizes.append(batch['inputs'].size)
  if not per_batch:
    raise ValueError('No padding-free rows to analyse.')
  num_tokens = sum(sizes)
  result = jax.tree.map(
      lambda *xs: sum(np.asarray(x, np.float64) * n for x, n in zip(xs, sizes))
      / num_tokens, *jax.device_get(per_batch))
  result['num_tokens'] = np.asarray(num_tokens, np.float64)
  return result


@functools.partial(jax.jit, static_argnums=0)
def _grad_step(graph, state, inputs_BT, targets_BT, weights_BT):
  def summed_nll(state):
    logits = nnx.merge(graph.graphdef, state)(inputs_BT)
    nll_BT = evaluate_lib.token_nll(logits, targets_BT)
    return jnp.sum(nll_BT * weights_BT)
  return jax.grad(summed_nll)(state), jnp.sum(weights_BT)


def sublayer_grad_norms(layer_grads: Mapping[str, Any]) -> np.ndarray:
  """L2 norms [num_layers, 2] of the per-sublayer parts of the stacked layer grads."""
  g = layer_grads
  groups = (('attention_norm', 'attention'), ('mlp_norm', 'mlp'))
  rows = []
  for which, names in enumerate(groups):
    squares = sum(
        np.sum(np.square(np.asarray(x, np.float64)).reshape(x.shape[0], -1), axis=1)
        for name in names for x in jax.tree.leaves(g[name]))
    # The residual's parameters hold one row per sublayer: [num_layers, 2, ...].
    for x in jax.tree.leaves(g.get('residual')):
      row = np.asarray(x, np.float64)[:, which]
      squares = squares + np.sum(np.square(row).reshape(row.shape[0], -1), axis=1)
    rows.append(np.sqrt(squares))
  return np.stack(rows, axis=1)


def gradient_norms(model: nnx.Module, batches: Iterable[Batch], *,
                   max_batches: int | None = None) -> dict[str, np.ndarray]:
  """Per-sublayer gradient norms [num_layers, 2] of the held-out loss.

  The loss is the token-weighted mean NLL over the first `max_batches` batches.
  """
  graph, state = evaluate_lib.split_model(model)
  total, weight, count = None, None, 0
  for batch in batches:
    if max_batches is not None and count >= max_batches:
      break
    grads, w = _grad_step(graph, state, jnp.asarray(batch['inputs'], jnp.int32),
                          jnp.asarray(batch['targets'], jnp.int32),
                          jnp.asarray(batch['weights'], jnp.float32))
    grads = nnx.to_pure_dict(grads)['layers']
    total = grads if total is None else jax.tree.map(jnp.add, total, grads)
    weight = w if weight is None else weight + w
    count += 1
  weight = 0.0 if weight is None else float(weight)
  if weight <= 0:
    raise ValueError('No batches with weight > 0 for the gradient norms.')
  mean_grads = jax.tree.map(lambda x: np.asarray(x, np.float64) / weight, total)
  return {'grad_norm': sublayer_grad_norms(mean_grads),
          'grad_tokens': np.asarray(weight, np.float64)}


# -- figures ------------------------------------------------------------------------


def _save(fig, path: str) -> str:
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  fig.savefig(path, dpi=120, bbox_inches='tight')
  plt.close(fig)
  return path


def _heatmap(ax, values_RS, mask_RS, row_labels, col_labels, title, vmax):
  masked = np.ma.masked_array(values_RS, mask=~mask_RS)
  cmap = matplotlib.colormaps['viridis'].with_extremes(bad='0.92')
  image = ax.imshow(masked, cmap=cmap, vmin=0.0, vmax=vmax, aspect='auto',
                    interpolation='nearest')
  ax.set_title(title)
  ax.set_xticks(range(len(col_labels)), col_labels, rotation=90 if len(col_labels) > 12
                else 0, fontsize=8)
  ax.set_yticks(range(len(row_labels)), row_labels, fontsize=8)
  ax.set_xlabel('source')
  if values_RS.size <= 256:
    for (r, s), v in np.ndenumerate(values_RS):
      if mask_RS[r, s]:
        ax.text(s, r, f'{v:.2f}', ha='center', va='center', fontsize=6,
                color='white' if v < 0.6 * vmax else 'black')
  return image


def plot_depth_weights(stats: Mapping[str, np.ndarray], cfg, path: str,
                       title: str | None = None) -> str:
  """Heatmaps of the mean depth weights: pre-attention, pre-MLP and final reads."""
  weights = np.asarray(stats['depth_weights'])  # [num_layers, 2, num_slots]
  final = np.asarray(stats['final_depth_weights'])
  mask, final_mask = valid_source_mask(cfg)
  cols = source_labels(cfg)
  vmax = max(float(weights.max()), float(final.max()), 1e-6)
  rows = [f'layer {k}' for k in range(cfg.num_layers)]
  height = 1.5 + 0.35 * cfg.num_layers
  width = max(6.0, 0.45 * len(cols))
  fig, axes = plt.subplots(
      3, 1, figsize=(width, 2 * height + 2.0), layout='constrained',
      gridspec_kw={'height_ratios': [cfg.num_layers, cfg.num_layers, 1.4]})
  _heatmap(axes[0], weights[:, 0], mask[:, 0], rows, cols, 'pre-attention reads', vmax)
  _heatmap(axes[1], weights[:, 1], mask[:, 1], rows, cols, 'pre-MLP reads', vmax)
  image = _heatmap(axes[2], final[None], final_mask[None], ['final'], cols,
                   'final read', vmax)
  for ax in axes[:2]:
    ax.set_xlabel('')
  fig.colorbar(image, ax=list(axes), shrink=0.8, label='mean depth weight')
  fig.suptitle(title or _mode_name(cfg))
  return _save(fig, path)


def _sublayer_axis(ax, cfg, final=False):
  labels = sublayer_labels(cfg) + (['final'] if final else [])
  step = max(1, len(labels) // 16)
  ax.set_xticks(range(0, len(labels), step), labels[::step], fontsize=8)
  ax.set_xlabel('sublayer (A = attention, M = MLP)')


def plot_magnitudes(stats: Mapping[str, np.ndarray], cfg, path: str,
                    title: str | None = None) -> str:
  """RMS of each sublayer's output and of the hidden state it reads, across depth."""
  x = np.arange(config_lib.num_sublayers(cfg))
  fig, ax = plt.subplots(figsize=(7, 4))
  ax.plot(x, np.asarray(stats['output_rms']).reshape(-1), 'o-', label='output RMS')
  ax.plot(x, np.asarray(stats['input_rms']).reshape(-1), 's--', label='input RMS')
  ax.plot([x[-1] + 1], [float(stats['final_input_rms'])], 'k*', markersize=10,
          label='final read RMS')
  ax.set_yscale('log')
  ax.set_ylabel('RMS (mean over tokens)')
  _sublayer_axis(ax, cfg, final=True)
  ax.grid(True, which='both', alpha=0.3)
  ax.legend()
  ax.set_title(title or f'{_mode_name(cfg)}: magnitudes across depth')
  return _save(fig, path)


def plot_grad_norms(grad_norm: np.ndarray, cfg, path: str,
                    title: str | None = None) -> str:
  """Gradient norm of the held-out loss per sublayer, across depth."""
  x = np.arange(config_lib.num_sublayers(cfg))
  fig, ax = plt.subplots(figsize=(7, 4))
  g = np.asarray(grad_norm).reshape(-1)
  ax.plot(x[0::2], g[0::2], 'o-', label='attention')
  ax.plot(x[1::2], g[1::2], 's-', label='MLP')
  if np.all(g > 0):
    ax.set_yscale('log')
  ax.set_ylabel('gradient norm')
  _sublayer_axis(ax, cfg)
  ax.grid(True, which='both', alpha=0.3)
  ax.legend()
  ax.set_title(title or f'{_mode_name(cfg)}: gradient norm per sublayer')
  return _save(fig, path)


def plot_depth_entropy(stats: Mapping[str, np.ndarray], cfg, path: str,
                       title: str | None = None) -> str:
  """Mean entropy of each sublayer's depth weights, against the uniform maximum."""
  x = np.arange(config_lib.num_sublayers(cfg))
  mask, _ = valid_source_mask(cfg)
  fig, ax = plt.subplots(figsize=(7, 4))
  ax.plot(x, np.asarray(stats['depth_entropy']).reshape(-1), 'o-', label='entropy')
  ax.plot(x, np.log(mask.reshape(len(x), -1).sum(-1)), 'k:',
          label='uniform (log #sources)')
  ax.set_ylabel('entropy (nats)')
  _sublayer_axis(ax, cfg)
  ax.grid(True, alpha=0.3)
  ax.legend()
  ax.set_title(title or f'{_mode_name(cfg)}: depth-weight entropy')
  return _save(fig, path)


def _mode_name(cfg) -> str:
  if cfg.residual == 'block':
    return f'Block AttnRes (S={cfg.block_size})'
  return {'standard': 'Standard residual', 'full': 'Full AttnRes'}[cfg.residual]


# -- everything at once -------------------------------------------------------------


def analyze(model: nnx.Module, batches: Batches, out_dir: str, *,
            max_batches: int | None = None, grad_batches: int | None = 8,
            title: str | None = None) -> dict[str, Any]:
  """Statistics, gradient norms, figures and `analysis.npz` of one model in `out_dir`.

  `batches`: eval batches (a sequence, an iterator, or a function returning a fresh
  iterator). Statistics use up to `max_batches` padding-free batches (None: all);
  gradients the first `grad_batches` batches (None: all).

  Returns {'arrays': the saved arrays, 'files': the written paths}.
  """
  cfg = model.cfg
  fresh = _reiterable(batches)
  arrays = collect_statistics(model, fresh(), max_batches=max_batches)
  arrays.update(gradient_norms(model, fresh(), max_batches=grad_batches))
  if is_attnres(cfg):
    mask, _ = valid_source_mask(cfg)
    arrays['valid_sources'] = mask
  os.makedirs(out_dir, exist_ok=True)
  files = [os.path.join(out_dir, ANALYSIS_NPZ)]
  np.savez(files[0], **arrays)
  prefix = f'{title}: ' if title else ''
  files.append(plot_magnitudes(arrays, cfg, os.path.join(out_dir, 'magnitudes.png'),
                               prefix + f'{_mode_name(cfg)}: magnitudes across depth'))
  files.append(plot_grad_norms(arrays['grad_norm'], cfg,
                               os.path.join(out_dir, 'grad_norms.png'),
                               prefix + f'{_mode_name(cfg)}: gradient norm per sublayer'))
  if is_attnres(cfg):
    files.append(plot_depth_weights(arrays, cfg,
                                    os.path.join(out_dir, 'depth_weights.png'),
                                    prefix + _mode_name(cfg)))
    files.append(plot_depth_entropy(arrays, cfg,
                                    os.path.join(out_dir, 'depth_entropy.png'),
                                    prefix + f'{_mode_name(cfg)}: depth-weight entropy'))
  return {'arrays': arrays, 'files': files}


# -- comparing runs -----------------------------------------------------------------


def eval_dir(workdir: str, step: int) -> str:
  """Where `eval.py` writes the evaluation of `workdir`'s checkpoint `step`."""
  return os.path.join(workdir, EVAL_DIR, f'step_{step}')


def latest_eval_dir(workdir: str) -> str | None:
  """The evaluation directory of the highest evaluated step, or None."""
  root = os.path.join(workdir, EVAL_DIR)
  if not os.path.isdir(root):
    return None
  steps = [int(name[5:]) for name in os.listdir(root)
           if name.startswith('step_') and name[5:].isdigit()
           and os.path.exists(os.path.join(root, name, EVAL_JSON))]
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
  return [{k: number(k, v) for k, v in record.items()}
          for record in metrics_lib.read_jsonl(workdir)]


def _loss_series(records: Sequence[Mapping[str, Any]]) -> dict[str, tuple]:
  """{tag: (steps, values)} for every loss-like tag ('train/loss', 'eval/loss', ...)."""
  series: dict[str, tuple[list, list]] = {}
  for record in records:
    for tag, value in record.items():
      name = tag.replace('/', '_')
      if tag == 'step' or not name.endswith('loss') or not isinstance(value, float | int):
        continue
      steps, values = series.setdefault(tag, ([], []))
      steps.append(record['step'])
      values.append(float(value))
  return series


def plot_loss_curves(runs: Mapping[str, Sequence[Mapping[str, Any]]], path: str) -> str:
  """Loss curves of several runs: training solid, held-out dashed, one colour per run."""
  fig, ax = plt.subplots(figsize=(8, 5))
  colors = plt.rcParams['axes.prop_cycle'].by_key()['color']
  for i, (name, records) in enumerate(runs.items()):
    for tag, (steps, values) in sorted(_loss_series(records).items()):
      held_out = 'eval' in tag or 'valid' in tag
      ax.plot(steps, values, '--' if held_out else '-', color=colors[i % len(colors)],
              marker='o' if held_out else None, markersize=3, label=f'{name} {tag}')
  ax.set_xlabel('step')
  ax.set_ylabel('loss (nats per token)')
  ax.grid(True, alpha=0.3)
  if ax.lines:
    ax.legend(fontsize=8)
  ax.set_title('loss curves')
  return _save(fig, path)


def plot_magnitude_overlay(runs: Mapping[str, Mapping[str, np.ndarray]],
                           path: str) -> str:
  """Output RMS and input RMS across depth of several runs (x: relative depth when the
  runs have different depths)."""
  fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
  keys = (('output_rms', 'sublayer output RMS'), ('input_rms', 'sublayer input RMS'),
          ('grad_norm', 'gradient norm'))
  for name, arrays in runs.items():
    for ax, (key, label) in zip(axes, keys):
      if key not in arrays:
        continue
      y = np.asarray(arrays[key]).reshape(-1)
      ax.plot(np.arange(len(y)), y, 'o-', markersize=3, label=name)
      ax.set_title(label)
  for ax in axes:
    if ax.lines and all(np.all(np.asarray(line.get_ydata()) > 0) for line in ax.lines):
      ax.set_yscale('log')
    ax.set_xlabel('sublayer index')
    ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    ax.grid(True, which='both', alpha=0.3)
    if ax.lines:
      ax.legend(fontsize=8)
  return _save(fig, path)


TABLE_COLUMNS = (  # (title, eval.json key, format)
    ('run', 'run', '{}'), ('residual', 'residual', '{}'), ('S', 'block_size', '{}'),
    ('step', 'step', '{:d}'), ('params', 'num_params', '{:,d}'),
    ('held-out loss', 'loss', '{:.4f}'), ('bits/byte', 'bits_per_byte', '{:.4f}'),
    ('perplexity', 'perplexity', '{:.4f}'), ('eval tokens', 'num_tokens', '{:,d}'))


def _cell(value, fmt: str) -> str:
  if value is None:
    return '-'
  if fmt.endswith('d}'):
    value = int(value)
  return fmt.format(value)


def markdown_table(rows: Sequence[Mapping[str, Any]]) -> str:
  """A markdown table of held-out results, one row per run (missing values: '-')."""
  header = '| ' + ' | '.join(column[0] for column in TABLE_COLUMNS) + ' |'
  rule = '|' + '|'.join('---' if i < 3 else '---:' for i in range(len(TABLE_COLUMNS))) + '|'
  lines = [header, rule]
  for row in rows:
    cells = [_cell(row.get(key), fmt) for _, key, fmt in TABLE_COLUMNS]
    if row.get('whole_split') is False:
      cells[-1] += ' (partial)'
    lines.append('| ' + ' | '.join(cells) + ' |')
  return '\n'.join(lines) + '\n'


def run_name(workdir: str) -> str:
  return os.path.basename(os.path.normpath(workdir))


def compare_runs(workdirs: Sequence[str], out_dir: str, *,
                 names: Sequence[str] | None = None) -> str:
  """Overlays several runs and tabulates their latest evaluations (`eval.py` output).

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
    latest = latest_eval_dir(workdir)
    if latest is not None:
      with open(os.path.join(latest, EVAL_JSON), encoding='utf-8') as f:
        row.update(json.load(f))
      row['run'] = name
      npz = os.path.join(latest, ANALYSIS_NPZ)
      if os.path.exists(npz):
        with np.load(npz) as data:
          magnitudes[name] = {k: data[k] for k in data.files}
    rows.append(row)
  os.makedirs(out_dir, exist_ok=True)
  plot_loss_curves(curves, os.path.join(out_dir, 'loss_curves.png'))
  plot_magnitude_overlay(magnitudes, os.path.join(out_dir, 'magnitudes.png'))
  table = markdown_table(rows)
  with open(os.path.join(out_dir, 'compare.md'), 'w', encoding='utf-8') as f:
    f.write(table)
  return table


# -- one run, end to end (eval.py) ----------------------------------------------------


def evaluate_and_analyze(workdir: str, step: int | None = None, *,
                         output_dir: str | None = None, batch_size: int | None = None,
                         max_eval_batches: int | None = None,
                         analysis_batches: int | None = None,
                         grad_batches: int | None = 16) -> dict[str, Any]:
  """Restores `workdir`'s checkpoint `step` (default latest), evaluates it on the whole
  eval split and writes eval.json, analysis.npz and the figures.

  Output: `output_dir`, default `<workdir>/eval/step_<step>/`. The eval batches are
  those of training (`config.train.seq_len`, batch size `config.train.batch_size`
  unless `batch_size` is given). `max_eval_batches` limits the metrics to the first
  batches (default: the whole split; eval.json records `whole_split`).
  Returns the eval.json record.
  """
  # Imported here: they pull in orbax and TFDS, which the plotting functions do not need.
  from attnres_jax import checkpointing  # pylint: disable=g-import-not-at-top
  from attnres_jax import data as data_lib  # pylint: disable=g-import-not-at-top
  from attnres_jax import model as model_lib  # pylint: disable=g-import-not-at-top

  start = time.perf_counter()
  model, config, step = checkpointing.restore_model(workdir, step)
  tc = config.train
  datasets = data_lib.build_datasets(
      config.data, seq_len=tc.seq_len, global_batch_size=batch_size or tc.batch_size,
      seed=tc.seed, process_index=0, process_count=1, workdir=workdir)

  def eval_batches():
    for i, batch in enumerate(datasets.eval_batches()):
      if max_eval_batches is not None and i >= max_eval_batches:
        return
      yield batch

  metrics = evaluate_lib.evaluate(model, eval_batches())
  out_dir = output_dir or eval_dir(workdir, step)
  name = run_name(workdir)
  result = analyze(model, eval_batches, out_dir, max_batches=analysis_batches,
                   grad_batches=grad_batches, title=name)
  cfg = config.model
  record = dict(
      metrics,
      run=name, workdir=os.path.abspath(workdir), step=int(step),
      dataset=config.data.name, split=config.data.eval_split,
      whole_split=max_eval_batches is None,
      split_tokens=int(datasets.num_eval_tokens),
      seq_len=int(tc.seq_len), batch_size=int(batch_size or tc.batch_size),
      residual=cfg.residual,
      block_size=(config_lib.effective_block_size(cfg) if is_attnres(cfg) else None),
      num_layers=int(cfg.num_layers), d_model=int(cfg.d_model),
      num_params=int(model_lib.count_params(model)),
      analysis_tokens=float(result['arrays']['num_tokens']),
      grad_tokens=float(result['arrays']['grad_tokens']),
      files=[os.path.basename(f) for f in result['files']],
      seconds=time.perf_counter() - start,
  )
  if record['whole_split'] and record['num_tokens'] != record['split_tokens']:
    raise AssertionError(
        f'Evaluated {record["num_tokens"]} tokens but the split has '
        f'{record["split_tokens"]}: the eval batches do not cover the split exactly.')
  with open(os.path.join(out_dir, EVAL_JSON), 'w', encoding='utf-8') as f:
    json.dump(record, f, indent=2)
  return record
