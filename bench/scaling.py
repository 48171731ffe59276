"""The paper's scaling analysis: L = A C^-alpha per residual over a compute ladder, and
the compute multiplier of each residual over the reference at matched loss.

  python bench/ladder.py                           # the ladder study (trains, then this)
  python bench/scaling.py --root=runs/ladder --residuals=standard,block:4 \\
      --out=bench/results --name=ladder            # re-fit what has finished
  python bench/scaling.py --records=bench/results/ladder_runs.json \\
      --out=bench/results --name=ladder            # re-fit a study's saved records

For every residual and rung of the ladder (configs/ladders.py) it reads each finished
seed's held-out bits per byte and the run's training FLOPs C (`attnres_jax.flops`, from
the saved config; with --records, from the records bench/ladder.py saved and the
ladder's config of each run), and fits
log L = log A - alpha log C by least squares over all (seed, width) points. The compute
multiplier of residual r at compute C is C_ref / C, where C_ref is what the reference
fit needs to reach r's fitted loss at C (the paper's "matches a baseline trained with
1.25x compute"):

    multiplier(C) = (A_ref / (A_r C^-alpha_r))^(1 / alpha_ref) / C

reported at every rung's compute and at the ladder's middle (the geometric mean of its
compute range, where the fits are best constrained). Only (rung, seed) pairs finished
for every residual are used. Uncertainty comes from the seeds: the fits are repeated on
--bootstrap resamples that draw, at every rung, seeds with replacement and take every
residual's run of each drawn seed (a seed fixes the data order, shared by the
residuals), and the intervals are the central --interval percent of the resamples.

Writes <out>/<name>.json, <name>.md and <name>.png (out defaults to the root).
"""

from __future__ import annotations

import json
import os

from absl import app, flags
import numpy as np

from attnres_jax import flops
from attnres_jax import modes
from attnres_jax.runs import checkpointing
from attnres_jax.training import step as train
from bench import paired
from bench import scaling_report
from configs import default as default_config
from configs import ladders

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

FLAGS = flags.FLAGS
flags.DEFINE_string('root', 'runs/ladder', 'The run root (bench/ladder.py --root).')
flags.DEFINE_list(
  'residuals',
  [],
  "Residual modes to fit, the first the reference (default: the ladder's `compared`; "
  'a bare `block` where the ladder fixes the block count).',
)


def _valid_modes(values) -> bool:
  try:  # a bare 'block' takes its block size from the ladder's depth
    values and modes.parse_list(','.join(values), block_size=1)
  except ValueError as e:
    raise flags.ValidationError(str(e)) from None
  return True


flags.register_validator('residuals', _valid_modes)

flags.DEFINE_enum(
  'ladder', 'early', list(ladders.LADDERS), 'Which ladder (configs/ladders.py).'
)
flags.DEFINE_list('widths', [], "Rung widths (d_model); default: all the ladder's rungs.")
flags.DEFINE_list('seeds', ['0', '1', '2'], 'Seeds.')
flags.DEFINE_string(
  'records',
  '',
  "A study's saved run records (<name>_runs.json) to fit instead of the run root.",
)
flags.DEFINE_integer('bootstrap', 2000, 'Bootstrap resamples of the seeds.')
flags.DEFINE_float(
  'interval', 95.0, 'Central percentage of the bootstrap resamples given as the interval.'
)
flags.DEFINE_string('out', '', 'Where the report goes (default: --root).')
flags.DEFINE_string(
  'name', 'scaling', 'File name of the report: <out>/<name>.json, .md, .png.'
)


def ladder_points(
  root: str, ladder: ladders.Ladder, name: str, widths, seeds
) -> dict[int, tuple[float, dict]]:
  """{width: (training FLOPs, {seed: held-out bits per byte})} of the finished seeds,
  rungs with at least one."""
  points = {}
  for width in widths:
    run = ladder.run(name, width)
    values, compute = {}, None
    for seed in seeds:
      workdir = os.path.join(root, run, f'seed_{seed}')
      path = os.path.join(workdir, train.EVAL_FINAL_JSON)
      if not os.path.exists(path):
        continue
      with open(path, encoding='utf-8') as f:
        values[seed] = json.load(f)['bits_per_byte']
      compute = flops.training_flops(checkpointing.load_config(workdir))
    if values:
      points[width] = (compute, values)
  return points


def run_config(ladder: ladders.Ladder, run: str, width: int):
  """The config a ladder run trains with: its sweep variant and the rung's budget."""
  config = default_config.get_config(f'sweep={run}')
  for key, value in ladder.train_overrides(width).items():
    section, field = key.split('.')
    config[section][field] = value
  return config


