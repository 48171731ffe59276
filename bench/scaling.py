"""The paper's scaling analysis on the sweep's compute ladder: L = A C^-alpha per residual,
and the compute-equivalent advantage of each residual over the standard one.

  python bench/sweep.py --groups=scaling --seeds=0,1,2      # the ladder (d != 128)
  python bench/sweep.py --runs=standard,full,block_s4,mhc,hc --seeds=0,1,2  # d = 128
  python bench/scaling.py --root=runs/sweep --residuals=standard,block_s4,full

For every residual and ladder width (configs/default.py: SCALING_WIDTHS; the d = 128 rung
is the plain run) it reads each finished seed's held-out bits per byte and the run's
training FLOPs C (`attnres_jax.flops`, from the saved config), and fits
log L = log A - alpha log C by least squares over all (seed, width) points. The
compute-equivalent advantage of residual r at compute C is C_std / C, where C_std is
what the standard fit needs to reach r's fitted loss at C (the paper's "1.25x"):

    advantage(C) = (A_std / (A_r C^-alpha_r))^(1 / alpha_std) / C

reported at every rung's compute. Its uncertainty comes from the seeds: the fits are
repeated on bootstrap resamples of the seeds at every rung (--bootstrap times), and the
table gives the 16th-84th percentiles (about +-1 sigma).

Writes <root>/scaling.json, <root>/scaling.md and <root>/scaling.png.
"""

from __future__ import annotations

import json
import os
import sys

from absl import app, flags
import matplotlib
matplotlib.use('Agg')
import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from attnres_jax import checkpointing  # pylint: disable=g-import-not-at-top
from attnres_jax import flops  # pylint: disable=g-import-not-at-top
from attnres_jax import train  # pylint: disable=g-import-not-at-top
from configs import default as default_config  # pylint: disable=g-import-not-at-top

FLAGS = flags.FLAGS
flags.DEFINE_string('root', 'runs/sweep', 'The sweep root (bench/sweep.py --root).')
flags.DEFINE_list('residuals', ['standard', 'full', 'block_s4', 'mhc', 'hc'],
                  'Base run names to fit (the first must be the reference).')
flags.DEFINE_list('widths', [str(w) for w in default_config.SCALING_WIDTHS],
                  'Ladder widths (d_model).')
flags.DEFINE_list('seeds', ['0', '1', '2'], 'Seeds.')
flags.DEFINE_integer('bootstrap', 1000, 'Bootstrap resamples of the seeds.')


def ladder_points(root: str, name: str, widths, seeds) -> dict[int, tuple[float, list]]:
  """{width: (training FLOPs, [bits per byte of each finished seed])}, rungs with at
  least one finished seed."""
  points = {}
  for width in widths:
    run = default_config.scaling_run(name, width)
    values, compute = [], None
    for seed in seeds:
      workdir = os.path.join(root, run, f'seed_{seed}')
      path = os.path.join(workdir, train.EVAL_FINAL_JSON)
      if not os.path.exists(path):
        continue
      with open(path, encoding='utf-8') as f:
        values.append(json.load(f)['bits_per_byte'])
      compute = flops.training_flops(checkpointing.load_config(workdir))
    if values:
      points[width] = (compute, values)
  return points


def fit_power_law(compute, loss) -> tuple[float, float]:
  """(A, alpha) of L = A C^-alpha, least squares in log-log space."""
  slope, intercept = np.polyfit(np.log(compute), np.log(loss), 1)
  return float(np.exp(intercept)), float(-slope)


def fit_points(points) -> tuple[float, float]:
  compute = [c for c, values in points.values() for _ in values]
  loss = [v for _, values in points.values() for v in values]
  return fit_power_law(compute, loss)


def advantage(fit, reference_fit, compute):
  """C_reference / C: the reference's compute for the loss `fit` reaches at `compute`."""
  (a, alpha), (a_ref, alpha_ref) = fit, reference_fit
  loss = a * np.asarray(compute, float) ** -alpha
  return (a_ref / loss) ** (1.0 / alpha_ref) / np.asarray(compute, float)


def resample(points, rng):
  return {w: (c, list(rng.choice(values, size=len(values), replace=True)))
          for w, (c, values) in points.items()}


