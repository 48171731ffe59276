"""Tiny: trains in seconds on a CPU; for tests and quick local runs (big_vision's
`runlocal`). Evaluates on the first few eval batches only."""

import ml_collections

from attnres_jax import config as model_config_lib
from attnres_jax import data
from attnres_jax import sharding
from attnres_jax import train


def get_config() -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()
  config.model = model_config_lib.model_config(
      d_model=32, num_layers=2, num_heads=2, mlp_dim=64,
      residual='block', block_size=2)
  config.data = data.default_config()
  config.data.shuffle_window = 256
  config.train = train.default_train_config(
      batch_size=8, seq_len=32, num_steps=30, learning_rate=1e-2, warmup_steps=5,
      log_every=5, eval_every=None, max_eval_batches=4, checkpoint_every=10,
      keep_checkpoints=2)
  config.mesh = sharding.default_mesh_config()
  return config
