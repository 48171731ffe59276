"""Tokenizers: UTF-8 bytes, or a SentencePiece model trained on the training split.

Both map text to int token ids and back, and give every token the number of UTF-8
bytes of the text it covers (`encode_with_bytes`), so that bits per byte are measured
on the exact text evaluated whatever the vocabulary. Each document starts with the
tokenizer's `bos_id` (the byte 0 for bytes; id 0 for the SentencePiece models trained
here), which is never a target of the loss in evaluation.

SentencePiece models trained here (`train_sentencepiece`) are unigram models over the
raw text: no normalization, whitespace kept as it is, characters outside the learned
pieces spelled as UTF-8 byte pieces (byte fallback), so `decode(encode(text)) == text`
for any text. Training is deterministic for a given sample and seed (a fixed thread
count: SentencePiece's result depends on it).
"""

from __future__ import annotations

import io
import os
import time
import uuid
from collections.abc import Iterable, Iterator
from typing import Protocol

import numpy as np
import sentencepiece as spm
from etils import epath

WORKDIR_MODEL = 'tokenizer.model'  # a run's own SentencePiece model, in its workdir
BOS_ID = 0  # the document start of the models trained here (= the byte separator)
UNK_ID = 1
TRAIN_THREADS = 8  # fixed: the trained model depends on the thread count
MAX_SENTENCE_BYTES = 1 << 14  # documents are cut into pieces of whole lines this long


class Tokenizer(Protocol):
  """What the data pipeline, evaluation and sampling need from a tokenizer."""

  name: str
  vocab_size: int
  bos_id: int  # starts every document; weight 0 as a target

  def encode(self, text: str | bytes) -> np.ndarray:
    """Token ids of `text`, int32 [N] (no document start)."""

  def encode_with_bytes(self, text: str | bytes) -> tuple[np.ndarray, np.ndarray]:
    """(token ids, UTF-8 bytes covered by each token); the bytes sum to len(text)."""

  def decode(self, tokens) -> str:
    """Text of `tokens`, document starts and out-of-vocabulary ids dropped."""


def _utf8(text: str | bytes) -> bytes:
  return text.encode('utf-8') if isinstance(text, str) else bytes(text)


class ByteTokenizer:
  """UTF-8 bytes as tokens (vocab 256); the document start is the byte 0 (NUL)."""

  name = 'bytes'
  vocab_size = 256
  bos_id = 0

  def encode(self, text: str | bytes) -> np.ndarray:
    return np.frombuffer(_utf8(text), dtype=np.uint8).astype(np.int32)

  def encode_with_bytes(self, text: str | bytes) -> tuple[np.ndarray, np.ndarray]:
    # A NUL inside a document is a document start to this tokenizer: not counted.
    tokens = self.encode(text)
    return tokens, (tokens != self.bos_id).astype(np.int32)

  def decode(self, tokens) -> str:
    """Invalid UTF-8 (e.g. a cut multi-byte character) is replaced by U+FFFD."""
    ids = np.asarray(tokens).reshape(-1)
    data = bytes(int(t) for t in ids if int(t) != self.bos_id and 0 <= int(t) < 256)
    return data.decode('utf-8', errors='replace')

  def __repr__(self) -> str:
    return 'ByteTokenizer()'


