"""Runs the small-scale study grid (`SWEEP_RUNS` of configs/default.py) x seeds, then
reports.

  python bench/sweep.py                              # every run, seeds 0,1,2
  python bench/sweep.py --groups=modes --seeds=0     # a part of it
  python bench/sweep.py --report_only                # tables and plots from what ran
  python bench/sweep.py --set=train.num_steps=600    # any config field, for every run

Each (run, seed) trains in its own process (`train.py`) into <root>/<run>/seed_<k>;
a run whose `eval_final.json` exists is skipped, and an interrupted one resumes from
its last checkpoint, so the sweep can be stopped and restarted at any time.
`--parallel=N` runs N processes at once (on 2 cores, 1 is fastest overall).

Writes <root>/results.json (one record per run), <root>/results.md (held-out bits per
byte, mean +- std over seeds, the change against the standard residual, compute in
FLOPs from `attnres_jax.flops`, the median step time and the train step's temporary
memory with their ratios to the standard run, all from each run's saved config.json,
i.e. what actually ran), <root>/loss_vs_compute.png and <root>/depth.png.
"""

from __future__ import annotations

import concurrent.futures
import functools
import json
import os
import subprocess
import sys
import time

from absl import app, flags
import jax
import matplotlib

matplotlib.use('Agg')
import matplotlib.pyplot as plt
import numpy as np

from attnres_jax import flops
from attnres_jax.runs import checkpointing
from attnres_jax.runs import metrics as metrics_lib
from attnres_jax.training import optim
from attnres_jax.training import step as train
from configs import default as default_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # train.py's

GROUPS = default_config.SWEEP_GROUPS
PANELS = ('modes', 'ablations', 'depths', 'comparators')  # loss-vs-compute panels

FLAGS = flags.FLAGS
flags.DEFINE_list(
  'groups',
  list(PANELS),
  'Run groups: ' + ', '.join(GROUPS) + ' (scaling, the compute ladder for '
  'bench/scaling.py, and storage, bfloat16 compute with a bfloat16 or float32 depth '
  'state, are not run by default).',
)
flags.DEFINE_list('runs', [], 'Explicit run names (overrides --groups).')
flags.DEFINE_list('seeds', ['0', '1', '2'], 'Seeds (model init and data order).')
flags.DEFINE_string('root', 'runs/sweep', 'Where the run directories go.')
flags.DEFINE_integer('parallel', 1, 'Training processes at once.')
flags.DEFINE_bool('report_only', False, 'Only aggregate what has finished.')
flags.DEFINE_bool(
  'memory',
  True,
  "Report the temporary memory of each run's compiled "
  'train step (XLA memory_analysis; compiled once per run, cached in '
  '<root>/<run>/step_memory.json).',
)
flags.DEFINE_multi_string(
  'set',
  [],
  'A config override KEY=VALUE for every run, passed '
  'to train.py as --config.KEY=VALUE (repeatable).',
)


def run_dir(name: str, seed: int) -> str:
  return os.path.join(FLAGS.root, name, f'seed_{seed}')


def finished(name: str, seed: int) -> bool:
  return os.path.exists(os.path.join(run_dir(name, seed), train.EVAL_FINAL_JSON))


def train_one(name: str, seed: int) -> tuple[str, int, float, int]:
  """Trains one (run, seed) in a subprocess; returns its wall time and exit code."""
  workdir = run_dir(name, seed)
  os.makedirs(workdir, exist_ok=True)
  command = [
    sys.executable,
    os.path.join(REPO, 'train.py'),
    f'--config={os.path.join(REPO, "configs", "default.py")}:sweep={name}',
    f'--config.train.seed={seed}',
    f'--workdir={workdir}',
    *(f'--config.{override}' for override in FLAGS.set),
  ]
  start = time.time()
  with open(os.path.join(workdir, 'train.log'), 'a', encoding='utf-8') as log:
    code = subprocess.call(
      command,
      stdout=log,
      stderr=subprocess.STDOUT,
      env={**os.environ, 'PYTHONPATH': REPO},
      cwd=REPO,
    )
  return name, seed, time.time() - start, code


def selected_runs() -> list[str]:
  if FLAGS.runs:
    unknown = sorted(set(FLAGS.runs) - set(default_config.SWEEP_RUNS))
    if unknown:
      raise app.UsageError(
        f'unknown runs {unknown}; see SWEEP_RUNS in configs/default.py'
      )
    return list(FLAGS.runs)
  return [name for group in FLAGS.groups for name in GROUPS[group]]


