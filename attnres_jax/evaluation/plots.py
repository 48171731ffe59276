"""Figures of the analysis (arrays from `evaluation/statistics.py`) and of run
comparisons."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import matplotlib
import matplotlib.ticker
import numpy as np

from attnres_jax import config as config_lib
from attnres_jax.evaluation import statistics

matplotlib.use('Agg')
from matplotlib import pyplot as plt  # pylint: disable=wrong-import-position


def _save(fig, path: str) -> str:
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  fig.savefig(path, dpi=120, bbox_inches='tight')
  plt.close(fig)
  return path


def _heatmap(ax, values_RS, mask_RS, row_labels, col_labels, title, vmax):
  masked = np.ma.masked_array(values_RS, mask=~mask_RS)
  cmap = matplotlib.colormaps['viridis'].with_extremes(bad='0.92')
  image = ax.imshow(
    masked, cmap=cmap, vmin=0.0, vmax=vmax, aspect='auto', interpolation='nearest'
  )
  ax.set_title(title)
  ax.set_xticks(
    range(len(col_labels)),
    col_labels,
    rotation=90 if len(col_labels) > 12 else 0,
    fontsize=8,
  )
  ax.set_yticks(range(len(row_labels)), row_labels, fontsize=8)
  ax.set_xlabel('source')
  if values_RS.size <= 256:
    for (r, s), v in np.ndenumerate(values_RS):
      if mask_RS[r, s]:
        ax.text(
          s,
          r,
          f'{v:.2f}',
          ha='center',
          va='center',
          fontsize=6,
          color='white' if v < 0.6 * vmax else 'black',
        )
  return image


def plot_depth_weights(
  stats: Mapping[str, np.ndarray], cfg, path: str, title: str | None = None
) -> str:
  """Heatmaps of the mean depth weights: pre-attention, pre-MLP and final reads."""
  weights = np.asarray(stats['depth_weights'])  # [num_layers, 2, num_slots]
  final = np.asarray(stats['final_depth_weights'])
  mask, final_mask = statistics.valid_source_mask(cfg)
  cols = statistics.source_labels(cfg)
  vmax = max(float(weights.max()), float(final.max()), 1e-6)
  rows = [f'layer {k}' for k in range(cfg.num_layers)]
  height = 1.5 + 0.35 * cfg.num_layers
  width = max(6.0, 0.45 * len(cols))
  fig, axes = plt.subplots(
    3,
    1,
    figsize=(width, 2 * height + 2.0),
    layout='constrained',
    gridspec_kw={'height_ratios': [cfg.num_layers, cfg.num_layers, 1.4]},
  )
  _heatmap(axes[0], weights[:, 0], mask[:, 0], rows, cols, 'pre-attention reads', vmax)
  _heatmap(axes[1], weights[:, 1], mask[:, 1], rows, cols, 'pre-MLP reads', vmax)
  image = _heatmap(
    axes[2], final[None], final_mask[None], ['final'], cols, 'final read', vmax
  )
  for ax in axes[:2]:
    ax.set_xlabel('')
  fig.colorbar(image, ax=list(axes), shrink=0.8, label='mean depth weight')
  fig.suptitle(title or statistics.mode_name(cfg))
  return _save(fig, path)


def _sublayer_axis(ax, cfg, final=False):
  labels = statistics.sublayer_labels(cfg) + (['final'] if final else [])
  step = max(1, len(labels) // 16)
  ax.set_xticks(range(0, len(labels), step), labels[::step], fontsize=8)
  ax.set_xlabel('sublayer (A = attention, M = MLP)')


def _save_sublayer_plot(fig, ax, cfg, path: str, title: str) -> str:
  """Finishes a line plot over sublayers (axis, grid, legend, title) and saves it."""
  _sublayer_axis(ax, cfg)
  ax.grid(True, which='both', alpha=0.3)
  ax.legend()
  ax.set_title(title)
  return _save(fig, path)


def plot_magnitudes(
  stats: Mapping[str, np.ndarray], cfg, path: str, title: str | None = None
) -> str:
  """RMS of each sublayer's output and of the hidden state it reads, across depth."""
  x = np.arange(config_lib.num_sublayers(cfg))
  fig, ax = plt.subplots(figsize=(7, 4))
  ax.plot(x, np.asarray(stats['output_rms']).reshape(-1), 'o-', label='output RMS')
  ax.plot(x, np.asarray(stats['input_rms']).reshape(-1), 's--', label='input RMS')
  ax.plot(
    [x[-1] + 1],
    [float(stats['final_input_rms'])],
    'k*',
    markersize=10,
    label='final read RMS',
  )
  ax.set_yscale('log')
  ax.set_ylabel('RMS (mean over tokens)')
  _sublayer_axis(ax, cfg, final=True)
  ax.grid(True, which='both', alpha=0.3)
  ax.legend()
  ax.set_title(title or f'{statistics.mode_name(cfg)}: magnitudes across depth')
  return _save(fig, path)


