"""Causal attention per backend (kernels/attention.py): splash in Pallas interpret mode
equals XLA's attention, the automatic choice per platform, the CPU default unchanged
bit for bit, and bad settings refused before anything compiles."""

import importlib.util
import logging
import os

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from attnres_jax import config as config_lib
from attnres_jax.compile_report import aot
from attnres_jax.compile_report import tpu_topology
from attnres_jax.kernels import attention as attention_lib
from attnres_jax.kernels import splash_attention
from attnres_jax.models import transformer as model_lib
from attnres_jax.nn import sharding
from configs import default as default_config

needs_libtpu = pytest.mark.skipif(
  importlib.util.find_spec('libtpu') is None,
  reason='libtpu (the TPU compiler) is not installed',
)
needs_gpu = pytest.mark.skipif(
  jax.default_backend() != 'gpu', reason='cuDNN attention needs a GPU host'
)


def qkv(seq_len, dtype, heads=2, head_dim=32, batch=2):
  keys = jax.random.split(jax.random.key(0), 4)
  shape = (batch, seq_len, heads, head_dim)
  q, k, v, cotangent = (jax.random.normal(key, shape) for key in keys)
  return q.astype(dtype), k.astype(dtype), v.astype(dtype), cotangent


@jax.jit(static_argnames='setting')
def value_and_grads(q, k, v, cotangent, setting):
  """The attention's output and the gradients of <output, cotangent> wrt q, k, v."""

  def loss(q, k, v):
    out = attention_lib.causal_attention(q, k, v, setting)
    return jnp.sum(out.astype(jnp.float32) * cotangent), out

  grads, out = jax.grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
  return out, grads


def test_block_sizes_follow_the_shape():
  assert [splash_attention.padded_length(t) for t in (1, 24, 128, 136)] == [
    128,
    128,
    128,
    256,
  ]
  assert [splash_attention.block_for(t) for t in (128, 256, 384, 1024, 4224)] == [
    128,
    256,
    128,
    512,
    128,
  ]


@pytest.mark.parametrize('dtype', ['float32', 'bfloat16'])
@pytest.mark.parametrize('seq_len', [24, 136])  # one block of 128, two of 256: padded
def test_splash_in_interpret_mode_equals_xla(seq_len, dtype):
  q, k, v, cotangent = qkv(seq_len, dtype)
  splash_out, splash_grads = value_and_grads(q, k, v, cotangent, 'splash')
  if dtype == 'float32':
    # The kernel sums its online softmax block by block, XLA in one pass: float32 sums
    # of at most 136 terms of size <= 5 reassociated, |error| <= 136 * 2**-24 * 5 = 4e-5.
    xla_out, xla_grads = value_and_grads(q, k, v, cotangent, 'xla')
    chex.assert_trees_all_close(splash_out, xla_out, atol=4e-5, rtol=0)
    chex.assert_trees_all_close(splash_grads, xla_grads, atol=4e-5, rtol=0)
    return
  # bfloat16 inputs: both against the float32 attention of the same (rounded) inputs.
  # The kernel keeps float32 inside and rounds its outputs and gradients to bfloat16:
  # within 4 units in the last place (2**-8 relative) of the largest value; a wrong
  # mask or scale is off by O(1).
  f32 = lambda tree: jax.tree.map(lambda x: x.astype(jnp.float32), tree)
  ref_out, ref_grads = value_and_grads(*f32((q, k, v)), cotangent, 'xla')
  for got, want in zip(
    jax.tree.leaves(f32((splash_out, splash_grads))),
    jax.tree.leaves((ref_out, ref_grads)),
  ):
    bound = 4 * 2.0**-8 * float(jnp.max(jnp.abs(want)))
    chex.assert_trees_all_close(got, want, atol=bound, rtol=0)


