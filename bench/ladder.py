"""The compute-multiplier study: a ladder of model sizes (configs/default.py:
SCALING_WIDTHS), each residual and seed trained on tokens proportional to its
parameters, then the paper's power-law fit and the compute multiplier at matched loss
(bench/scaling.py).

  python bench/ladder.py                                # train what is missing, then fit
  python bench/ladder.py --report_only                  # fit what has finished
  python bench/ladder.py --residuals=standard,full,block:4 --seeds=0,1,2,3

Every (rung, seed) trains through `bench/sweep.py` (one `train.py` process per run,
finished runs skipped, interrupted ones resumed), seed-major so that an interrupted
study holds whole seeds of the ladder; each rung gets its train budget from
`default_config.scaling_train_overrides`. Writes <out>/ladder.json, ladder.md and
ladder.png (the fit and the multiplier; bench/scaling.py's report) and
<out>/ladder_runs.json (every run's final record, its run time included).
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
from configs import default as default_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

FLAGS = flags.FLAGS
# bench/scaling.py's flags (--root, --residuals, --widths, --seeds, --bootstrap, --out,
# --name), with the ladder's defaults.
FLAGS.set_default('root', 'runs/ladder')
FLAGS.set_default('residuals', ['standard', 'block:4'])
FLAGS.set_default('out', 'bench/results')
FLAGS.set_default('name', 'ladder')
flags.DEFINE_bool('report_only', False, 'Only fit what has finished.')
flags.adopt_module_key_flags(scaling)  # --help lists them too


def train_rung(width: int, seed: int) -> int:
  """Trains every residual of one rung and seed via bench/sweep.py; its exit code."""
  runs = [default_config.scaling_run(r, width) for r in FLAGS.residuals]
  overrides = default_config.scaling_train_overrides(width)
  command = [
    sys.executable,
    os.path.join(REPO, 'bench', 'sweep.py'),
    f'--runs={",".join(runs)}',
    f'--seeds={seed}',
    f'--root={os.path.abspath(FLAGS.root)}',
    '--nomemory',
    *(f'--set={key}={value}' for key, value in overrides.items()),
  ]
  print(' '.join(command[1:]), flush=True)
  return subprocess.call(command, cwd=REPO)


def write_run_records(path: str, widths, seeds) -> int:
  """Every finished run's eval_final.json (held-out loss, train loss, run seconds)
  with its run, seed and step count, as one JSON list; returns how many."""
  records = []
  for width in widths:
    for residual in FLAGS.residuals:
      run = default_config.scaling_run(residual, width)
      for seed in seeds:
        final = os.path.join(FLAGS.root, run, f'seed_{seed}', train.EVAL_FINAL_JSON)
        if os.path.exists(final):
          with open(final, encoding='utf-8') as f:
            records.append(
              dict(run=run, residual=residual, width=width, seed=seed, **json.load(f))
            )
  with open(path, 'w', encoding='utf-8') as f:
    json.dump(records, f, indent=1)
  return len(records)


def main(argv):
  del argv
  widths = [int(w) for w in FLAGS.widths]
  seeds = [int(s) for s in FLAGS.seeds]
  unknown = [w for w in widths if w not in default_config.SCALING_WIDTHS]
  if unknown:
    raise app.UsageError(
      f'widths {unknown} are not in SCALING_WIDTHS '
      f'{default_config.SCALING_WIDTHS} (configs/default.py)'
    )
  if not FLAGS.report_only:
    start = time.time()
    for seed in seeds:
      for width in widths:
        if train_rung(width, seed) != 0:
          raise RuntimeError(f'bench/sweep.py failed at d = {width}, seed {seed}')
    print(f'ladder trained in {time.time() - start:.0f} s', flush=True)
  scaling.main([])
  path = os.path.join(FLAGS.out, f'{FLAGS.name}_runs.json')
  print(f'{write_run_records(path, widths, seeds)} run records in {path}')


if __name__ == '__main__':
  app.run(main)