def record_points(
  records: list[dict], ladder: ladders.Ladder, name: str, widths, seeds
) -> dict[int, tuple[float, dict]]:
  """`ladder_points` from saved run records ({run, seed, bits_per_byte, ...}); the
  compute from each run's config, as training would have saved it."""
  points = {}
  for width in widths:
    run = ladder.run(name, width)
    values = {
      r['seed']: r['bits_per_byte']
      for r in records
      if r['run'] == run and r['seed'] in seeds
    }
    if values:
      compute = flops.training_flops(run_config(ladder, run, width))
      points[width] = (compute, dict(sorted(values.items())))
  return points


def common_pairs(points_by_residual: dict) -> dict:
  """The (rung, seed) pairs finished for every residual; rungs left without any
  dropped."""
  widths = set.intersection(*(set(p) for p in points_by_residual.values()))
  out = {r: {} for r in points_by_residual}
  for width in sorted(widths):
    seeds = set.intersection(*(set(p[width][1]) for p in points_by_residual.values()))
    for r, p in points_by_residual.items():
      if seeds:
        out[r][width] = (p[width][0], {s: p[width][1][s] for s in sorted(seeds)})
  return out


def fit_power_law(compute, loss) -> tuple[float, float]:
  """(A, alpha) of L = A C^-alpha, least squares in log-log space."""
  slope, intercept = np.polyfit(np.log(compute), np.log(loss), 1)
  return float(np.exp(intercept)), float(-slope)


def fit_points(points, draws=None) -> tuple[float, float]:
  """The fit over every seed of every rung, or over the seeds `draws[width]` drawn."""
  compute, loss = [], []
  for width, (c, values) in points.items():
    for seed in values if draws is None else draws[width]:
      compute.append(c)
      loss.append(values[seed])
  return fit_power_law(compute, loss)


def rung_difference(values: dict, reference_values: dict, seeds) -> float:
  """Mean over `seeds` of bits per byte minus the reference's (same seed: same data)."""
  return float(np.mean([values[s] - reference_values[s] for s in seeds]))


def multiplier(fit, reference_fit, compute):
  """C_reference / C: the reference's compute for the loss `fit` reaches at `compute`."""
  (a, alpha), (a_ref, alpha_ref) = fit, reference_fit
  loss = a * np.asarray(compute, float) ** -alpha
  return (a_ref / loss) ** (1.0 / alpha_ref) / np.asarray(compute, float)