class SentencePieceTokenizer:
  """A SentencePiece model (from its serialized proto)."""

  name = 'sentencepiece'

  def __init__(self, model_proto: bytes):
    self.model_proto = bytes(model_proto)
    self._sp = spm.SentencePieceProcessor(model_proto=self.model_proto)
    self.vocab_size = self._sp.vocab_size()
    # Models from elsewhere may have no BOS (e.g. Flax lm1b's: pad 0, eos 1): their
    # EOS then starts documents.
    bos = self._sp.bos_id() if self._sp.bos_id() >= 0 else self._sp.eos_id()
    if bos < 0:
      raise ValueError(
        'The SentencePiece model has neither a BOS nor an EOS id to start documents with.'
      )
    self.bos_id = bos

  @classmethod
  def load(cls, path: str | os.PathLike) -> SentencePieceTokenizer:
    path = epath.Path(path)
    if not path.exists():
      raise FileNotFoundError(f'No SentencePiece model at {path}.')
    return cls(path.read_bytes())

  def save(self, path: str | os.PathLike) -> None:
    """Writes the model to `path` atomically (a uniquely named temporary file, then a
    rename), so hosts that write the same model to a shared disk do not collide."""
    path = epath.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f'.{path.name}.tmp.{uuid.uuid4().hex}'
    tmp.write_bytes(self.model_proto)
    tmp.replace(path)

  def encode(self, text: str | bytes) -> np.ndarray:
    text = text.decode('utf-8') if isinstance(text, bytes) else text
    return np.asarray(self._sp.encode(text), np.int32)

  def encode_with_bytes(self, text: str | bytes) -> tuple[np.ndarray, np.ndarray]:
    """Bytes per token from the pieces' offsets into the input; a character spelled
    as byte pieces counts one byte per piece."""
    text = text.decode('utf-8') if isinstance(text, bytes) else text
    pieces = self._sp.encode(text, out_type='proto').pieces
    tokens = np.fromiter((p.id for p in pieces), np.int32, len(pieces))
    num_bytes = np.fromiter(
      (1 if self._sp.is_byte(p.id) else p.end - p.begin for p in pieces),
      np.int32,
      len(pieces),
    )
    expected = len(text.encode('utf-8'))
    if int(num_bytes.sum()) != expected:
      raise ValueError(
        f'The SentencePiece pieces cover {int(num_bytes.sum())} bytes of a '
        f'{expected}-byte text: bits per byte would be wrong.'
      )
    return tokens, num_bytes

  def decode(self, tokens) -> str:
    ids = [
      int(t)
      for t in np.asarray(tokens).reshape(-1)
      if 0 <= int(t) < self.vocab_size and int(t) != self.bos_id
    ]
    return self._sp.decode(ids)

  def __repr__(self) -> str:
    return f'SentencePieceTokenizer(vocab_size={self.vocab_size})'


def sentences(documents: Iterable[str | bytes]) -> Iterator[str]:
  """Documents cut at line ends into pieces of at most MAX_SENTENCE_BYTES (longer
  lines cut anywhere): SentencePiece skips longer sentences. Newlines are kept."""
  for document in documents:
    text = document.decode('utf-8') if isinstance(document, bytes) else document
    chunk, size = [], 0
    for line in text.splitlines(keepends=True):
      while len(line) > MAX_SENTENCE_BYTES // 4:  # a character is at most 4 bytes
        yield line[: MAX_SENTENCE_BYTES // 4]
        line = line[MAX_SENTENCE_BYTES // 4 :]
      line_size = len(line.encode('utf-8'))
      if chunk and size + line_size > MAX_SENTENCE_BYTES:
        yield ''.join(chunk)
        chunk, size = [], 0
      chunk.append(line)
      size += line_size
    if chunk:
      yield ''.join(chunk)


def train_sentencepiece(
  documents: Iterable[str | bytes],
  vocab_size: int,
  *,
  seed: int = 0,
  verbose: bool = True,
) -> SentencePieceTokenizer:
  """A unigram SentencePiece model of `vocab_size` pieces trained on `documents`.

  Ids: 0 = BOS (document start), 1 = unknown (never produced: byte fallback), then
  256 byte pieces and the learned pieces, so `vocab_size` must exceed 258 plus the
  number of distinct characters worth a piece of their own.
  """
  if vocab_size < 300:
    raise ValueError(
      f'vocab_size {vocab_size} is too small for a SentencePiece model '
      'with byte fallback (258 ids are reserved); use >= 300.'
    )
  model = io.BytesIO()
  start = time.perf_counter()
  spm.set_random_generator_seed(seed)
  try:
    spm.SentencePieceTrainer.train(
      sentence_iterator=sentences(documents),
      model_writer=model,
      vocab_size=vocab_size,
      model_type='unigram',
      character_coverage=0.9999,
      byte_fallback=True,
      normalization_rule_name='identity',
      remove_extra_whitespaces=False,
      allow_whitespace_only_pieces=True,
      split_digits=True,
      max_sentence_length=MAX_SENTENCE_BYTES,
      bos_id=BOS_ID,
      unk_id=UNK_ID,
      eos_id=-1,
      pad_id=-1,
      num_threads=TRAIN_THREADS,
      input_sentence_size=0,
      minloglevel=0 if verbose else 2,
    )
  except RuntimeError as e:
    raise ValueError(
      f'Training a SentencePiece model of {vocab_size} pieces failed '
      f'({e}); a smaller vocab_size or a bigger sample may help.'
    ) from e
  tokenizer = SentencePieceTokenizer(model.getvalue())
  if verbose:
    print(
      f'Trained a SentencePiece model of {vocab_size} pieces in '
      f'{time.perf_counter() - start:.1f} s.',
      flush=True,
    )
  return tokenizer
