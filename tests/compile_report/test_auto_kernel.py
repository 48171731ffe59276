"""`model.depth_kernel='auto'` (the default): the Pallas kernels where the step is
compiled for TPU devices and they fit, XLA elsewhere (kernels/pallas_mesh.py,
choose_kernel). The TPU compiles need libtpu (pinned in requirements.txt)."""

import importlib.util
import logging
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from attnres_jax import config as config_lib
from attnres_jax import residuals
from attnres_jax.compile_report import aot
from attnres_jax.compile_report import tpu_topology
from attnres_jax.kernels import pallas_mesh
from attnres_jax.models import transformer as model_lib
from attnres_jax.nn import sharding
from configs import default as default_config

needs_libtpu = pytest.mark.skipif(
  importlib.util.find_spec('libtpu') is None,
  reason='libtpu (the TPU compiler) is not installed',
)
KERNEL_CALL = 'custom_call_target="tpu_custom_call"'


def test_the_default_is_auto():
  assert config_lib.ModelConfig().depth_kernel == 'auto'
  assert default_config.get_config().model.depth_kernel == 'auto'


@needs_libtpu
def test_default_config_compiled_for_a_tpu_topology_runs_the_phase1_kernel(tmp_path):
  """The tiny default run (Block AttnRes), nothing set, compiled as `train.py
  --compile_only --topology=v5e:2x2` compiles it: Mosaic kernels in the train step
  (Phase 1 forward and backward, the final read)."""
  config = default_config.get_config('tiny')
  aot.compile_report(config, 'v5e:2x2', steps=('train',), hlo_dir=str(tmp_path))
  with open(os.path.join(tmp_path, 'train.hlo.txt'), encoding='utf-8') as f:
    assert f.read().count(KERNEL_CALL) >= 2


def test_default_model_on_the_cpu_runs_xla():
  """On the CPU, under a mesh of CPU devices or none, the default model's forward
  pass holds no Pallas call."""
  cfg = config_lib.ModelConfig(d_model=32, num_layers=2, num_heads=2, mlp_dim=64)
  tokens = jnp.zeros((2, 16), jnp.int32)

  def forward(cfg):
    graphdef, state = nnx.split(model_lib.Transformer(cfg, rngs=nnx.Rngs(0)))
    return str(jax.make_jaxpr(lambda s: nnx.merge(graphdef, s)(tokens))(state))

  mesh = jax.sharding.Mesh(
    np.array(jax.devices()[:1]).reshape(1, 1, 1), sharding.AXIS_NAMES
  )
  with sharding.logical_rules(mesh, sharding.DEFAULT_RULES):
    assert 'pallas_call' not in forward(cfg)
  assert 'pallas_call' not in forward(cfg)
  # Set to the kernel, the same model holds it (interpret mode on the CPU).
  assert 'pallas_call' in forward(cfg.replace(depth_kernel='pallas'))


def kernel_on_tpu(rules=None, **fields):
  """The kernel a residual of the tiny config with `fields` picks while a step for
  v5p:2x2x1 (4 devices, data parallel) is traced."""
  devices = tpu_topology.get_topology('v5p:2x2x1').devices
  mesh = jax.sharding.Mesh(np.array(devices).reshape(4, 1, 1), sharding.AXIS_NAMES)
  cfg = config_lib.model_config(
    **{**dict(d_model=32, num_layers=2, num_heads=2), **fields}
  )
  with sharding.logical_rules(mesh, {**sharding.DEFAULT_RULES, **(rules or {})}):
    return residuals.make(cfg).kernel


@needs_libtpu
def test_auto_picks_the_kernels_for_tpu_where_they_fit(monkeypatch, caplog):
  monkeypatch.setattr(pallas_mesh, '_SAID', set())
  assert kernel_on_tpu(residual='block') == 'pallas'
  assert kernel_on_tpu(residual='full') == 'pallas'
  assert kernel_on_tpu(residual='mhc') == 'pallas'  # HC's kernels: the same rule
  assert kernel_on_tpu(residual='block', depth_kernel='xla') == 'xla'
  assert kernel_on_tpu(residual='full', depth_window=2) == 'xla'  # read in one shot
  # One segment of 16 layers at width 2048 needs 70 MiB of VMEM, more than v5p's 64
  # (explicit 'pallas' is refused: tests/kernels/test_depth_pallas.py): XLA, said
  # once in the log.
  wide = dict(residual='full', dtype='bfloat16', num_layers=16, schedule_layers=16)
  wide.update(d_model=2048, num_heads=16)
  with caplog.at_level(logging.WARNING):
    for _ in range(2):  # two traces
      assert kernel_on_tpu(**wide) == 'xla'
  said = [r.getMessage() for r in caplog.records if 'needs 69.6 MiB' in r.getMessage()]
  assert len(said) == 1, said
  # Rules that split the depth buffer's width: the kernels refuse them, so XLA.
  assert kernel_on_tpu({'hidden': ('data',)}, residual='block') == 'xla'
