"""Tests of evaluation, analysis and sampling (attnres_jax/evaluate, analysis, sampling)."""

import functools
import json
import math
import os
import subprocess
import sys

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized
from flax import nnx

from attnres_jax.evaluation import analysis
from attnres_jax.evaluation import evaluate
from attnres_jax.evaluation import statistics
from attnres_jax.inference import sampling

from conftest import assert_greedy_choices, child_env, tiny_model

# (residual, block_size): Block S=4 with 6 sublayers has a partial last block.
MODES = [('standard', 1), ('full', 1), ('block', 1), ('block', 4)]
MODE_IDS = ['standard', 'full', 'block_S1', 'block_S4']
VOCAB = 256
NUM_LAYERS = 3  # conftest.TINY_MODEL


@nnx.jit
def forward(model, tokens_BT):
  """The plain forward pass (no cache), jitted to keep the tests fast."""
  return model(tokens_BT)


def random_batches(num_batches=2, batch=3, length=8, *, pad_last=True, seed=0):
  """Batches like data.Datasets.eval_batches(): the last one padded at its end."""
  rng = np.random.default_rng(seed)
  batches = []
  for b in range(num_batches):
    window = rng.integers(1, VOCAB, (batch, length + 1)).astype(np.int32)
    weights = np.ones((batch, length), np.float32)
    if pad_last and b == num_batches - 1:
      window.reshape(-1)[batch * (length + 1) // 2 :] = 0  # a padded suffix
      weights = (window[:, 1:] != 0).astype(np.float32)
    batches.append(
      {'inputs': window[:, :-1], 'targets': window[:, 1:], 'weights': weights}
    )
  return batches


def expected_sources(num_sublayers, block_size):
  """Per sublayer, the number of sources it reads, and the final read's, from the
  rules of docs/method.md, by simulating the blocks (independent of depth.py)."""
  completed, partial, counts = ['emb'], None, []
  for l in range(num_sublayers):
    counts.append(len(completed) + (partial is not None))
    partial = f'out{l}' if partial is None else partial + f'+out{l}'
    if (l + 1) % block_size == 0:
      completed.append(partial)
      partial = None
  final = len(completed) + (partial is not None)
  return counts, final


# -- metrics ------------------------------------------------------------------------


def test_metrics_equal_direct_computation():
  model = tiny_model('block', 3, random_depth=True)
  batches = random_batches(3)
  assert 0 < batches[-1]['weights'].sum() < batches[-1]['weights'].size

  metrics = evaluate.evaluate_model(model, iter(batches))  # a one-shot iterator is enough

  total_nll = total_weight = 0.0
  for batch in batches:
    logits = np.asarray(forward(model, jnp.asarray(batch['inputs'])), np.float64)
    log_z = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(
      -1
    )
    target_logit = np.take_along_axis(logits, batch['targets'][..., None], -1)[..., 0]
    total_nll += np.sum((log_z - target_logit) * batch['weights'])
    total_weight += batch['weights'].sum()
  loss = total_nll / total_weight
  assert metrics['num_tokens'] == total_weight
  assert metrics['num_batches'] == 3
  np.testing.assert_allclose(metrics['loss'], loss, rtol=1e-5)
  np.testing.assert_allclose(metrics['bits_per_byte'], loss / math.log(2), rtol=1e-5)
  np.testing.assert_allclose(metrics['perplexity'], math.exp(loss), rtol=1e-5)


def depth_statistics(model, batches):
  return evaluate.evaluate_model(model, batches, collect_stats=True)['stats']


@pytest.mark.parametrize('residual,block_size', MODES, ids=MODE_IDS)
def test_statistics_pass_gives_the_same_metrics(residual, block_size):
  """One pass gives the metrics and the statistics: collecting them (one-shot reads)
  leaves the metrics of the plain (two-phase) pass unchanged."""
  model = tiny_model(residual, block_size, random_depth=True)
  batches = random_batches(2)
  plain = evaluate.evaluate_model(model, batches)
  with_stats = evaluate.evaluate_model(model, batches, collect_stats=True)
  assert set(with_stats.pop('stats')) >= {'input_rms', 'output_rms', 'num_tokens'}
  assert with_stats.keys() == plain.keys()
  for key in ('num_tokens', 'num_bytes', 'num_batches'):
    assert with_stats[key] == plain[key]
  # The one-shot and two-phase reads differ only in float32 summation order.
  np.testing.assert_allclose(with_stats['loss'], plain['loss'], rtol=1e-5)


@pytest.mark.parametrize('residual,block_size', [('standard', 1), ('block', 3)])
def test_statistics_are_means_over_weighted_tokens(residual, block_size):
  """Padding (weight 0) does not count: the statistics of a batch whose last rows are
  padding equal those of its unpadded rows alone, and differ from an unweighted mean
  (the positive control)."""
  model = tiny_model(residual, block_size, random_depth=True)
  full = random_batches(1, batch=4, pad_last=False)[0]
  padded = dict(
    full, weights=full['weights'] * np.array([[1], [1], [0], [0]], np.float32)
  )
  kept = {k: v[:2] for k, v in full.items()}
  got, want, unweighted = (depth_statistics(model, [b]) for b in (padded, kept, full))
  for name in want:
    # Weighted sums over a batch twice as large: float32 summation order only.
    np.testing.assert_allclose(got[name], want[name], rtol=1e-5, err_msg=name)
  assert not np.allclose(got['output_rms'], unweighted['output_rms'], rtol=1e-5)


class EvalSumsJitTest(chex.TestCase):
  """The sums of one batch are the same function jitted (training, eval.py) or not."""

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.parameters(*MODES)
  def test_eval_sums(self, residual, block_size):
    model = tiny_model(residual, block_size, random_depth=True)
    graphdef, params = nnx.split(model)
    batch = jax.tree.map(jnp.asarray, random_batches(1)[0])
    sums = self.variant(
      functools.partial(evaluate.eval_sums, graphdef=graphdef, collect_stats=True)
    )(params, batch)
    reference = jax.jit(
      functools.partial(evaluate.eval_sums, graphdef=graphdef, collect_stats=True)
    )(params, batch)
    # Eager and jitted XLA programs may fuse (and so round) differently: float32 ulps.
    chex.assert_trees_all_close(sums, reference, rtol=1e-5, atol=1e-6)
    assert float(sums['tokens']) == float(np.sum(random_batches(1)[0]['weights']))


def test_no_weighted_tokens_is_an_error():
  batch = random_batches(1, pad_last=False)[0]
  batch['weights'] = np.zeros_like(batch['weights'])
  with pytest.raises(ValueError, match='weight > 0'):
    evaluate.evaluate_model(tiny_model('standard'), [batch])


# -- depth weights ------------------------------------------------------------------


@pytest.mark.parametrize('residual,block_size', [('full', 1), ('block', 2), ('block', 4)])
def test_depth_weights_uniform_over_valid_sources_at_zero_queries(residual, block_size):
  model = tiny_model(residual, block_size)  # queries are initialised to zero
  stats = depth_statistics(model, random_batches(2))
  size = 1 if residual == 'full' else block_size
  counts, final_count = expected_sources(2 * NUM_LAYERS, size)
  weights = stats['depth_weights'].reshape(2 * NUM_LAYERS, -1)  # A0, M0, A1, ...
  assert weights.shape[1] == final_count  # every slot is read by the final read
  for l, count in enumerate(counts):
    np.testing.assert_allclose(weights[l, :count], 1.0 / count, rtol=1e-6)
    np.testing.assert_array_equal(weights[l, count:], 0.0)
  np.testing.assert_allclose(stats['final_depth_weights'], 1.0 / final_count, rtol=1e-6)
  np.testing.assert_allclose(
    stats['depth_entropy'].reshape(-1), np.log(counts), atol=1e-6
  )
  mask, _ = statistics.valid_source_mask(model.cfg)
  np.testing.assert_array_equal(mask.reshape(2 * NUM_LAYERS, -1).sum(-1), counts)


@pytest.mark.parametrize('residual,block_size', [('full', 1), ('block', 4)])
def test_depth_weight_rows_sum_to_one(residual, block_size):
  model = tiny_model(residual, block_size, random_depth=True)
  stats = depth_statistics(model, random_batches(2))
  counts, _ = expected_sources(2 * NUM_LAYERS, 1 if residual == 'full' else block_size)
  weights = stats['depth_weights'].reshape(2 * NUM_LAYERS, -1)
  np.testing.assert_allclose(weights.sum(-1), 1.0, rtol=1e-5)
  np.testing.assert_allclose(stats['final_depth_weights'].sum(), 1.0, rtol=1e-5)
  for l, count in enumerate(counts):
    np.testing.assert_array_equal(weights[l, count:], 0.0)
    if count > 1:  # the random queries make the reads non-uniform
      assert np.ptp(weights[l, :count]) > 1e-3
  assert np.all(stats['depth_entropy'].reshape(-1) <= np.log(counts) + 1e-6)


def test_sublayer_grad_norm_grouping():
  num_layers, d = 3, 2
  rng = np.random.default_rng(0)
  grads = {
    'attention': {
      'query': rng.normal(size=(num_layers, d, 2)),
      'out': rng.normal(size=(num_layers, 2, d)),
    },
    'attention_norm': {'scale': rng.normal(size=(num_layers, d))},
    'mlp': {'up': rng.normal(size=(num_layers, d, 4))},
    'mlp_norm': {'scale': rng.normal(size=(num_layers, d))},
    'residual': {
      'query': rng.normal(size=(num_layers, 2, d)),
      'gain': rng.normal(size=(num_layers, 2, d)),
    },
  }
  norms = statistics.sublayer_grad_norms(grads)
  for k in range(num_layers):
    attention = np.concatenate(
      [
        grads['attention']['query'][k].ravel(),
        grads['attention']['out'][k].ravel(),
        grads['attention_norm']['scale'][k],
        grads['residual']['query'][k, 0],
        grads['residual']['gain'][k, 0],
      ]
    )
    mlp = np.concatenate(
      [
        grads['mlp']['up'][k].ravel(),
        grads['mlp_norm']['scale'][k],
        grads['residual']['query'][k, 1],
        grads['residual']['gain'][k, 1],
      ]
    )
    np.testing.assert_allclose(norms[k], [np.linalg.norm(attention), np.linalg.norm(mlp)])


# -- figures ------------------------------------------------------------------------


@pytest.mark.parametrize('residual,block_size', MODES, ids=MODE_IDS)
def test_figures_written_for_every_mode(residual, block_size, tmp_path):
  model = tiny_model(residual, block_size, random_depth=True)
  result = analysis.analyze(model, random_batches(2), str(tmp_path), grad_batches=2)
  expected = {'analysis.npz', 'magnitudes.png', 'grad_norms.png'}
  if residual != 'standard':
    expected |= {'depth_weights.png', 'depth_entropy.png'}
  assert {os.path.basename(f) for f in result['files']} == expected
  assert set(os.listdir(tmp_path)) == expected
  for name in expected - {'analysis.npz'}:
    with open(tmp_path / name, 'rb') as f:
      content = f.read()
    assert content.startswith(b'\x89PNG') and len(content) > 5000, name
  with np.load(tmp_path / 'analysis.npz') as data:
    assert data['output_rms'].shape == data['input_rms'].shape == (NUM_LAYERS, 2)
    grad_norm = data['grad_norm']
    assert grad_norm.shape == (NUM_LAYERS, 2) and np.all(np.isfinite(grad_norm))
    assert np.all(grad_norm > 0)
    assert data['grad_tokens'] == sum(b['weights'].sum() for b in random_batches(2))
    if residual != 'standard':
      assert data['depth_weights'].shape == data['valid_sources'].shape


# -- sampling -----------------------------------------------------------------------


@pytest.mark.parametrize('residual,block_size', MODES, ids=MODE_IDS)
def test_cached_generation_equals_full_recomputation(residual, block_size):
  model = tiny_model(residual, block_size, random_depth=True)
  prompt = np.array([[3, 70, 80, 90, 100], [0, 65, 66, 67, 68]], np.int32)
  compiled_before = sampling._step._cache_size()
  tokens, logits = sampling.generate(
    model, prompt, 6, temperature=0.0, return_logits=True
  )
  # One compilation of the one-token step for all positions.
  assert sampling._step._cache_size() - compiled_before <= 1
  assert tokens.shape == (2, 6) and logits.shape == (2, 6, VOCAB)

  sequence = np.concatenate([prompt, tokens], axis=1)
  filler = np.random.default_rng(0).integers(1, VOCAB, sequence.shape).astype(np.int32)
  for i in range(tokens.shape[1]):
    # Recompute the whole prefix that chose token i, without a cache. The prefix is
    # padded to one length (one compilation) with random tokens after it, which a
    # causal model ignores.
    end = prompt.shape[1] + i
    padded = np.concatenate([sequence[:, :end], filler[:, end:]], axis=1)
    last_logits = np.asarray(forward(model, jnp.asarray(padded)))[:, end - 1]
    np.testing.assert_allclose(logits[:, i], last_logits, atol=2e-4, rtol=1e-4)
    assert_greedy_choices(tokens[:, i], last_logits, atol=2e-4, rtol=1e-4)


def test_sampling_is_deterministic_for_a_seed():
  model = tiny_model('block', 3, random_depth=True)
  prompt = sampling.encode_text('ROMEO:')
  run = lambda seed, **kw: sampling.generate(
    model,
    prompt,
    12,
    temperature=kw.get('temperature', 1.0),
    top_k=kw.get('top_k'),
    seed=seed,
  )
  first = run(0)
  compiled = sampling._step._cache_size()
  np.testing.assert_array_equal(first, run(0))
  assert first.shape == (12,) and first.dtype == np.int32
  assert not np.array_equal(first, run(1))
  # top_k = 1 leaves only the most likely token: the greedy output.
  np.testing.assert_array_equal(run(5, top_k=1), run(0, temperature=0.0))
  # Settings are traced: nothing was recompiled for them.
  assert sampling._step._cache_size() == compiled


def test_byte_text_helpers():
  text = 'ROMEO: Ñame'
  tokens = sampling.encode_text(text, add_separator=True)
  assert tokens[0] == sampling.SEPARATOR and tokens.dtype == np.int32
  assert len(tokens) == 1 + len(text.encode('utf-8'))
  assert sampling.decode_tokens(tokens) == text
  assert sampling.decode_tokens([0xC3]) == '\ufffd'  # a cut multi-byte character


# -- comparing runs -----------------------------------------------------------------


def _fake_run(root, name, *, losses, evals):
  """A workdir with metrics.jsonl and eval/step_N/{eval.json, analysis.npz}."""
  workdir = root / name
  workdir.mkdir()
  with open(workdir / 'metrics.jsonl', 'w', encoding='utf-8') as f:
    for step, loss in losses:
      f.write(
        json.dumps({'step': step, 'train/loss': loss, 'train/learning_rate': 1e-3}) + '\n'
      )
    f.write(json.dumps({'step': losses[-1][0], 'eval/loss': 'nan'}) + '\n')
  for step, record in evals.items():
    out = workdir / 'eval' / f'step_{step}'
    out.mkdir(parents=True)
    (out / 'eval.json').write_text(json.dumps(dict(record, step=step)))
    np.savez(
      out / 'analysis.npz',
      output_rms=np.arange(1.0, 5.0).reshape(2, 2),
      input_rms=np.ones((2, 2)),
      grad_norm=np.full((2, 2), 0.5),
    )
  return str(workdir)


def test_compare_runs_table_and_figures(tmp_path):
  std = _fake_run(
    tmp_path,
    'std',
    losses=[(10, 3.0), (20, 2.5)],
    evals={
      9: {'residual': 'standard', 'block_size': None, 'loss': 9.0},
      10: {
        'residual': 'standard',
        'block_size': None,
        'num_params': 12345,
        'loss': 2.25,
        'bits_per_byte': 2.25 / math.log(2),
        'perplexity': math.exp(2.25),
        'num_tokens': 1000.0,
        'whole_split': True,
      },
    },
  )
  block = _fake_run(
    tmp_path,
    'block',
    losses=[(10, 2.9)],
    evals={
      5: {
        'residual': 'block',
        'block_size': 2,
        'num_params': 12345,
        'loss': 2.5,
        'bits_per_byte': 3.0,
        'perplexity': 12.0,
        'num_tokens': 64.0,
        'whole_split': False,
      }
    },
  )
  untested = _fake_run(tmp_path, 'untested', losses=[(1, 5.0)], evals={})
  out = tmp_path / 'compare'

  table = analysis.compare_runs([std, block, untested], str(out))

  lines = table.strip().split('\n')
  assert lines[0] == (
    '| run | residual | S | step | params | held-out loss | '
    'bits/byte | perplexity | eval tokens |'
  )
  assert lines[2] == (
    '| std | standard | - | 10 | 12,345 | 2.2500 | 3.2461 | 9.4877 | 1,000 |'
  )
  assert lines[3] == (
    '| block | block | 2 | 5 | 12,345 | 2.5000 | 3.0000 | 12.0000 | 64 (partial) |'
  )
  assert lines[4] == '| untested | - | - | - | - | - | - | - | - |'
  assert (out / 'compare.md').read_text() == table
  for name in ('loss_curves.png', 'magnitudes.png'):
    assert (out / name).stat().st_size > 5000
  records = analysis.read_metrics(std)
  assert math.isnan(records[-1]['eval/loss'])
  assert analysis.latest_eval_dir(std).endswith('step_10')  # numeric, not lexical
  assert analysis.latest_eval_dir(untested) is None


# -- end to end: a trained workdir ----------------------------------------------------


def test_evaluate_and_analyze_a_trained_run(tmp_path, tfds_dir):
  from configs import default as default_config  # pylint: disable=g-import-not-at-top
  from attnres_jax.runs import checkpointing  # pylint: disable=g-import-not-at-top
  from attnres_jax.training import loop as loop_lib

  config = default_config.get_config('tiny')
  config.data.tfds_data_dir = tfds_dir
  # The schedule of test_train's resumed runs: one compilation for both modules.
  config.train.update(
    num_steps=8,
    warmup_steps=2,
    checkpoint_every=4,
    log_every=1,
    max_eval_batches=1,
    async_checkpointing=False,
  )
  workdir = str(tmp_path / 'run')
  loop_lib.train_and_evaluate(config, workdir)

  record = analysis.evaluate_and_analyze(workdir, max_eval_batches=3, grad_batches=1)

  out = tmp_path / 'run' / 'eval' / 'step_8'
  assert json.loads((out / 'eval.json').read_text()) == record
  assert record['step'] == 8 and record['num_batches'] == 3
  assert record['whole_split'] is False and record['residual'] == 'block'
  assert 0 < record['num_tokens'] <= 3 * 8 * config.train.seq_len
  assert set(record['files']) <= set(os.listdir(out))
  assert 'depth_weights.png' in record['files']
  model, _, step = checkpointing.restore_model(workdir)
  assert step == 8
  text = sampling.generate_text(model, 'ROMEO:', 5, temperature=0.0)
  assert isinstance(text, str)
  table = analysis.compare_runs([workdir], str(tmp_path / 'compare'))
  assert '| run | block | 2 | 8 |' in table


def _eval_cli(*args, timeout=300):
  """Starts `eval.py` with `args` (to run several at once)."""
  repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  return subprocess.Popen(
    [sys.executable, 'eval.py', *args],
    cwd=repo,
    env=child_env(1),
    text=True,
    stdout=subprocess.PIPE,
    stderr=subprocess.STDOUT,
  )


def test_eval_cli_refuses_bad_input_before_computing(tmp_path):
  from attnres_jax.runs import workdir as workdir_lib  # pylint: disable=g-import-not-at-top

  # No checkpoints are needed: every case must fail before restoring anything.
  workdir, busy = str(tmp_path / 'run'), str(tmp_path / 'busy')
  os.makedirs(os.path.join(workdir, 'eval'))
  (tmp_path / 'run' / 'eval' / 'step_2').write_text('')  # where the output would go
  os.makedirs(busy)
  for run in (workdir, busy):
    with open(os.path.join(run, 'config.json'), 'w') as f:
      f.write('{}')
  with workdir_lib.WorkdirLock(busy, 'train'):  # as a training run holds it
    runs = {
      'compare': _eval_cli('--compare', workdir, str(tmp_path / 'does_not_exist')),
      'batch_size': _eval_cli(f'--workdir={workdir}', '--batch_size=0'),
      'no_run': _eval_cli(f'--workdir={tmp_path}/does_not_exist'),
      'unwritable': _eval_cli(f'--workdir={workdir}', '--step=2'),
      'locked': _eval_cli(f'--workdir={busy}', '--step=2'),
    }
    if os.geteuid() != 0:  # root writes anywhere
      read_only = str(tmp_path / 'read_only')
      os.makedirs(read_only)
      with open(os.path.join(read_only, 'config.json'), 'w') as f:
        f.write('{}')
      os.chmod(read_only, 0o500)
      runs['read_only'] = _eval_cli(f'--workdir={read_only}', '--step=2')
    outputs = {name: run.communicate(timeout=300)[0] for name, run in runs.items()}
  assert all(run.returncode == 1 for run in runs.values()), outputs
  assert (
    f"Not run directories (no config.json or metrics.jsonl): '{tmp_path}/does_not_exist'."
  ) in outputs['compare']
  assert (
    f'{tmp_path}/does_not_exist is not a run directory (no config.json).'
    in outputs['no_run']
  )
  assert '--batch_size must be >= 1 (or unset), got 0.' in outputs['batch_size']
  assert (
    f'Cannot write the evaluation to {workdir}/eval/step_2: ' in outputs['unwritable']
  )
  assert f'in use by pid {os.getpid()} on host' in outputs['locked']
  assert '--output_dir=DIR' in outputs['locked']
  if 'read_only' in outputs:
    assert f'Cannot write into the workdir {read_only}' in outputs['read_only']
  for output in outputs.values():
    assert 'step 2: held-out' not in output and 'Traceback' not in output, output
