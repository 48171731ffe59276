"""The learning-rate check of a ladder: the same rungs and seed trained at several peak
learning rates (bench/ladder.py --learning_rate, one --root each), so the comparison of
residuals can be read at each residual's best rate.

  python bench/lr_check.py --ladder=optimal --seed=0 \\
      --rate=0.0015:runs/optimal_lr0.0015 --rate=0.003:runs/optimal \\
      --rate=0.006:runs/optimal_lr0.006

Writes <out>/<name>.md and .json: held-out bits per byte per rung, residual and rate,
each residual's best rate, and the Block-minus-standard difference at the default rate
and at each one's best.
"""

from __future__ import annotations

import json
import os

from absl import app, flags

from attnres_jax.training import step as train
from configs import ladders

FLAGS = flags.FLAGS


def define_flags() -> None:
  """The script's flags, defined only when it runs as one: its functions are
  imported by tests beside other bench modules whose flags share names."""
  flags.DEFINE_enum('ladder', 'optimal', list(ladders.LADDERS), 'Which ladder.')
  flags.DEFINE_list(
    'widths', [], "The rungs checked (default: the ladder's smallest and largest)."
  )
  flags.DEFINE_integer('seed', 0, 'The seed of every run.')
  flags.DEFINE_multi_string('rate', [], 'RATE:ROOT, the runs trained at that peak rate.')
  flags.DEFINE_string('default_rate', '0.003', 'The rate the ladder itself uses.')
  flags.DEFINE_string('out', 'bench/results', 'Where the report goes.')
  flags.DEFINE_string('name', 'lr_check', 'File name: <out>/<name>.md, .json.')


def collect(ladder, widths, seed, rates) -> dict:
  """{width: {residual: {rate: bits per byte}}} of the finished runs."""
  out = {}
  for width in widths:
    for residual in ladder.compared:
      for rate, root in rates:
        run = os.path.join(root, ladder.run(residual, width), f'seed_{seed}')
        path = os.path.join(run, train.EVAL_FINAL_JSON)
        if os.path.exists(path):
          with open(path, encoding='utf-8') as f:
            value = json.load(f)['bits_per_byte']
          out.setdefault(width, {}).setdefault(residual, {})[rate] = value
  return out


def markdown(ladder, values: dict, rates: list[str], default_rate: str) -> str:
  """Per rung and residual the loss at each rate; the comparison at the default rate
  and at each residual's best (the ladder's `compared`: standard first)."""
  lines = [
    '| rung (d, layers) | residual | '
    + ' | '.join(f'lr {r}' for r in rates)
    + ' | best rate | Block - standard at the default rate | at each best rate |',
    '|---|---|' + '---|' * len(rates) + '---|---|---|',
  ]
  for width, by_residual in values.items():
    best = {r: min(v, key=v.get) for r, v in by_residual.items()}
    standard, block = ladder.compared
    for residual, by_rate in by_residual.items():
      cells = [f'{by_rate[r]:.4f}' if r in by_rate else '-' for r in rates]
      diffs = ['', '']
      if residual == block and standard in by_residual:
        s, b = by_residual[standard], by_rate
        if default_rate in s and default_rate in b:
          diffs[0] = f'{b[default_rate] - s[default_rate]:+.4f}'
        diffs[1] = f'{b[best[block]] - s[best[standard]]:+.4f}'
      lines.append(
        f'| {width}, {ladder.layers(width)} | {residual} | '
        + ' | '.join(cells)
        + f' | {best[residual]} | '
        + ' | '.join(diffs)
        + ' |'
      )
  return '\n'.join(lines)


def main(argv):
  del argv
  ladder = ladders.LADDERS[FLAGS.ladder]
  rates = [r.partition(':') for r in FLAGS.rate]
  if not rates:
    raise app.UsageError('give at least one --rate=RATE:ROOT')
  widths = [int(w) for w in FLAGS.widths] or [ladder.widths[0], ladder.widths[-1]]
  values = collect(ladder, widths, FLAGS.seed, [(r, root) for r, _, root in rates])
  table = markdown(ladder, values, [r for r, _, _ in rates], FLAGS.default_rate)
  os.makedirs(FLAGS.out, exist_ok=True)
  with open(os.path.join(FLAGS.out, f'{FLAGS.name}.json'), 'w', encoding='utf-8') as f:
    json.dump({str(w): v for w, v in values.items()}, f, indent=1)
  with open(os.path.join(FLAGS.out, f'{FLAGS.name}.md'), 'w', encoding='utf-8') as f:
    f.write(table + '\n')
  print(table)


if __name__ == '__main__':
  define_flags()
  app.run(main)
