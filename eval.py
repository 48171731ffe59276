"""Evaluates, analyses, compares and samples trained runs.

  python eval.py --workdir=DIR [--step=N]
      held-out loss / bits per byte / perplexity over the whole eval split and the
      depth statistics, in one pass, and the analysis figures, into DIR/eval/step_N/
      (eval.json, analysis.npz, *.png).
  python eval.py --compare DIR1 DIR2 ... [--output_dir=OUT]
      loss curves and magnitude profiles overlaid, and a markdown table of the latest
      evaluation of each run (eval.py's, else training's eval_final.json), into OUT
      (default: DIR1/compare, in the first run's workdir).
  python eval.py --workdir=DIR --prompt="ROMEO:" [--prompt="JULIET:" ...]
      --max_new_tokens=200 [--temperature=0.8 --top_k=40 --seed=0]
      samples text with the KV cache (several prompts: one batch).

Writing into a workdir (the default output) takes its lock, so it waits for no one:
while a training run holds the workdir, write elsewhere with --output_dir.

Errors are one FATAL line (exit 1; --debug adds the traceback, --help the usage). A
SIGTERM or SIGINT ends it at once with one line (exit 143 or 130), the lock released.
"""

import os
import sys

import startup_signals  # first: a signal while starting ends the run in one line

startup_signals.install()

import traceback

from absl import app
from absl import flags
from absl import logging

from attnres_jax.evaluation import analysis
from attnres_jax.runs import checkpointing
from attnres_jax.data import pipeline as data
from attnres_jax.runs import lease
from attnres_jax.runs import preemption
from attnres_jax.inference import sampling
from attnres_jax.runs import storage
from attnres_jax.runs import workdir as workdir_lib

_WORKDIR = flags.DEFINE_string(
  'workdir', None, 'Run directory (config.json, checkpoints).'
)
_STEP = flags.DEFINE_integer('step', None, 'Checkpoint step; default: the latest.')
_OUTPUT_DIR = flags.DEFINE_string(
  'output_dir', None, 'Where to write; default DIR/eval/step_N (or .../compare).'
)
_COMPARE = flags.DEFINE_bool(
  'compare', False, 'Compare the run directories given as positional arguments.'
)
_BATCH_SIZE = flags.DEFINE_integer(
  'batch_size', None, 'Eval batch size; default: the training batch size.'
)
_MAX_EVAL_BATCHES = flags.DEFINE_integer(
  'max_eval_batches', None, 'Evaluate only the first batches (default: whole split).'
)
_GRAD_BATCHES = flags.DEFINE_integer(
  'grad_batches', 16, 'Eval batches for the gradient norms (0: all).'
)
_PROMPT = flags.DEFINE_multi_string(
  'prompt',
  None,
  'Sample a continuation of this text; repeat the flag for a batch of '
  'prompts (generated together).',
)
_MAX_NEW_TOKENS = flags.DEFINE_integer('max_new_tokens', 200, 'Tokens to sample.')
_TEMPERATURE = flags.DEFINE_float('temperature', 0.8, 'Sampling temperature; 0: greedy.')
_TOP_K = flags.DEFINE_integer('top_k', None, 'Sample from the k most likely tokens only.')
_SEED = flags.DEFINE_integer('seed', 0, 'Sampling seed (fixed seed, fixed output).')
_DEBUG = flags.DEFINE_bool(
  'debug', False, 'Print the full traceback of an error, not one line.'
)


def _check_flags() -> None:
  for flag, minimum in (
    (_BATCH_SIZE, 1),
    (_MAX_EVAL_BATCHES, 1),
    (_GRAD_BATCHES, 0),
    (_MAX_NEW_TOKENS, 1),
    (_TOP_K, 1),
  ):
    if flag.value is not None and flag.value < minimum:
      raise app.UsageError(
        f'--{flag.name} must be >= {minimum} (or unset), got {flag.value}.'
      )
  if _TEMPERATURE.value < 0:
    raise app.UsageError(f'--temperature must be >= 0, got {_TEMPERATURE.value}.')


