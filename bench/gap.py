"""The gap against training length: how far each residual is from the standard one at
each step budget of the default model, paired by seed, from the sweep records that
bench/sweep.py writes (<root>/results.json or a copy in bench/results/).

  python bench/gap.py \\
      --study=300:bench/results/sweep.jsonl --study=600:bench/results/sweep600.jsonl \\
      --study=1200:bench/results/study1200_seeds.json \\
      --study=1200:bench/results/study1200.json --runs=full,block_s4

A length may be given several files: each run's seed is taken from the first that has
it (so one study's newer seeds stand beside another's older ones). Writes <out>/<name>.md,
.json and .png: per length and run, the seeds, held-out bits per byte (mean +- std), the
mean paired difference from the reference relative to its mean, with the Student-t
interval over seeds and the difference in standard errors.
"""

from __future__ import annotations

import collections
import json
import os

from absl import app, flags
import matplotlib

matplotlib.use('Agg')
import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

from bench import paired
from bench import scaling_report

FLAGS = flags.FLAGS


def define_flags() -> None:
  """The script's flags, defined only when it runs as one: its functions are
  imported by tests beside other bench modules whose flags share names."""
  flags.DEFINE_multi_string(
    'study', [], 'STEPS:FILE, a sweep record (.json list or .jsonl) at that step budget.'
  )
  flags.DEFINE_list('runs', ['full', 'block_s4'], 'The runs compared with --reference.')
  flags.DEFINE_string('reference', 'standard', 'The run the others are compared with.')
  flags.DEFINE_string('out', 'bench/results', 'Where the report goes.')
  flags.DEFINE_string('name', 'gap', 'File name: <out>/<name>.md, .json, .png.')


def read_records(path: str) -> list[dict]:
  """A sweep record: a JSON list (results.json) or one JSON object a line (.jsonl)."""
  with open(path, encoding='utf-8') as f:
    if path.endswith('.jsonl'):
      return [json.loads(line) for line in f if line.strip()]
    return json.load(f)


def per_seed(row: dict) -> dict[int, float]:
  """{seed: held-out bits per byte}; records list the finished seeds' values in seed
  order, and a record without `seed_ids` finished seeds 0 .. n - 1."""
  seeds = row.get('seed_ids', range(len(row['bits_per_byte'])))
  return dict(zip(seeds, row['bits_per_byte']))


def collect(studies: list[str]) -> dict[int, dict[str, dict[int, float]]]:
  """{steps: {run: {seed: bits per byte}}}; a (run, seed) from the first file of its
  length that has it."""
  by_length = collections.defaultdict(dict)
  for study in studies:
    steps, _, path = study.partition(':')
    for row in read_records(path):
      seeds = by_length[int(steps)].setdefault(row['run'], {})
      for seed, value in per_seed(row).items():
        seeds.setdefault(seed, value)
  return dict(sorted(by_length.items()))


def analyse(by_length: dict, runs: list[str], reference: str) -> list[dict]:
  rows = []
  for steps, values in by_length.items():
    if reference not in values:
      continue
    for run in [reference, *runs]:
      if run not in values:
        continue
      row = dict(steps=steps, run=run, bits_per_byte=values[run])
      if run != reference:
        row['vs_reference'] = paired.compare(values[run], values[reference])
      rows.append(row)
  return rows


def markdown(rows: list[dict], reference: str) -> str:
  lines = [
    f'| steps | run | seeds | held-out bits/byte | vs {reference}, paired (95% t '
    'interval) | in standard errors |',
    '|---|---|---|---|---|---|',
  ]
  for row in rows:
    seeds = ', '.join(map(str, sorted(row['bits_per_byte'])))
    cells = [str(row['steps']), row['run'], seeds]
    cells.append(scaling_report.spread(list(row['bits_per_byte'].values())))
    c = row.get('vs_reference')
    if c is None:
      cells += ['', '']
    elif c['standard_error'] is None:
      cells += [f'{100 * c["relative"]:+.2f}% (one seed: no interval)', 'n/a']
    else:
      low, high = (100 * x for x in c['relative_t_interval'])
      cells += [
        f'{100 * c["relative"]:+.2f}% ({low:+.2f}% to {high:+.2f}%)',
        f'{c["difference"] / c["standard_error"]:+.1f}',
      ]
    lines.append('| ' + ' | '.join(cells) + ' |')
  return '\n'.join(lines)


def plot(rows: list[dict], reference: str, path: str) -> None:
  fig, ax = plt.subplots(figsize=(6, 4))
  by_run = collections.defaultdict(list)
  for row in rows:
    if 'vs_reference' in row:
      by_run[row['run']].append(row)
  for run, points in by_run.items():
    steps = [p['steps'] for p in points]
    rel = [100 * p['vs_reference']['relative'] for p in points]
    line = ax.plot(steps, rel, 'o-', label=run)[0]
    for p in points:
      low, high = p['vs_reference']['relative_t_interval']
      if low == low:  # nan (one seed): no interval drawn
        ax.vlines(p['steps'], 100 * low, 100 * high, color=line.get_color())
  ax.axhline(0.0, color='k', lw=0.8)
  ax.set_xscale('log')
  ax.set_xlabel('training steps (16 x 128 bytes each)')
  ax.set_ylabel(f'held-out bits/byte vs {reference} (%, 95% t interval)')
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def main(argv):
  del argv
  if not FLAGS.study:
    raise app.UsageError('give at least one --study=STEPS:FILE')
  rows = analyse(collect(FLAGS.study), FLAGS.runs, FLAGS.reference)
  table = markdown(rows, FLAGS.reference)
  os.makedirs(FLAGS.out, exist_ok=True)
  base = os.path.join(FLAGS.out, FLAGS.name)
  with open(f'{base}.json', 'w', encoding='utf-8') as f:
    json.dump(rows, f, indent=1)
  with open(f'{base}.md', 'w', encoding='utf-8') as f:
    f.write(table + '\n')
  plot(rows, FLAGS.reference, f'{base}.png')
  print(table)


if __name__ == '__main__':
  define_flags()
  app.run(main)