def analyse(
  points_by_residual: dict,
  reference: str,
  bootstrap: int,
  interval: float = 95.0,
  seed: int = 0,
) -> dict:
  """Fits, multipliers at every rung's compute and at the ladder's middle, and their
  bootstrap intervals; over the (rung, seed) pairs every residual finished."""
  points_by_residual = common_pairs(points_by_residual)
  points = points_by_residual[reference]
  if len(points) < 2:
    raise ValueError(
      f'the fit needs >= 2 rungs finished by every residual; have '
      f'{sorted(points)} ({sorted(points_by_residual)}).'
    )
  rng = np.random.default_rng(seed)
  fits = {r: fit_points(p) for r, p in points_by_residual.items()}
  computes = {r: [c for c, _ in p.values()] for r, p in points_by_residual.items()}
  everything = [c for cs in computes.values() for c in cs]
  middle = float(np.exp(np.mean(np.log([min(everything), max(everything)]))))
  boot = {
    r: dict(alpha=[], at_rungs=[], middle=[], difference=[]) for r in points_by_residual
  }
  for _ in range(bootstrap):  # one draw of seeds per rung, shared by the residuals
    draws = {
      w: rng.choice(list(values), size=len(values), replace=True)
      for w, (_, values) in points.items()
    }
    fit = {r: fit_points(p, draws) for r, p in points_by_residual.items()}
    for r, p in points_by_residual.items():
      boot[r]['alpha'].append(fit[r][1])
      boot[r]['at_rungs'].append(multiplier(fit[r], fit[reference], computes[r]))
      boot[r]['middle'].append(float(multiplier(fit[r], fit[reference], middle)))
      boot[r]['difference'].append(
        [rung_difference(p[w][1], points[w][1], draws[w]) for w in p]
      )
  bounds = [(100 - interval) / 2, (100 + interval) / 2]
  band = lambda x, axis=None: np.percentile(np.array(x), bounds, axis=axis)
  result = dict(
    reference=reference,
    interval_percent=interval,
    bootstrap=bootstrap,
    middle_flops=middle,
    residuals={},
  )
  for r, p in points_by_residual.items():
    value = multiplier(fits[r], fits[reference], computes[r])
    low, high = band(boot[r]['at_rungs'], axis=0)
    diff_low, diff_high = band(boot[r]['difference'], axis=0)
    # log L - log fit at every (rung, seed): the fit's residuals, shown per rung.
    rung_residuals = {
      w: [float(np.log(v / (fits[r][0] * c ** -fits[r][1]))) for v in values.values()]
      for w, (c, values) in p.items()
    }
    log_residuals = [x for xs in rung_residuals.values() for x in xs]
    result['residuals'][r] = dict(
      A=fits[r][0],
      alpha=fits[r][1],
      alpha_interval=[float(x) for x in band(boot[r]['alpha'])],
      # alpha - alpha_ref: > 0 means the multiplier grows with compute.
      alpha_minus_reference=fits[r][1] - fits[reference][1],
      alpha_minus_reference_interval=[
        float(x) for x in band(np.subtract(boot[r]['alpha'], boot[reference]['alpha']))
      ],
      fit_rms_relative_residual=float(np.sqrt(np.mean(np.square(log_residuals)))),
      points={
        str(w): dict(
          flops=c,
          seeds=list(v),
          bits_per_byte=list(v.values()),
          difference=rung_difference(v, points[w][1], list(v)),
          difference_interval=[float(lo), float(hi)],
          difference_t_interval=list(
            paired.t_interval([v[s] - points[w][1][s] for s in v], interval / 100)
          ),
          fit_log_residuals=rung_residuals[w],
        )
        for (w, (c, v)), lo, hi in zip(p.items(), diff_low, diff_high)
      },
      multiplier_middle=dict(
        flops=middle,
        value=float(multiplier(fits[r], fits[reference], middle)),
        interval=[float(x) for x in band(boot[r]['middle'])],
      ),
      multiplier=[
        dict(flops=c, value=float(a), low=float(lo), high=float(hi))
        for c, a, lo, hi in zip(computes[r], value, low, high)
      ],
    )
  return result


def selected_rungs() -> tuple[ladders.Ladder, list[int], list[str]]:
  """The --ladder, its --widths (all its rungs by default) and --residuals (its
  `compared` by default), checked."""
  ladder = ladders.LADDERS[FLAGS.ladder]
  residuals = list(FLAGS.residuals) or list(ladder.compared)
  missing = [r for r in residuals if r not in ladder.residuals]
  if missing:
    raise app.UsageError(
      f'residuals {missing} are not in the {ladder.name} ladder {ladder.residuals} '
      '(configs/ladders.py)'
    )
  widths = [int(w) for w in FLAGS.widths] or list(ladder.widths)
  unknown = [w for w in widths if w not in ladder.widths]
  if unknown:
    raise app.UsageError(
      f'widths {unknown} are not rungs of the {ladder.name} ladder {ladder.widths} '
      '(configs/ladders.py)'
    )
  return ladder, widths, residuals


def main(argv):
  del argv
  ladder, widths, residuals = selected_rungs()
  seeds = [int(s) for s in FLAGS.seeds]
  if FLAGS.records:
    with open(FLAGS.records, encoding='utf-8') as f:
      records = json.load(f)
    points = {r: record_points(records, ladder, r, widths, seeds) for r in residuals}
  else:
    points = {r: ladder_points(FLAGS.root, ladder, r, widths, seeds) for r in residuals}
  for r, p in points.items():
    print(f'{r}: finished rungs {sorted(p)} (seeds {[sorted(v) for _, v in p.values()]})')
  try:
    result = analyse(points, residuals[0], FLAGS.bootstrap, FLAGS.interval)
  except ValueError as e:  # nothing (or too little) finished under --root
    raise app.UsageError(
      f'{e} Train the ladder first (bench/ladder.py --root={FLAGS.root}), or re-fit '
      'a saved study: --records=bench/results/ladder_runs.json.'
    ) from None
  result['ladder'] = dict(
    name=ladder.name,
    tokens_per_param=ladder.tokens_per_param,
    blocks=ladder.blocks,
    rungs={
      str(w): dict(layers=ladder.layers(w), params=ladder.params(w)) for w in widths
    },
  )
  print(scaling_report.report(result, FLAGS.out or FLAGS.root, FLAGS.name))


if __name__ == '__main__':
  app.run(main)
