"""`model.remat='offload'` compiled for a TPU topology moves the kept activations to
host memory (nn/remat.py; on the CPU it runs as 'minimal': tests/nn/test_remat.py)."""

import importlib.util
import os

import pytest

from attnres_jax.compile_report import aot
from configs import default as default_config

HOST_MEMORY = 'S(5)'  # the TPU compiler's memory space of pinned host buffers


@pytest.mark.skipif(
  importlib.util.find_spec('libtpu') is None,
  reason='libtpu (the TPU compiler) is not installed',
)
def test_offload_puts_kept_activations_in_host_memory(tmp_path):
  counts = {}
  for policy in ('minimal', 'offload'):
    config = default_config.get_config('tiny')
    config.model.update(residual='standard', remat=policy)
    hlo_dir = str(tmp_path / policy)
    aot.compile_report(config, 'v5p:2x2x1', steps=('train',), hlo_dir=hlo_dir)
    with open(os.path.join(hlo_dir, 'train.hlo.txt'), encoding='utf-8') as f:
      counts[policy] = f.read().count(HOST_MEMORY)
  assert counts['minimal'] == 0 < counts['offload'], counts