def summarize(name: str, seeds: list[int]) -> dict | None:
  done = [seed for seed in seeds if finished(name, seed)]
  if not done:
    return None
  results = []
  for seed in done:
    with open(
      os.path.join(run_dir(name, seed), train.EVAL_FINAL_JSON), encoding='utf-8'
    ) as f:
      results.append(json.load(f))
  config = checkpointing.load_config(run_dir(name, done[0]))
  bpb = np.array([r['bits_per_byte'] for r in results])
  step_times = [
    np.median(
      [
        r['train/step_time']
        for r in metrics_lib.read_jsonl(run_dir(name, seed))
        if 'train/step_time' in r
      ]
    )
    for seed in done
  ]
  per_token = flops.forward_flops_per_token(config.model, config.train.seq_len)
  return dict(
    run=name,
    seeds=len(results),
    bits_per_byte_mean=float(bpb.mean()),
    bits_per_byte_std=float(bpb.std(ddof=1)) if len(bpb) > 1 else None,
    bits_per_byte=bpb.tolist(),
    seed_ids=done,  # the seeds of `bits_per_byte`, in order
    train_loss_mean=float(np.mean([r['train_loss'] for r in results])),
    run_seconds_mean=float(np.mean([r['run_seconds'] for r in results])),
    step_time_median=float(np.median(step_times)),
    temp_bytes=step_memory(name, config) if FLAGS.memory else None,
    training_flops=flops.training_flops(config),
    depth_read_share=per_token['depth_read'] / per_token['total'],
    num_layers=config.model.num_layers,
    d_model=config.model.d_model,
    num_steps=config.train.num_steps,
    model=config.model.to_dict(),
  )


def step_memory(name: str, config) -> int:
  """Temporary bytes of the run's compiled train step (`training/step.py`'s
  `train_step`: loss, gradients, clipping, the AdamW update of its config) at its batch
  shape: what autodiff keeps alive. Cached beside the seeds."""
  cache = os.path.join(FLAGS.root, name, 'step_memory.json')
  if os.path.exists(cache):
    with open(cache, encoding='utf-8') as f:
      return json.load(f)['temp_bytes']
  tx, schedule = optim.make_optimizer(config.train, config.model)
  state = jax.eval_shape(functools.partial(train.init_train_state, config.model, tx, 0))
  graphdef, _ = checkpointing.abstract_model(config.model)
  shape = (config.train.batch_size, config.train.seq_len)
  batch = {
    'inputs': jax.ShapeDtypeStruct(shape, 'int32'),
    'targets': jax.ShapeDtypeStruct(shape, 'int32'),
    'weights': jax.ShapeDtypeStruct(shape, 'float32'),
  }
  step = functools.partial(
    train.train_step,
    graphdef=graphdef,
    tx=tx,
    schedule=schedule,
    grad_accum_steps=config.train.grad_accum_steps,
  )
  compiled = jax.jit(step, donate_argnums=0).lower(state, batch).compile()
  temp = int(compiled.memory_analysis().temp_size_in_bytes)
  os.makedirs(os.path.dirname(cache), exist_ok=True)
  with open(cache, 'w', encoding='utf-8') as f:
    json.dump({'temp_bytes': temp}, f)
  return temp


def loss_curve(name: str, seeds: list[int], flops_per_step: float):
  """Mean train loss over seeds against cumulative training FLOPs."""
  curves = [metrics_lib.read_jsonl(run_dir(name, s)) for s in seeds if finished(name, s)]
  curves = [
    [(r['step'], r['train/loss']) for r in c if 'train/loss' in r] for c in curves
  ]
  curves = [c for c in curves if c]
  if not curves:
    return None
  length = min(len(c) for c in curves)
  steps = np.array([step for step, _ in curves[0][:length]])
  losses = np.mean([[loss for _, loss in c[:length]] for c in curves], axis=0)
  return steps * flops_per_step, losses


def standard_baseline(name: str) -> str:
  """The standard-residual run of the same size as `name`."""
  if name.startswith('depth_'):
    return name.rsplit('_', 1)[0] + '_standard'
  return 'storage_standard' if name.startswith('storage_') else 'standard'


def compare_with_standard(rows: list[dict]) -> None:
  """Adds each row's held-out bits per byte, step time and step memory relative to
  the standard run of its size (None where that did not run)."""
  by_name = {row['run']: row for row in rows}
  for row in rows:
    baseline = by_name.get(standard_baseline(row['run']))
    row['vs_standard'] = (
      row['bits_per_byte_mean'] / baseline['bits_per_byte_mean'] - 1 if baseline else None
    )
    row['time_vs_standard'] = (
      row['step_time_median'] / baseline['step_time_median'] if baseline else None
    )
    row['memory_vs_standard'] = (
      row['temp_bytes'] / baseline['temp_bytes']
      if baseline and row['temp_bytes']
      else None
    )


