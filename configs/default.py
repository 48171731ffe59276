"""Default: a small Block AttnRes model on the embedded Shakespeare plays.

Trains on 2 CPU cores in a few minutes (`python train.py`), then reports the held-out
bits per byte on the whole validation split (three plays).
"""

import ml_collections

from attnres_jax import config as model_config_lib
from attnres_jax import data
from attnres_jax import sharding
from attnres_jax import train


def get_config() -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()
  config.model = model_config_lib.model_config(
      d_model=128, num_layers=4, num_heads=4, mlp_dim=384,
      residual='block', block_size=2)
  config.data = data.default_config()
  config.train = train.default_train_config(
      batch_size=16, seq_len=128, num_steps=600, learning_rate=3e-3,
      warmup_steps=60, log_every=25, eval_every=None, checkpoint_every=200)
  # All devices data parallel; e.g. --config.mesh.shape='(2,2,2)' for data x FSDP x
  # tensor parallelism (the logical-axis rules are config.mesh.rules).
  config.mesh = sharding.default_mesh_config()
  return config