def analyse(points_by_residual: dict, reference: str, bootstrap: int, seed: int = 0):
  """Fits, advantages at every rung's compute and their bootstrap percentiles."""
  rng = np.random.default_rng(seed)
  usable = {r: p for r, p in points_by_residual.items() if len(p) >= 2}
  if reference not in usable:
    raise ValueError(f'the reference {reference!r} needs finished runs at >= 2 widths; '
                     f'have {sorted(points_by_residual.get(reference, {}))}.')
  fits = {r: fit_points(p) for r, p in usable.items()}
  computes = {r: sorted(c for c, _ in p.values()) for r, p in usable.items()}
  alphas, advantages = {r: [] for r in usable}, {r: [] for r in usable}
  for _ in range(bootstrap):  # one resample of every rung's seeds, all residuals
    fit = {r: fit_points(resample(p, rng)) for r, p in usable.items()}
    for r in usable:
      alphas[r].append(fit[r][1])
      advantages[r].append(advantage(fit[r], fit[reference], computes[r]))
  result = {}
  for r, p in usable.items():
    low, high = np.percentile(np.array(advantages[r]), [16, 84], axis=0)
    value = advantage(fits[r], fits[reference], computes[r])
    result[r] = dict(
        A=fits[r][0], alpha=fits[r][1],
        alpha_band=[float(x) for x in np.percentile(alphas[r], [16, 84])],
        points={str(w): dict(flops=c, bits_per_byte=v) for w, (c, v) in p.items()},
        advantage=[dict(flops=c, value=float(a), low=float(lo), high=float(hi))
                   for c, a, lo, hi in zip(computes[r], value, low, high)])
  return result


def report(result: dict, reference: str, root: str) -> str:
  lines = ['| residual | A | alpha (16-84%) | rungs | seeds per rung | '
           f'compute-equivalent advantage over {reference} at each rung (16-84%) |',
           '|---|---|---|---|---|---|']
  for r, row in result.items():
    seeds = ', '.join(str(len(p['bits_per_byte'])) for p in row['points'].values())
    adv = '; '.join(f"{a['flops']:.2g}: {a['value']:.3f}x ({a['low']:.3f}-{a['high']:.3f})"
                    for a in row['advantage'])
    lines.append(f"| {r} | {row['A']:.3g} | {row['alpha']:.4f} "
                 f"({row['alpha_band'][0]:.4f}-{row['alpha_band'][1]:.4f}) | "
                 f"{len(row['points'])} | {seeds} | {adv} |")
  table = '\n'.join(lines)
  with open(os.path.join(root, 'scaling.md'), 'w', encoding='utf-8') as f:
    f.write(table + '\n')
  with open(os.path.join(root, 'scaling.json'), 'w', encoding='utf-8') as f:
    json.dump(result, f, indent=1)

  fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
  for r, row in result.items():
    pts = sorted((p['flops'], np.mean(p['bits_per_byte']),
                  np.std(p['bits_per_byte'], ddof=1) if len(p['bits_per_byte']) > 1 else 0)
                 for p in row['points'].values())
    c, mean, err = map(np.array, zip(*pts))
    line = axes[0].errorbar(c, mean, yerr=err, fmt='o', capsize=3, label=r)
    grid = np.geomspace(c.min(), c.max(), 50)
    axes[0].plot(grid, row['A'] * grid ** -row['alpha'], '-', color=line[0].get_color(),
                 label=f"{r}: {row['A']:.3g} C^-{row['alpha']:.4f}")
    adv = row['advantage']
    # The interval is drawn from its own ends, not as +- offsets from the estimate: a
    # bootstrap percentile interval need not contain the point estimate (and by float
    # rounding it can miss it by 1e-15), where errorbar's offsets would be negative.
    line = axes[1].plot([a['flops'] for a in adv], [a['value'] for a in adv], 'o-',
                        label=r)
    axes[1].vlines([a['flops'] for a in adv], [a['low'] for a in adv],
                   [a['high'] for a in adv], color=line[0].get_color())
  for ax in axes:
    ax.set_xscale('log')
    ax.set_xlabel('training FLOPs')
    ax.legend(fontsize=7)
  axes[0].set_yscale('log')
  axes[0].set_ylabel('held-out bits/byte')
  axes[1].axhline(1.0, color='k', lw=0.8)
  axes[1].set_ylabel(f'compute-equivalent advantage over {reference}')
  fig.tight_layout()
  fig.savefig(os.path.join(root, 'scaling.png'), dpi=120)
  plt.close(fig)
  return table


def main(argv):
  del argv
  widths = [int(w) for w in FLAGS.widths]
  seeds = [int(s) for s in FLAGS.seeds]
  points = {r: ladder_points(FLAGS.root, r, widths, seeds) for r in FLAGS.residuals}
  for r, p in points.items():
    print(f"{r}: finished rungs {sorted(p)} "
          f"(seeds {[len(v) for _, v in p.values()]})")
  result = analyse(points, FLAGS.residuals[0], FLAGS.bootstrap)
  print(report(result, FLAGS.residuals[0], FLAGS.root))


if __name__ == '__main__':
  app.run(main)
