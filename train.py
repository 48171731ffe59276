"""Trains an AttnRes language model: python train.py [--config=configs/x.py] [--workdir=DIR].

Config overrides on the command line, e.g.
  python train.py --config=configs/paper_small.py:block --config.train.num_steps=100
"""

from absl import app
from absl import flags
from absl import logging
from ml_collections import config_flags

from attnres_jax import train

_CONFIG = config_flags.DEFINE_config_file(
    'config', 'configs/default.py', 'Training configuration file.', lock_config=True)
_WORKDIR = flags.DEFINE_string(
    'workdir', 'workdirs/default',
    'Checkpoints, metrics and config.json; a run resumes from the latest checkpoint.')


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  if not flags.FLAGS['verbosity'].present:
    logging.set_verbosity(logging.WARNING)  # orbax logs every file at INFO
  train.train_and_evaluate(_CONFIG.value, _WORKDIR.value)


if __name__ == '__main__':
  app.run(main)