def test_auto_on_the_cpu_is_todays_xla_call_bit_for_bit():
  q, k, v, cotangent = qkv(24, 'float32')
  today = jax.nn.dot_product_attention(q, k, v, is_causal=True)
  for setting in ('auto', 'xla'):
    assert attention_lib.choose(setting, q) == 'xla'
    chex.assert_trees_all_equal(attention_lib.causal_attention(q, k, v, setting), today)
  grads = lambda f: jax.grad(lambda *a: jnp.sum(f(*a) * cotangent), argnums=(0, 1, 2))(
    q, k, v
  )
  chex.assert_trees_all_equal(
    grads(attention_lib.causal_attention),
    grads(lambda *a: jax.nn.dot_product_attention(*a, is_causal=True)),
  )


TINY = dict(d_model=32, num_layers=2, num_heads=2, mlp_dim=64, residual='standard')


def forward(cfg, tokens):
  graphdef, state = nnx.split(model_lib.Transformer(cfg, rngs=nnx.Rngs(0)))
  run = lambda s: nnx.merge(graphdef, s)(tokens)
  return jax.jit(run)(state), str(jax.make_jaxpr(run)(state))


def test_the_model_on_the_cpu_runs_xla_unless_told_and_splash_computes_the_same():
  """The default model, with or without a CPU mesh, holds no Pallas call and no cuDNN
  call, and equals the XLA setting bit for bit; set to splash, the same model holds
  the kernel (interpret mode) and computes the same logits."""
  cfg = config_lib.model_config(**TINY)
  assert cfg.attention == 'auto'
  assert default_config.get_config().model.attention == 'auto'
  tokens = jax.random.randint(jax.random.key(1), (2, 16), 0, 256)
  mesh = jax.sharding.Mesh(
    np.array(jax.devices()[:1]).reshape(1, 1, 1), sharding.AXIS_NAMES
  )
  with sharding.logical_rules(mesh, sharding.DEFAULT_RULES):
    _, jaxpr = forward(cfg, tokens)
  auto_logits, auto_jaxpr = forward(cfg, tokens)
  for text in (jaxpr, auto_jaxpr):
    assert 'pallas_call' not in text and 'cudnn' not in text
  xla_logits, _ = forward(cfg.replace(attention='xla'), tokens)
  chex.assert_trees_all_equal(auto_logits, xla_logits)
  splash_logits, splash_jaxpr = forward(cfg.replace(attention='splash'), tokens)
  assert 'pallas_call' in splash_jaxpr
  # float32 logits of size ~3 through two layers of reassociated softmax sums.
  chex.assert_trees_all_close(splash_logits, xla_logits, atol=1e-4, rtol=0)


def tpu_mesh():
  devices = tpu_topology.get_topology('v5p:2x2x1').devices
  return jax.sharding.Mesh(np.array(devices).reshape(4, 1, 1), sharding.AXIS_NAMES)


@needs_libtpu
def test_auto_picks_splash_for_tpu_devices():
  q = jax.ShapeDtypeStruct((4, 128, 2, 32), jnp.bfloat16)
  with sharding.logical_rules(tpu_mesh(), sharding.DEFAULT_RULES):
    assert sharding.compile_platform() == 'tpu'
    assert attention_lib.choose('auto', q) == 'splash'
    assert attention_lib.choose('xla', q) == 'xla'
    with pytest.raises(ValueError, match="'cudnn' runs on a GPU only, not on tpu"):
      attention_lib.choose('cudnn', q)


@needs_libtpu
def test_auto_falls_back_to_xla_where_the_mesh_splits_the_length(monkeypatch, caplog):
  monkeypatch.setattr(attention_lib, '_SAID', set())
  q = jax.ShapeDtypeStruct((4, 128, 2, 32), jnp.bfloat16)
  rules = {**sharding.DEFAULT_RULES, 'batch': (), 'length': ('data',)}
  with sharding.logical_rules(tpu_mesh(), rules), caplog.at_level(logging.WARNING):
    for _ in range(2):
      assert attention_lib.choose('auto', q) == 'xla'
    with pytest.raises(ValueError, match="split the attention's 'length' axis"):
      splash_attention.splash_attention(q, q, q)
  assert sum("'length'" in r.getMessage() for r in caplog.records) == 1