def results_table(rows: list[dict]) -> str:
  """One markdown line per run: held-out bits per byte, compute, time and memory."""
  ratio = lambda x: '' if x is None else f'{x:.2f}'
  lines = [
    '| run | layers x d | held-out bits/byte (mean +- std) | vs standard | seeds | '
    'train FLOPs | residual share | s/run | median s/step | time/std | '
    'step temp MiB | memory/std |',
    '|---|---|---|---|---|---|---|---|---|---|---|---|',
  ]
  for row in rows:
    change = '' if row['vs_standard'] is None else f'{100 * row["vs_standard"]:+.2f}%'
    memory = '' if row['temp_bytes'] is None else f'{row["temp_bytes"] / 2**20:.1f}'
    std = 'n/a' if row['bits_per_byte_std'] is None else f'{row["bits_per_byte_std"]:.4f}'
    lines.append(
      f'| {row["run"]} | {row["num_layers"]} x {row["d_model"]} | '
      f'{row["bits_per_byte_mean"]:.4f} +- {std} | '
      f'{change} | {row["seeds"]} | {row["training_flops"]:.3g} | '
      f'{100 * row["depth_read_share"]:.2f}% | {row["run_seconds_mean"]:.0f} | '
      f'{row["step_time_median"]:.3f} | {ratio(row["time_vs_standard"])} | '
      f'{memory} | {ratio(row["memory_vs_standard"])} |'
    )
  return '\n'.join(lines)


def plot_loss_curves(by_name: dict, seeds: list[int], path: str) -> None:
  """Train loss against training FLOPs, one panel per group of runs."""
  # The ablations and depths panels repeat their reference runs, dashed.
  references = {
    'modes': [],
    'ablations': ['standard', 'full'],
    'depths': ['standard', 'block_s2'],
    'comparators': ['standard', 'full', 'block_s4'],
  }
  fig, axes = plt.subplots(1, len(PANELS), figsize=(6.3 * len(PANELS), 4.5))
  for ax, group in zip(axes, PANELS):
    for name in [*references[group], *GROUPS[group]]:
      if name not in by_name:
        continue
      per_step = by_name[name]['training_flops'] / by_name[name]['num_steps']
      curve = loss_curve(name, seeds, per_step)
      if curve is None:
        continue
      if name in references[group]:  # black and grey, leaving the colours to the group
        ax.plot(
          *curve,
          '--',
          color=('k', '0.55', '0.75')[references[group].index(name)],
          label=name,
        )
      else:
        ax.plot(*curve, label=name)
    ax.set_xlabel('training FLOPs')
    ax.set_ylabel('train loss (nats/byte), mean over seeds')
    ax.set_title(group)
    ax.set_ylim(top=2.6)
    if ax.lines:
      ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def plot_depth(by_name: dict, path: str) -> None:
  """Held-out bits per byte against depth at about constant compute."""
  fig, ax = plt.subplots(figsize=(5.5, 4))
  shapes = {}  # layers -> 'layers x d'
  for mode, middle, label in (
    ('standard', 'standard', 'standard residual'),
    ('block', 'block_s2', 'Block AttnRes (S=2)'),
  ):
    points = []
    for name in (f'depth_l2_{mode}', middle, f'depth_l8_{mode}'):
      if name in by_name:
        row = by_name[name]
        shapes[row['num_layers']] = f'{row["num_layers"]} x {row["d_model"]}'
        points.append(
          (row['num_layers'], row['bits_per_byte_mean'], row['bits_per_byte_std'] or 0.0)
        )  # one seed: no bar
    if points:
      x, y, err = zip(*points)
      ax.errorbar(x, y, yerr=err, marker='o', capsize=3, label=label)
  ax.set_xscale('log', base=2)
  ax.set_xticks(list(shapes), list(shapes.values()))
  ax.set_xlabel('layers x width (about constant compute)')
  ax.set_ylabel('held-out bits/byte')
  if ax.lines:
    ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def report(names: list[str], seeds: list[int]) -> None:
  """Writes <root>/results.json, results.md (printed), loss_vs_compute.png and
  depth.png from the runs that finished."""
  rows = [row for row in (summarize(n, seeds) for n in names) if row is not None]
  by_name = {row['run']: row for row in rows}
  compare_with_standard(rows)
  os.makedirs(FLAGS.root, exist_ok=True)
  with open(os.path.join(FLAGS.root, 'results.json'), 'w', encoding='utf-8') as f:
    json.dump(rows, f, indent=1)
  table = results_table(rows)
  with open(os.path.join(FLAGS.root, 'results.md'), 'w', encoding='utf-8') as f:
    f.write(table + '\n')
  print(table)
  plot_loss_curves(by_name, seeds, os.path.join(FLAGS.root, 'loss_vs_compute.png'))
  plot_depth(by_name, os.path.join(FLAGS.root, 'depth.png'))


def main(argv):
  del argv
  names = selected_runs()
  seeds = [int(s) for s in FLAGS.seeds]
  if not FLAGS.report_only:
    todo = [(n, s) for n in names for s in seeds if not finished(n, s)]
    print(
      f'{len(todo)} runs to train ({len(names) * len(seeds) - len(todo)} done)',
      flush=True,
    )
    with concurrent.futures.ThreadPoolExecutor(FLAGS.parallel) as pool:
      for name, seed, seconds, code in pool.map(lambda job: train_one(*job), todo):
        status = 'ok' if code == 0 else f'FAILED (exit {code}, see train.log)'
        print(f'{name} seed {seed}: {seconds:.0f} s {status}', flush=True)
  report(names, seeds)


if __name__ == '__main__':
  app.run(main)
