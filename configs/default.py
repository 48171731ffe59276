"""Default: a small Block AttnRes model on the embedded Shakespeare plays.

Trains on 2 CPU cores in a few minutes (`python train.py`), then reports the held-out
bits per byte on the whole validation split (three plays).
"""

import ml_collections

from attnres_jax import config as model_config_lib
from attnres_jax import data
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
  # Placeholder for the scale-out work: all devices on the data axis.
  config.mesh = ml_collections.ConfigDict(dict(
      shape=(-1, 1, 1), axis_names=('data', 'fsdp', 'tensor')))
  return config
