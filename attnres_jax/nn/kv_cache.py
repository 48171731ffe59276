"""The key/value cache of decoding: one `KVCache` per layer, placed like the
activations, and attention of new tokens over it (`docs/inference.md`)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from attnres_jax.nn import sharding

Array = jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
  """One layer's key/value cache for decoding, in the layouts the attention dots read
  without a transpose: keys [B, N, H, S] (S: cache slots), values [B, N, S, H]."""

  keys_BNHS: Array
  values_BNSH: Array


KEYS_AXES = ('batch', 'heads', 'head_dim', 'length')  # sharded like activations
VALUES_AXES = ('batch', 'heads', 'length', 'head_dim')


def shard_cache(cache: tuple[KVCache, ...], mesh, rules) -> tuple[KVCache, ...]:
  """The cache placed on `mesh` like the activations (batch over data/fsdp, heads over
  tensor under the default rules); a step under `sharding.logical_rules` keeps it so."""

  def place(x, axes):
    spec = sharding.logical_to_spec(axes, rules, mesh=mesh, shape=x.shape)
    return jax.device_put(x, jax.sharding.NamedSharding(mesh, spec))

  return tuple(
    KVCache(place(c.keys_BNHS, KEYS_AXES), place(c.values_BNSH, VALUES_AXES))
    for c in cache
  )


def cached_attention(q_BTNH, k_BTNH, v_BTNH, cache: KVCache, cache_index, start_B):
  """Attention of T new tokens (cache slots cache_index .. cache_index + T - 1) over the
  cache after writing their keys and values into it, in place.

  Slot s is visible to the query in slot t when start_B[b] <= s <= t: a row's slots
  before `start_B` hold left padding. Returns (output [B, T, N, H], the new cache).
  """
  dtype = q_BTNH.dtype
  keys_BNHS = jax.lax.dynamic_update_slice_in_dim(
    cache.keys_BNHS,
    k_BTNH.transpose(0, 2, 3, 1).astype(cache.keys_BNHS.dtype),
    cache_index,
    axis=3,
  )
  values_BNSH = jax.lax.dynamic_update_slice_in_dim(
    cache.values_BNSH,
    v_BTNH.transpose(0, 2, 1, 3).astype(cache.values_BNSH.dtype),
    cache_index,
    axis=2,
  )
  keys_BNHS = sharding.constrain(keys_BNHS, KEYS_AXES)
  values_BNSH = sharding.constrain(values_BNSH, VALUES_AXES)
  num_new, num_slots = q_BTNH.shape[1], keys_BNHS.shape[-1]
  logits_BNTS = jnp.einsum(
    'bnth,bnhs->bnts',
    q_BTNH.transpose(0, 2, 1, 3),
    keys_BNHS.astype(dtype),
    preferred_element_type=jnp.float32,
  )
  logits_BNTS = logits_BNTS * q_BTNH.shape[-1] ** -0.5
  slot_S = jnp.arange(num_slots)
  query_slot_T = cache_index + jnp.arange(num_new)
  visible_BTS = (slot_S[None, None, :] <= query_slot_T[None, :, None]) & (
    slot_S[None, None, :] >= start_B[:, None, None]
  )
  # A finite floor, not -inf: a padding query sees no slot and gets uniform weights
  # over masked (finite) values instead of NaN.
  logits_BNTS = jnp.where(visible_BTS[:, None], logits_BNTS, jnp.finfo(jnp.float32).min)
  probs_BNTS = jax.nn.softmax(logits_BNTS, axis=-1).astype(dtype)
  out_BNTH = jnp.einsum('bnts,bnsh->bnth', probs_BNTS, values_BNSH.astype(dtype))
  return out_BNTH.transpose(0, 2, 1, 3), KVCache(keys_BNHS, values_BNSH)
