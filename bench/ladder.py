"""The compute-multiplier study: a ladder of model sizes (configs/ladders.py), each
residual and seed trained on tokens proportional to its parameters, then the paper's
power-law fit and the compute multiplier at matched loss (bench/scaling.py).

  python bench/ladder.py                        # the early ladder (4 tokens/param)
  python bench/ladder.py --report_only          # fit what has finished
  python bench/ladder.py --ladder=optimal --root=runs/optimal --name=optimal \
      --seeds=0,1,2,3,4                         # 20 tokens/param, depth 4 to 6
  python bench/ladder.py --ladder=optimal --root=runs/optimal_lr0.006 \
      --learning_rate=0.006 --widths=16,40 --seeds=0 --name=optimal_lr0.006

Every (rung, seed) trains through `bench/sweep.py` (one `train.py` process per run,
finished runs skipped, interrupted ones resumed), seed-major so that an interrupted
study holds whole seeds of the ladder; each rung gets its train budget from
`Ladder.train_overrides`. Writes <out>/<name>.json, .md and .png (the fit and the
multiplier; bench/scaling.py's report) and <out>/<name>_runs.json (every run's final
record, its run time included).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from absl import app, flags

from attnres_jax.training import step as train
from bench import scaling
from configs import ladders

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

FLAGS = flags.FLAGS
# bench/scaling.py's flags (--root, --residuals, --widths, --seeds, --bootstrap, --out,
# --name), with the ladder's defaults.
FLAGS.set_default('root', 'runs/ladder')
FLAGS.set_default('out', 'bench/results')
FLAGS.set_default('name', 'ladder')
flags.DEFINE_bool('report_only', False, 'Only fit what has finished.')
flags.DEFINE_float(
  'learning_rate',
  None,
  "Peak learning rate of every run (default: configs/default.py's); give each rate "
  'its own --root (the learning-rate check).',
)
flags.adopt_module_key_flags(scaling)  # --help lists them too


def train_rung(ladder: ladders.Ladder, residuals, width: int, seed: int) -> int:
  """Trains every residual of one rung and seed via bench/sweep.py; its exit code."""
  runs = [ladder.run(r, width) for r in residuals]
  overrides = ladder.train_overrides(width)
  command = [
    sys.executable,
    os.path.join(REPO, 'bench', 'sweep.py'),
    f'--runs={",".join(runs)}',
    f'--seeds={seed}',
    f'--root={os.path.abspath(FLAGS.root)}',
    '--nomemory',
    *(f'--set={key}={value}' for key, value in overrides.items()),
  ]
  if FLAGS.learning_rate is not None:
    command.append(f'--set=train.learning_rate={FLAGS.learning_rate}')
  print(' '.join(command[1:]), flush=True)
  return subprocess.call(command, cwd=REPO)


def write_run_records(path: str, ladder: ladders.Ladder, residuals, widths, seeds) -> int:
  """Every finished run's eval_final.json (held-out loss, train loss, run seconds)
  with its run, seed and step count, as one JSON list; returns how many."""
  records = []
  for width in widths:
    for residual in residuals:
      run = ladder.run(residual, width)
      for seed in seeds:
        final = os.path.join(FLAGS.root, run, f'seed_{seed}', train.EVAL_FINAL_JSON)
        if os.path.exists(final):
          with open(final, encoding='utf-8') as f:
            records.append(
              dict(
                run=run,
                residual=residual,
                width=width,
                layers=ladder.layers(width),
                tokens_per_param=ladder.tokens_per_param,
                seed=seed,
                **json.load(f),
              )
            )
  with open(path, 'w', encoding='utf-8') as f:
    json.dump(records, f, indent=1)
  return len(records)


def main(argv):
  del argv
  ladder, widths, residuals = scaling.selected_rungs()
  seeds = [int(s) for s in FLAGS.seeds]
  if not FLAGS.report_only:
    start = time.time()
    for seed in seeds:
      for width in widths:
        if train_rung(ladder, residuals, width, seed) != 0:
          raise RuntimeError(f'bench/sweep.py failed at d = {width}, seed {seed}')
    print(f'ladder trained in {time.time() - start:.0f} s', flush=True)
  scaling.main([])
  path = os.path.join(FLAGS.out, f'{FLAGS.name}_runs.json')
  print(
    f'{write_run_records(path, ladder, residuals, widths, seeds)} run records in {path}'
  )


if __name__ == '__main__':
  app.run(main)