def _writable_dir(path: str) -> None:
  """Creates `path` and checks that a file can be written there (before any work)."""
  try:
    workdir_lib.make_writable_dir(path)
  except OSError as e:
    raise app.UsageError(
      f'Cannot write the evaluation to {path}: {e}. Pass '
      '--output_dir=<a writable directory>.'
    ) from e


def _inside(path: str, directory: str) -> bool:
  if storage.is_remote(path) or storage.is_remote(directory):
    path, directory = storage.absolute(path), storage.absolute(directory)
    return path == directory or path.startswith(directory + '/')
  path, directory = os.path.realpath(path), os.path.realpath(directory)
  return os.path.commonpath([path, directory]) == directory


def _remove_empty(path: str, top: str) -> None:
  """Removes `path` and its parents up to `top` while they are empty directories."""
  while os.path.isdir(path) and not os.listdir(path):
    os.rmdir(path)
    if path == top:
      return
    path = os.path.dirname(path)


def _lock_if_inside(out_dir: str, workdir: str, stop_signal: preemption.StopSignal):
  """The workdir's lock, taken when `out_dir` is inside it (else None); released
  also when a signal ends the process."""
  if not _inside(out_dir, workdir):
    return None
  held = []  # a signal ends the process: the lock released, even half taken
  stop_signal.on_early_exit(
    lambda: held[0].release() if held else lease.release_if_mine(workdir)
  )
  try:
    lock = lease.acquire(storage.absolute(workdir), 'eval.py')
    held.append(lock)
  except workdir_lib.WorkdirLockedError as e:
    raise app.UsageError(
      f'{e} To write now, write elsewhere: --output_dir=DIR.'
    ) from None
  except OSError as e:
    raise app.UsageError(
      f'Cannot write into the workdir {workdir}: {e}. Pass '
      '--output_dir=<a writable directory>.'
    ) from e
  for message in lock.messages:
    print(f'WARNING: {message}')
  return lock


def _evaluate(workdir: str, step: int, stop_signal: preemption.StopSignal):
  """(eval.json record, output directory) of checkpoint `step`; the workdir is locked
  while writing into it, and an output directory this left empty is removed (also
  when a signal ends the process)."""
  out_dir = _OUTPUT_DIR.value or analysis.eval_dir(workdir, step)
  lock = _lock_if_inside(out_dir, workdir, stop_signal)
  # Empty directories this leaves behind are removed (a bucket has none).
  existed = storage.is_remote(out_dir) or os.path.exists(out_dir)
  new_top = os.path.abspath(out_dir)  # the outermost directory this will create
  while not existed and not os.path.exists(os.path.dirname(new_top)):
    new_top = os.path.dirname(new_top)
  if not existed:
    stop_signal.on_early_exit(lambda: _remove_empty(os.path.abspath(out_dir), new_top))
  try:
    _writable_dir(out_dir)
    return analysis.evaluate_and_analyze(
      workdir,
      step,
      output_dir=out_dir,
      batch_size=_BATCH_SIZE.value,
      max_eval_batches=_MAX_EVAL_BATCHES.value,
      grad_batches=_GRAD_BATCHES.value or None,
    ), out_dir
  except BaseException:
    if not existed:
      _remove_empty(os.path.abspath(out_dir), new_top)  # no empty eval/step_N/ left
    raise
  finally:
    if lock is not None:
      lock.release()


def main(argv):
  if not flags.FLAGS['verbosity'].present:
    logging.set_verbosity(logging.WARNING)  # orbax logs every file at INFO
  try:
    with preemption.StopSignal(exit_early=True) as stop_signal:
      stop_signal.early_message = lambda name: f'Stopped by {name}; nothing was saved.'
      _main(argv, stop_signal)
  except (app.UsageError, ValueError, OSError) as e:  # a bad input or I/O: one line
    if _DEBUG.value:
      traceback.print_exc()
    print(f'FATAL: {e}', file=sys.stderr)
    sys.exit(1)


