"""`eval.py --compare` (evaluation/analysis.py `compare_runs`) on fabricated workdirs:
a run that training evaluated but eval.py did not gets a full row from its
eval_final.json, and the comparison is written into the first run's workdir."""

import json
import math
import os
import subprocess
import sys

from flax import nnx

from attnres_jax.evaluation import analysis
from attnres_jax.models import transformer
from attnres_jax.runs import checkpointing
from attnres_jax.training import step as step_lib
from configs import default as default_config

from conftest import child_env

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _trained_run(root, name, *, residual, final=None, evaluated=None):
  """A workdir as training leaves it: config.json, metrics.jsonl and (`final`) the
  eval_final.json of its last step; `evaluated`: also eval.py's eval/step_N/."""
  config = default_config.get_config(f'tiny,{residual}')
  workdir = root / name
  workdir.mkdir()
  checkpointing.save_config(str(workdir), config)
  (workdir / 'metrics.jsonl').write_text(
    json.dumps({'step': 30, 'train/loss': 2.0, 'train/learning_rate': 1e-3}) + '\n'
  )
  if final is not None:
    (workdir / step_lib.EVAL_FINAL_JSON).write_text(json.dumps(final))
  if evaluated is not None:
    out = workdir / 'eval' / f'step_{evaluated["step"]}'
    out.mkdir(parents=True)
    (out / 'eval.json').write_text(json.dumps(evaluated))
  return str(workdir), config


def _final(step, loss):
  """The fields training writes (trainer.py: the eval result and the run's)."""
  return dict(
    loss=loss,
    bits_per_byte=loss / math.log(2),
    perplexity=math.exp(loss),
    num_tokens=4096.0,
    num_bytes=4096.0,
    num_batches=4,
    step=step,
    train_loss=2.0,
    dataset='tiny_shakespeare',
    split='test',
    run_seconds=1.0,
  )


def test_a_run_evaluated_by_training_alone_gets_a_full_row(tmp_path):
  block, config = _trained_run(tmp_path, 'block', residual='block', final=_final(30, 2.0))
  evaluated = dict(
    _final(20, 2.5),
    residual='standard',
    block_size=None,
    num_params=1234,
    whole_split=True,
  )
  standard, _ = _trained_run(
    tmp_path, 'standard', residual='standard', final=_final(10, 3.0), evaluated=evaluated
  )
  table = analysis.compare_runs([block, standard], str(tmp_path / 'out'))
  lines = table.strip().split('\n')
  model = transformer.Transformer(config.model, rngs=nnx.Rngs(0))
  params = transformer.count_params(model)
  # tiny evaluates the first 4 batches: not the whole split.
  assert lines[2] == (
    f'| block | block | 2 | 30 | {params:,} | 2.0000 | 2.8854 | 7.3891 | 4,096 (partial) |'
  )
  # eval.py's evaluation, of a later step than training's final one, is the row.
  assert (
    lines[3]
    == '| standard | standard | - | 20 | 1,234 | 2.5000 | 3.6067 | 12.1825 | 4,096 |'
  )


def test_the_final_record_file_is_trainings():
  assert analysis.EVAL_FINAL_JSON == step_lib.EVAL_FINAL_JSON


def test_compare_writes_into_the_first_runs_workdir(tmp_path):
  first, _ = _trained_run(tmp_path, 'a', residual='block', final=_final(30, 2.0))
  second, _ = _trained_run(tmp_path, 'b', residual='standard', final=_final(30, 2.1))
  result = subprocess.run(
    [sys.executable, 'eval.py', '--compare', first, second],
    cwd=ROOT,
    env=child_env(1),
    text=True,
    capture_output=True,
    timeout=300,
    check=False,
  )
  assert result.returncode == 0, result.stdout + result.stderr
  out = tmp_path / 'a' / 'compare'
  assert (out / 'compare.md').read_text().strip() in result.stdout
  assert '| b | standard | - | 30 |' in result.stdout
  assert not (tmp_path / 'compare').exists()
