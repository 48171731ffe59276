"""Causal self-attention, computed the way each backend does it best
(`model.attention`, `ATTENTION_SETTINGS`):

  'auto'    (the default) decided where the step is traced (`choose`): splash on TPU
            devices, cuDNN on GPUs where cuDNN supports the shape and dtype (else XLA,
            said once in the log), XLA on the CPU
  'xla'     `jax.nn.dot_product_attention(implementation='xla')`: all T x T scores
  'splash'  JAX's Pallas splash attention (`splash_attention.py`), TPU only (Pallas
            interpret mode off the TPU: tests)
  'cudnn'   cuDNN's fused flash attention through `jax.nn.dot_product_attention`, GPU
            only

The platform is that of the devices the step is compiled for
(`nn/sharding.py`, `compile_platform`), so a compile-only run for a TPU topology on a CPU
host gets splash. A setting the platform cannot run (splash on a GPU, cuDNN off a GPU
or on a shape it does not support) is one ValueError at trace time, before anything
compiles. Decoding with a KV cache keeps its own read (`nn/kv_cache.py`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from absl import logging

from attnres_jax.kernels import splash_attention
from attnres_jax.nn import sharding

QKV_AXES = splash_attention.QKV_AXES  # q, k, v and the output [B, T, N, H]

ATTENTION_SETTINGS = ('auto', 'xla', 'splash', 'cudnn')  # model.attention
CUDNN_DTYPES = (jnp.bfloat16, jnp.float16)
# cuDNN's flash attention takes head dims up to 128 on every GPU (256 from Hopper on);
# 'auto' keeps to what all of them run.
CUDNN_MAX_HEAD_DIM = 128
_SAID: set[str] = set()  # the fallbacks already logged


def cudnn_refusal(q_BTNH) -> str | None:
  """Why cuDNN's flash attention cannot run q [B, T, N, H], None if it can."""
  head_dim = q_BTNH.shape[-1]
  if jnp.dtype(q_BTNH.dtype) not in [jnp.dtype(d) for d in CUDNN_DTYPES]:
    return f'cuDNN attention takes bfloat16 or float16, not {jnp.dtype(q_BTNH.dtype)}'
  if head_dim % 8 or head_dim > CUDNN_MAX_HEAD_DIM:
    return (
      f'cuDNN attention takes head dims that are multiples of 8 up to '
      f'{CUDNN_MAX_HEAD_DIM}, not {head_dim}'
    )
  return None


def _fall_back(reason: str) -> str:
  if reason not in _SAID:
    _SAID.add(reason)
    logging.warning(
      "model.attention='auto': XLA's attention, not the fused one: %s.", reason
    )
  return 'xla'


def choose(setting: str, q_BTNH) -> str:
  """The implementation ('xla', 'splash' or 'cudnn') of a `model.attention` setting
  for queries like `q_BTNH`, at trace time (the module docstring's rules); ValueError
  for a setting the platform cannot run."""
  if setting not in ATTENTION_SETTINGS:
    raise ValueError(
      f'model.attention must be one of {ATTENTION_SETTINGS}, got {setting!r}.'
    )
  platform = sharding.compile_platform()
  if setting == 'auto':
    if platform == 'tpu':
      reason = splash_attention.split_refusal(q_BTNH.shape)
      return 'splash' if reason is None else _fall_back(reason)
    if platform == 'gpu':
      reason = cudnn_refusal(q_BTNH)
      return 'cudnn' if reason is None else _fall_back(reason)
    return 'xla'
  if setting == 'splash' and platform == 'gpu':
    raise ValueError(
      "model.attention='splash' is a TPU kernel; on a GPU use 'cudnn', 'xla' or 'auto'."
    )
  if setting == 'cudnn':
    if platform != 'gpu':
      raise ValueError(
        f"model.attention='cudnn' runs on a GPU only, not on {platform}; use 'auto' "
        "(splash on a TPU, XLA on the CPU) or 'xla'."
      )
    reason = cudnn_refusal(q_BTNH)
    if reason is not None:
      raise ValueError(f"model.attention='cudnn' cannot run this model: {reason}.")
  return setting


def causal_attention(q_BTNH, k_BTNH, v_BTNH, setting: str = 'auto'):
  """Causal softmax(q k^T / sqrt(H)) v of [B, T, N, H] arrays by the implementation
  `choose` picks for `setting`."""
  implementation = choose(setting, q_BTNH)
  if implementation == 'splash':
    return splash_attention.splash_attention(q_BTNH, k_BTNH, v_BTNH)
  return jax.nn.dot_product_attention(
    q_BTNH, k_BTNH, v_BTNH, is_causal=True, implementation=implementation
  )