def _main(argv, stop_signal: preemption.StopSignal):
  _check_flags()
  for path in (_WORKDIR.value or '', _OUTPUT_DIR.value or '', *argv[1:]):
    try:
      storage.check_supported(path, 'Directory')
    except ValueError as e:
      raise app.UsageError(str(e)) from None
  for path in (_WORKDIR.value or '', _OUTPUT_DIR.value or '', *argv[1:]):
    storage.check_reachable(path, 'Directory')  # gs:// without network: seconds
  if _COMPARE.value:
    workdirs = argv[1:]
    if not workdirs:
      raise app.UsageError('--compare needs run directories: eval.py --compare A B ...')
    not_runs = [
      w
      for w in workdirs
      if not any(
        storage.exists(os.path.join(w, name))
        for name in (checkpointing.CONFIG_JSON, 'metrics.jsonl')
      )
    ]
    if not_runs:
      raise app.UsageError(
        f'Not run directories (no config.json or metrics.jsonl): '
        f'{", ".join(map(repr, not_runs))}.'
      )
    out_dir = _OUTPUT_DIR.value or os.path.join(workdirs[0], 'compare')
    lock = _lock_if_inside(out_dir, workdirs[0], stop_signal)
    try:
      _writable_dir(out_dir)
      print(analysis.compare_runs(workdirs, out_dir))
    finally:
      if lock is not None:
        lock.release()
    print(f'Figures and compare.md in {out_dir}')
    return
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  if _WORKDIR.value is None:
    raise app.UsageError('--workdir is required (or --compare DIR1 DIR2 ...).')
  if not storage.exists(os.path.join(_WORKDIR.value, checkpointing.CONFIG_JSON)):
    raise app.UsageError(f'{_WORKDIR.value} is not a run directory (no config.json).')

  if _PROMPT.value is not None:
    model, config, step = checkpointing.restore_model(_WORKDIR.value, _STEP.value)
    # The run's own tokenizer: bytes, or <workdir>/tokenizer.model.
    tokenizer = data.make_tokenizer(config.data, workdir=_WORKDIR.value)
    trained = config.train.seq_len
    longest = max(
      len(sampling.encode_text(p, tokenizer=tokenizer)) for p in _PROMPT.value
    )
    if longest + _MAX_NEW_TOKENS.value > trained:
      print(
        f'WARNING: prompt and continuation reach {longest + _MAX_NEW_TOKENS.value} '
        f'tokens, past the {trained} the model was trained on (train.seq_len): '
        'positions beyond it were never seen. The prompt is read in chunks of '
        f'{trained} tokens, so memory grows with its length, not its square.'
      )
    texts = sampling.generate_text(
      model,
      list(_PROMPT.value),
      _MAX_NEW_TOKENS.value,
      temperature=_TEMPERATURE.value,
      top_k=_TOP_K.value,
      seed=_SEED.value,
      tokenizer=tokenizer,
      prefill_chunk=trained,
    )
    print(
      f'[step {step}, temperature {_TEMPERATURE.value}, top_k {_TOP_K.value}, '
      f'seed {_SEED.value}]'
    )
    for prompt, text in zip(_PROMPT.value, texts):
      print(prompt + text)
    return

  workdir = _WORKDIR.value
  checkpointer = checkpointing.Checkpointer(
    workdir, save_every=0, keep=None, async_save=False, read_only=True
  )
  steps = sorted(checkpointer.all_steps(), reverse=True)
  checkpointer.close()
  if _STEP.value is not None:
    steps = [_STEP.value]
  elif not steps:
    raise app.UsageError(f'No checkpoint in {checkpointing.checkpoint_dir(workdir)}.')
  try:
    record, out_dir = checkpointing.newest_that_restores(
      workdir, steps, lambda step: _evaluate(workdir, step, stop_signal), say=print
    )
  except checkpointing.CheckpointRestoreError as e:
    raise ValueError(str(e)) from e  # one FATAL line, as FileNotFoundError gets
  print(
    f'step {record["step"]}: held-out loss {record["loss"]:.4f} nats/token, '
    f'{record["bits_per_byte"]:.4f} bits/byte, perplexity '
    f'{record["perplexity"]:.3f} over {int(record["num_tokens"]):,} tokens '
    f'({record["num_batches"]} batches{"" if record["whole_split"] else ", partial"})'
  )
  print(f'eval.json, analysis.npz and figures in {out_dir}')


if __name__ == '__main__':
  app.run(main)