def test_auto_on_a_gpu_picks_cudnn_where_it_supports_the_shape(monkeypatch, caplog):
  """The GPU rule with the platform faked: cuDNN for bfloat16 and head dims it takes,
  else XLA, said once; splash refused."""
  monkeypatch.setattr(sharding, 'compile_platform', lambda: 'gpu')
  monkeypatch.setattr(attention_lib, '_SAID', set())
  bf16 = jax.ShapeDtypeStruct((2, 64, 2, 64), jnp.bfloat16)
  assert attention_lib.choose('auto', bf16) == 'cudnn'
  assert attention_lib.choose('cudnn', bf16) == 'cudnn'
  f32 = jax.ShapeDtypeStruct((2, 64, 2, 64), jnp.float32)
  with caplog.at_level(logging.WARNING):
    for _ in range(2):
      assert attention_lib.choose('auto', f32) == 'xla'
  assert sum('not float32' in r.getMessage() for r in caplog.records) == 1
  wide = jax.ShapeDtypeStruct((2, 64, 2, 100), jnp.bfloat16)
  assert attention_lib.choose('auto', wide) == 'xla'
  with pytest.raises(ValueError, match='not 100'):
    attention_lib.choose('cudnn', wide)
  with pytest.raises(ValueError, match="'splash' is a TPU kernel"):
    attention_lib.choose('splash', bf16)


def test_bad_settings_are_one_clear_error_before_compiling():
  q = jax.ShapeDtypeStruct((2, 16, 2, 16), jnp.float32)
  with pytest.raises(ValueError, match="'cudnn' runs on a GPU only, not on cpu"):
    attention_lib.choose('cudnn', q)
  with pytest.raises(ValueError, match="attention must be one of .* got 'flash'"):
    config_lib.model_config(attention='flash')
  config = default_config.get_config('tiny')
  config.model.attention = 'flash'
  with pytest.raises(ValueError, match='attention must be one of'):
    config_lib.validate(config)


@needs_gpu
def test_cudnn_equals_xla_on_a_gpu():
  q, k, v, cotangent = qkv(136, 'bfloat16', head_dim=64)
  f32 = lambda tree: jax.tree.map(lambda x: x.astype(jnp.float32), tree)
  cudnn = f32(value_and_grads(q, k, v, cotangent, 'cudnn'))
  ref = value_and_grads(*f32((q, k, v)), cotangent, 'xla')
  for got, want in zip(jax.tree.leaves(cudnn), jax.tree.leaves(ref)):
    bound = 4 * 2.0**-8 * float(jnp.max(jnp.abs(want)))  # as for splash in bfloat16
    chex.assert_trees_all_close(got, want, atol=bound, rtol=0)


@needs_libtpu
def test_the_default_tiny_run_compiled_for_a_tpu_runs_splash(tmp_path):
  """`train.py --compile_only --topology=v5p:2x2x1` of the tiny standard run, nothing
  set: the train step holds the splash kernels (forward, dq, dkv), per device under
  the 4-way data-parallel mesh, and the report adds their cost."""
  config = default_config.get_config('tiny')
  config.model.residual = 'standard'
  report = aot.compile_report(
    config, 'v5p:2x2x1', steps=('train',), hlo_dir=str(tmp_path)
  )
  with open(os.path.join(tmp_path, 'train.hlo.txt'), encoding='utf-8') as f:
    text = f.read()
  for kernel in ('fwd', 'dq', 'dkv'):
    assert f'%{splash_attention.KERNEL_PREFIX}{kernel}' in text, kernel
  # The report costs them analytically (compile_report/splash_cost.py) and says so.
  train = report['steps']['train']
  assert 0 < train['analytic_kernel_seconds'] < train['est_step_seconds']
  assert 'costed analytically' in aot.format_table(report)
