"""AttnRes depth reads as the residual runs them: their parameters (one pseudo-query and
key gain per read, plus those of the enabled ablations), the one-shot read with its
ablations, and a write into a slot of the buffer."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from attnres_jax.residuals.attnres import depth
from attnres_jax.nn import sharding
from attnres_jax.residuals import base


class DepthReads(nnx.Module):
  """The parameters of AttnRes depth reads: one pseudo-query and key gain per read
  (`rows` reads: the two sublayers of a layer, or the single final read), plus those
  of the enabled ablations. None takes random numbers: queries start at zero (uniform
  weights) and gains at one, so the shared weights of every mode are identical."""

  def __init__(
    self, cfg, rows: tuple[int, ...], row_axes: tuple[str, ...], num_slots: int
  ):
    pdt = jnp.dtype(cfg.param_dtype)
    d = cfg.d_model
    self.query = base.param(jnp.zeros, (*rows, d), (*row_axes, 'embed'), pdt)
    self.gain = base.param(jnp.ones, (*rows, d), (*row_axes, 'embed'), pdt)
    # Ablations (paper Section 5): an input-dependent query, DenseFormer-style scalars.
    self.query_proj = (
      base.param(jnp.zeros, (*rows, d, d), (*row_axes, 'embed', None), pdt)
      if cfg.depth_query_input
      else None
    )
    self.mix = (
      base.param(jnp.ones, (*rows, num_slots), (*row_axes, 'depth'), pdt)
      if cfg.depth_mixing == 'scalars'
      else None
    )


def read_one_shot(
  cfg,
  buffer_KBTD,
  num_valid,
  query_D,
  gain_D,
  query_proj_DD=None,
  mixing_K=None,
  inv_rms_KBT=None,
):
  """One depth read over `buffer[:num_valid]` in one softmax (the reference read), or
  one of its ablations. Returns (h, weights [K, B, T])."""
  if not cfg.ablations:
    h_BTD, (weights_KBT, _, _) = depth.read_parts(
      buffer_KBTD,
      query_D,
      gain_D,
      eps=cfg.attn_res_eps,
      num_valid=num_valid,
      inv_rms_KBT=inv_rms_KBT,
    )
    return h_BTD, weights_KBT
  if num_valid is None:
    num_valid = buffer_KBTD.shape[0]
  query = query_D
  if query_proj_DD is not None:  # input-dependent: from the most recent source
    latest_BTD = jax.lax.dynamic_index_in_dim(buffer_KBTD, num_valid - 1, 0, False)
    normed_BTD = (
      latest_BTD.astype(jnp.float32)
      * depth.rms_inverse(latest_BTD, cfg.attn_res_eps)[..., None]
    )
    # Fan-in scaling, as for attention logits: Adam moves every entry of W by ~lr, so
    # an unscaled W x grows ~sqrt(d) times faster than the static query and the depth
    # softmax collapses to one source per token (measured: entropy 0.01-0.05 nats
    # after 300 steps at lr 3e-3, d=128, and 16% worse held-out loss than Full).
    query = (
      depth.lead(query_D.astype(jnp.float32), normed_BTD.ndim)
      + (normed_BTD @ query_proj_DD.astype(jnp.float32)) * normed_BTD.shape[-1] ** -0.5
    )
  return depth.attn_res_read_variant(
    buffer_KBTD,
    query,
    gain_D,
    eps=cfg.attn_res_eps,
    num_valid=num_valid,
    normalizer=cfg.depth_normalizer,
    key_norm=cfg.depth_key_norm,
    window=cfg.depth_window,
    num_heads=cfg.depth_heads,
    mixing_weights_K=mixing_K,
    inv_rms_KBT=inv_rms_KBT,
  )


def read_row(cfg, buffer_KBTD, num_valid, params: DepthReads, row, inv_rms_KBT):
  """`read_one_shot` with the parameters of read `row` of `params` (() for the final
  read's)."""
  take = lambda p: None if p is None else p[...][row]
  return read_one_shot(
    cfg,
    buffer_KBTD,
    num_valid,
    take(params.query),
    take(params.gain),
    take(params.query_proj),
    take(params.mix),
    inv_rms_KBT=inv_rms_KBT,
  )


def add_to_slot(slots_KBTD, inv_rms_KBT, slot, out_BTD, eps: float, *, empty=False):
  """The slots with `out` added to slot `slot` (stored in the slots' dtype), and their
  inverse RMS updated. `empty`: the slot is zero until this write, so `out` is stored
  in it, not added: the slot's earlier value gets no cotangent (a pipeline chunk
  writing into the buffer it received must not pass its slots' cotangents back)."""
  updated_BTD = out_BTD
  if not empty:
    updated_BTD = (
      jax.lax.dynamic_index_in_dim(slots_KBTD, slot, 0, keepdims=False) + out_BTD
    )
  updated_BTD = updated_BTD.astype(slots_KBTD.dtype)
  slots_KBTD = jax.lax.dynamic_update_index_in_dim(slots_KBTD, updated_BTD, slot, 0)
  inv_rms_KBT = jax.lax.dynamic_update_index_in_dim(
    inv_rms_KBT, depth.rms_inverse(updated_BTD, eps), slot, 0
  )
  return sharding.constrain(slots_KBTD, sharding.DEPTH_BUFFER), inv_rms_KBT
