"""The compute-multiplier study's report (bench/scaling.py `analyse`'s result): the
per-rung table with its two intervals, the fits and multipliers, and the plot (the
fits over every seed, the multipliers, and the fits' residuals)."""

from __future__ import annotations

import json
import os

import matplotlib

matplotlib.use('Agg')
import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
import numpy as np


def spread(values) -> str:
  """Mean +- sample std over seeds; 'n/a' for the std of one seed."""
  std = f'{np.std(values, ddof=1):.4f}' if len(values) > 1 else 'n/a'
  return f'{np.mean(values):.4f} +- {std}'


def report(result: dict, out: str, name: str) -> str:
  """Writes <out>/<name>.md, .json and .png; returns the markdown."""
  table = markdown_table(result)
  os.makedirs(out, exist_ok=True)
  with open(os.path.join(out, f'{name}.md'), 'w', encoding='utf-8') as f:
    f.write(table + '\n')
  with open(os.path.join(out, f'{name}.json'), 'w', encoding='utf-8') as f:
    json.dump(result, f, indent=1)
  plot(result, os.path.join(out, f'{name}.png'))
  return table


def _interval(low: float, high: float) -> str:
  return 'n/a' if np.isnan(low) else f'{low:+.4f} to {high:+.4f}'


def rung_table(result: dict) -> list[str]:
  """Held-out bits per byte per rung, and each residual's paired difference from the
  reference with its bootstrap and t intervals."""
  reference, pct = result['reference'], result['interval_percent']
  residuals = result['residuals']
  others = [r for r in residuals if r != reference]
  lines = [
    f'Held-out bits per byte (mean +- std over seeds) at each rung; differences paired '
    f'by seed with {pct:g}% intervals: bootstrap over seeds ({result["bootstrap"]} '
    f'resamples) and Student t (n - 1 degrees of freedom).',
    '',
    '| rung (d) | '
    + ' | '.join(f'{r}: FLOPs, bits/byte' for r in residuals)
    + ''.join(f' | {r} - {reference}: bootstrap; t' for r in others)
    + ' | seeds |',
    '|---|' + '---|' * (len(residuals) + len(others)) + '---|',
  ]
  for w in residuals[reference]['points']:
    cells = [
      f'{residuals[r]["points"][w]["flops"]:.3g}, '
      f'{spread(residuals[r]["points"][w]["bits_per_byte"])}'
      for r in residuals
    ]
    cells += [
      f'{p["difference"]:+.4f} ({_interval(*p["difference_interval"])}; '
      f'{_interval(*p.get("difference_t_interval", [np.nan, np.nan]))})'
      for p in (residuals[r]['points'][w] for r in others)
    ]
    seeds = residuals[reference]['points'][w]['seeds']
    lines.append(f'| {w} | ' + ' | '.join(cells) + f' | {", ".join(map(str, seeds))} |')
  return lines


def markdown_table(result: dict) -> str:
  """The per-rung table, then the fits and multipliers, as markdown."""
  reference, pct = result['reference'], result['interval_percent']
  lines = rung_table(result) + [
    '',
    f'| residual | fit L = A C^-alpha: A | alpha ({pct:g}%) | '
    f'alpha - alpha_ref '
    f'({pct:g}%) | fit rms residual '
    f'| compute multiplier over {reference} at the ladder middle, '
    f'C = {result["middle_flops"]:.3g} ({pct:g}%) | at each rung: C, multiplier '
    f'({pct:g}%) |',
    '|---|---|---|---|---|---|---|',
  ]
  for r, row in result['residuals'].items():
    mid = row['multiplier_middle']
    at = '; '.join(
      f'{a["flops"]:.3g}: {a["value"]:.3f}x ({a["low"]:.3f}-{a["high"]:.3f})'
      for a in row['multiplier']
    )
    lines.append(
      f'| {r} | {row["A"]:.4g} | {row["alpha"]:.4f} '
      f'({row["alpha_interval"][0]:.4f}'
      f'-{row["alpha_interval"][1]:.4f}) | {row["alpha_minus_reference"]:+.4f} '
      f'({row["alpha_minus_reference_interval"][0]:+.4f} to '
      f'{row["alpha_minus_reference_interval"][1]:+.4f}) | '
      f'{100 * row["fit_rms_relative_residual"]:.2f}% | **{mid["value"]:.3f}x** '
      f'({mid["interval"][0]:.3f}-{mid["interval"][1]:.3f}) | {at} |'
    )
  return '\n'.join(lines)


def _plot_fits(ax, row: dict, label: str):
  """One residual's seeds (dots), rung means (circles) and fitted line; its colour."""
  pts = sorted(
    (p['flops'], np.mean(p['bits_per_byte']), p['bits_per_byte'])
    for p in row['points'].values()
  )
  color = ax.plot([c for c, _, _ in pts], [m for _, m, _ in pts], 'o', label=label)[0]
  color = color.get_color()
  for c, _, values in pts:
    ax.plot([c] * len(values), values, '.', color=color, alpha=0.5, ms=4)
  grid = np.geomspace(pts[0][0], pts[-1][0], 50)
  ax.plot(
    grid,
    row['A'] * grid ** -row['alpha'],
    '-',
    color=color,
    label=f'{label}: {row["A"]:.3g} C^-{row["alpha"]:.4f}',
  )
  return color


def plot(result: dict, path: str) -> None:
  """The fits over the seeds' points, the multipliers with their intervals, and the
  fits' residuals (log L - log fit, every seed)."""
  reference, pct = result['reference'], result['interval_percent']
  fig, axes = plt.subplots(1, 3, figsize=(17, 4.5))
  for r, row in result['residuals'].items():
    color = _plot_fits(axes[0], row, r)
    m = row['multiplier']
    # The interval is drawn from its own ends, not as +- offsets from the estimate: a
    # bootstrap percentile interval need not contain the point estimate (and by float
    # rounding it can miss it by 1e-15), where errorbar's offsets would be negative.
    axes[1].plot([a['flops'] for a in m], [a['value'] for a in m], 'o-', label=r)
    axes[1].vlines(
      [a['flops'] for a in m], [a['low'] for a in m], [a['high'] for a in m], color=color
    )
    for p in row['points'].values():
      residuals = p.get('fit_log_residuals', [])
      axes[2].plot([p['flops']] * len(residuals), residuals, '.', color=color)
  for ax in axes:
    ax.set_xscale('log')
    ax.set_xlabel('training FLOPs')
  for ax in axes[:2]:
    ax.legend(fontsize=7)
  axes[0].set_yscale('log')
  axes[0].set_ylabel('held-out bits/byte (seeds: dots, mean: circles)')
  axes[1].axhline(1.0, color='k', lw=0.8)
  axes[1].set_ylabel(f'compute multiplier over {reference} ({pct:g}% interval)')
  axes[2].axhline(0.0, color='k', lw=0.8)
  axes[2].set_ylabel('fit residual: log L - log fit (every seed)')
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
