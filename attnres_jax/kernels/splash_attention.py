"""Causal self-attention by JAX's Pallas splash attention kernel
(`jax.experimental.pallas.ops.tpu.splash_attention`): a flash attention that visits
only the blocks on or below the diagonal, never writing the T x T scores to HBM.

The kernel works on one sequence's [heads, T, head dim] with T a whole number of
blocks (multiples of 128 lanes): `splash_attention` pads T up to a multiple of 128
(the padded keys come after every real query, so the causal mask hides them; the
padded queries' rows are cut off), picks the largest block of `BLOCKS` that divides
it, scales the queries (the kernel does not) and maps the kernel over the batch.
Under a mesh it runs per device in `jax.shard_map`, split over batch and heads as the
sharding rules split them; a split of the length or head dim is refused
(`split_refusal`): every query block reads keys from the whole sequence.
Off the TPU (tests) the same kernel runs in Pallas interpret mode.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu import splash_attention as splash
from jax.sharding import PartitionSpec as P

from attnres_jax.kernels import pallas_mesh
from attnres_jax.nn import remat
from attnres_jax.nn import sharding

LANES = 128  # the kernel's key blocks are whole multiples of the TPU's lanes
BLOCKS = (512, 256, 128)  # tried largest first; 512 as MaxText's defaults
QKV_AXES = ('batch', 'length', 'heads', 'head_dim')  # q, k, v and the output [B, T, N, H]
# The kernel names (custom-call instruction names in the compiled HLO) and the
# [T x T x head dim] matmuls each runs per visited block: the forward's scores and
# output (2); the dq kernel's scores, dP and dQ (3); the dkv kernel's scores, dP, dV
# and dK (4). `compile_report/hlo_kernel_cost.py` costs them from these.
KERNEL_MATMULS = {'fwd': 2, 'dq': 3, 'dkv': 4}
KERNEL_PREFIX = 'splash_mha_'


def padded_length(seq_len: int) -> int:
  return -(-seq_len // LANES) * LANES


def block_for(padded_len: int) -> int:
  """The largest block of `BLOCKS` that divides `padded_len` (a multiple of 128)."""
  return next(b for b in BLOCKS if padded_len % b == 0)


@functools.lru_cache(maxsize=64)
def _kernel(num_heads: int, seq_len: int, interpret: bool):
  """The causal kernel for [num_heads, seq_len, head dim] (`seq_len` padded)."""
  block = block_for(seq_len)
  mask = splash.MultiHeadMask([splash.CausalMask((seq_len, seq_len))] * num_heads)
  sizes = splash.BlockSizes(
    block_q=block,
    block_kv=block,
    block_kv_compute=block,
    block_q_dkv=block,
    block_kv_dkv=block,
    block_kv_dkv_compute=block,
    block_q_dq=block,
    block_kv_dq=block,
  )
  # Its mask tables as constants, not values of the trace that first asked for it:
  # the kernel is cached across traces.
  with jax.ensure_compile_time_eval():
    return splash.make_splash_mha(
      mask,
      block_sizes=sizes,
      head_shards=1,
      q_seq_shards=1,
      residual_checkpoint_name=remat.ATTENTION_RESIDUALS,
      interpret=interpret,
    )


def _local_attention(q_BTNH, k_BTNH, v_BTNH, *, interpret: bool):
  """The kernel on one device's arrays [B, T, N, H]."""
  _, t, n, h = q_BTNH.shape
  padded = padded_length(t)
  scale = jnp.asarray(1.0 / math.sqrt(h), jnp.float32)
  q_BTNH = (q_BTNH.astype(jnp.float32) * scale).astype(k_BTNH.dtype)

  def heads_major(x_BTNH):
    x_BNTH = x_BTNH.transpose(0, 2, 1, 3)
    return jnp.pad(x_BNTH, ((0, 0), (0, 0), (0, padded - t), (0, 0)))

  kernel = _kernel(n, padded, interpret)
  out_BNTH = jax.vmap(kernel)(
    heads_major(q_BTNH), heads_major(k_BTNH), heads_major(v_BTNH)
  )
  return out_BNTH[:, :, :t].transpose(0, 2, 1, 3)


def split_refusal(shape) -> str | None:
  """Why the active mesh's rules keep splash out for q [B, T, N, H] of `shape` (they
  split its length or head dim), None if they do not."""
  active = pallas_mesh._multi_device_mesh()  # pylint: disable=protected-access
  if active is None:
    return None
  mesh, rules = active
  spec = tuple(sharding.logical_to_spec(QKV_AXES, rules, mesh=mesh, shape=shape))
  spec += (None,) * (4 - len(spec))
  for name, axes in zip(QKV_AXES[1::2], spec[1::2]):
    if axes is not None:
      return (
        f"the sharding rules split the attention's {name!r} axis ({P(*spec)} on mesh "
        f'{dict(mesh.shape)}), which splash attention keeps whole'
      )
  return None


def splash_attention(q_BTNH, k_BTNH, v_BTNH):
  """Causal softmax(q k^T / sqrt(H)) v of q, k, v [B, T, N, H] (the same N heads),
  as `jax.nn.dot_product_attention(q, k, v, is_causal=True)`. In Pallas interpret
  mode off the TPU. ValueError where the mesh splits the length or head dim
  (`split_refusal`)."""
  interpret = not pallas_mesh.compiles_for_tpu()
  local = functools.partial(_local_attention, interpret=interpret)
  reason = split_refusal(q_BTNH.shape)
  if reason is not None:
    raise ValueError(f"model.attention='splash' cannot run: {reason}.")
  active = pallas_mesh._multi_device_mesh()  # pylint: disable=protected-access
  if active is None:
    return local(q_BTNH, k_BTNH, v_BTNH)
  mesh, rules = active
  spec = sharding.logical_to_spec(QKV_AXES, rules, mesh=mesh, shape=q_BTNH.shape)
  return jax.shard_map(
    local, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec, check_vma=False
  )(q_BTNH, k_BTNH, v_BTNH)