def plot_grad_norms(
  grad_norm: np.ndarray, cfg, path: str, title: str | None = None
) -> str:
  """Gradient norm of the held-out loss per sublayer, across depth."""
  x = np.arange(config_lib.num_sublayers(cfg))
  fig, ax = plt.subplots(figsize=(7, 4))
  g = np.asarray(grad_norm).reshape(-1)
  ax.plot(x[0::2], g[0::2], 'o-', label='attention')
  ax.plot(x[1::2], g[1::2], 's-', label='MLP')
  if np.all(g > 0):
    ax.set_yscale('log')
  ax.set_ylabel('gradient norm')
  return _save_sublayer_plot(
    fig,
    ax,
    cfg,
    path,
    title or f'{statistics.mode_name(cfg)}: gradient norm per sublayer',
  )


def plot_depth_entropy(
  stats: Mapping[str, np.ndarray], cfg, path: str, title: str | None = None
) -> str:
  """Mean entropy of each sublayer's depth weights, against the uniform maximum."""
  x = np.arange(config_lib.num_sublayers(cfg))
  mask, _ = statistics.valid_source_mask(cfg)
  fig, ax = plt.subplots(figsize=(7, 4))
  ax.plot(x, np.asarray(stats['depth_entropy']).reshape(-1), 'o-', label='entropy')
  ax.plot(
    x, np.log(mask.reshape(len(x), -1).sum(-1)), 'k:', label='uniform (log #sources)'
  )
  ax.set_ylabel('entropy (nats)')
  return _save_sublayer_plot(
    fig, ax, cfg, path, title or f'{statistics.mode_name(cfg)}: depth-weight entropy'
  )


def plot_streams(
  stats: Mapping[str, np.ndarray], cfg, path: str, title: str | None = None
) -> str:
  """HC/mHC: per-stream magnitudes, read and write weights across depth (from the
  analysis statistics stream_rms, read_weights, write_weights [num_layers, 2, m] and
  final_stream_rms [m])."""
  m, num_sub = cfg.hc_streams, config_lib.num_sublayers(cfg)
  labels = statistics.sublayer_labels(cfg)
  fig, axes = plt.subplots(1, 3, figsize=(16, 4), layout='constrained')
  rms = np.asarray(stats['stream_rms']).reshape(num_sub, m)
  final = np.asarray(stats['final_stream_rms'])
  for i in range(m):
    axes[0].plot(
      range(num_sub + 1), list(rms[:, i]) + [final[i]], 'o-', label=f'stream {i}'
    )
  axes[0].set_yscale('log')
  axes[0].set_xticks(range(num_sub + 1), labels + ['final'], fontsize=7)
  axes[0].set_ylabel('RMS before the sublayer (mean over tokens)')
  axes[0].legend(fontsize=8)
  for ax, key, name in (
    (axes[1], 'read_weights', 'read weights a (stream -> input)'),
    (axes[2], 'write_weights', 'write weights b (output -> stream)'),
  ):
    image = ax.imshow(
      np.asarray(stats[key]).reshape(num_sub, m).T, aspect='auto', cmap='viridis'
    )
    ax.set_xticks(range(num_sub), labels, fontsize=7)
    ax.set_yticks(range(m), [f'stream {i}' for i in range(m)])
    ax.set_title(name)
    fig.colorbar(image, ax=ax)
  fig.suptitle(title or statistics.mode_name(cfg))
  return _save(fig, path)


# The residual-specific figures (`Residual.figures` names): (draw, title suffix).
FIGURES = {
  'depth_weights': (plot_depth_weights, ''),
  'depth_entropy': (plot_depth_entropy, ': depth-weight entropy'),
  'streams': (plot_streams, ': streams across depth'),
}


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
      ax.plot(
        steps,
        values,
        '--' if held_out else '-',
        color=colors[i % len(colors)],
        marker='o' if held_out else None,
        markersize=3,
        label=f'{name} {tag}',
      )
  ax.set_xlabel('step')
  ax.set_ylabel('loss (nats per token)')
  ax.grid(True, alpha=0.3)
  if ax.lines:
    ax.legend(fontsize=8)
  ax.set_title('loss curves')
  return _save(fig, path)


def plot_magnitude_overlay(
  runs: Mapping[str, Mapping[str, np.ndarray]], path: str
) -> str:
  """Output RMS and input RMS across depth of several runs (x: relative depth when the
  runs have different depths)."""
  fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
  keys = (
    ('output_rms', 'sublayer output RMS'),
    ('input_rms', 'sublayer input RMS'),
    ('grad_norm', 'gradient norm'),
  )
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
