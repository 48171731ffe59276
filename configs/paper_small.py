"""The paper's comparison at small scale: Standard vs Full vs Block AttnRes.

  python train.py --config=configs/paper_small.py:block --workdir=workdirs/small_block

`get_config(arg)` with arg 'standard', 'full' or 'block'; the three presets differ only
in `model.residual`, so their runs compare the residual alone (same data order, same
initial shared weights). Block uses S = 2 sublayers per block: N = 8 blocks over the 16
sublayers, about the paper's N. Sized for an accelerator: on 2 CPU cores one step takes
a few seconds.
"""

import ml_collections

from attnres_jax import config as model_config_lib
from attnres_jax import data
from attnres_jax import sharding
from attnres_jax import train

RESIDUALS = ('standard', 'full', 'block')


def get_config(arg: str = 'block') -> ml_collections.ConfigDict:
  if arg not in RESIDUALS:
    raise ValueError(f'configs/paper_small.py:<arg> must be standard, full or block, '
                     f'got {arg!r}.')
  config = ml_collections.ConfigDict()
  config.model = model_config_lib.model_config(
      d_model=256, num_layers=8, num_heads=4, mlp_dim=768,
      residual=arg, block_size=2)
  config.data = data.default_config()
  config.train = train.default_train_config(
      batch_size=32, seq_len=256, num_steps=5000, learning_rate=2e-3,
      warmup_steps=250, schedule='cosine', log_every=50, eval_every=1000,
      checkpoint_every=1000)
  config.mesh = sharding.default_mesh_config()
  return config
