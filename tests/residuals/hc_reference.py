"""Hyper-Connections and mHC as their papers print them, per token (streams as the rows of
H [m, D]): the references that tests/residuals/test_hyper_connections.py and
tests/residuals/test_hyper_streams.py check the model's code against."""

import jax
import jax.numpy as jnp

from attnres_jax.residuals.hyper import params as hc_params


def reference_sinkhorn(logits, iters):
  """Sinkhorn-Knopp as mHC states it: M = exp(logits), then columns and rows normalised in turn."""
  matrix = jnp.exp(logits)
  for _ in range(iters):
    matrix = matrix / jnp.sum(matrix, axis=-2, keepdims=True)
    matrix = matrix / jnp.sum(matrix, axis=-1, keepdims=True)
  return matrix


def rms_rows(x, eps):
  return x / jnp.sqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)


def hc_step(p, which, k, H, f, cfg):
  """Hyper-Connections (Zhu et al.): h0 = A_m^T H, H' = B^T f(h0) + A_r^T H, with the
  dynamic parts from norm(H). H: [B, T, m, D]."""
  m = cfg.hc_streams
  A_m = jax.nn.one_hot(k % m, m) + p.static_read[...][which]  # [m]
  A_r = p.static_mix[...][which]  # [m, m]
  B = p.static_write[...][which]  # [m]
  A_m, A_r, B = (jnp.broadcast_to(x, H.shape[:2] + x.shape) for x in (A_m, A_r, B))
  if cfg.hc_dynamic:
    Hn = rms_rows(H, cfg.norm_eps)
    A_m = A_m + p.read_scale[...][which] * jnp.tanh(Hn @ p.read_proj[...][which])
    A_r = A_r + p.read_scale[...][which] * jnp.tanh(Hn @ p.mix_proj[...][which])
    B = B + p.write_scale[...][which] * jnp.tanh(Hn @ p.write_proj[...][which])
  h0 = jnp.einsum('btm,btmd->btd', A_m, H)  # A_m^T H
  out = f(h0)
  return (
    jnp.einsum('btm,btd->btmd', B, out)  # B^T f(h0)
    + jnp.einsum('btij,btid->btjd', A_r, H)
  )  # A_r^T H


def mhc_step(p, which, k, H, f, cfg):
  """mHC (DeepSeek): x_{l+1} = H_res x_l + H_post^T f(H_pre x_l)."""
  m, d = cfg.hc_streams, cfg.d_model
  selected = jax.nn.one_hot(k % m, m)
  b_pre = hc_params.MHC_LOGIT * (2 * selected - 1) + p.pre_bias[...][which]
  pre, post, res = (
    jnp.broadcast_to(v, H.shape[:2] + v.shape)
    for v in (b_pre, p.post_bias[...][which], p.res_bias[...][which])
  )  # per token
  if cfg.hc_dynamic:
    x = H.reshape(*H.shape[:2], m * d)  # vec(x_l)
    x = rms_rows(x, cfg.norm_eps)
    flat = lambda phi: phi[...][which].reshape(m * d, -1)
    pre = pre + p.pre_scale[...][which] * (x @ flat(p.pre_proj))
    post = post + p.post_scale[...][which] * (x @ flat(p.post_proj))
    res = res + p.res_scale[...][which] * (x @ flat(p.res_proj)).reshape(
      *H.shape[:2], m, m
    )
  H_pre = jax.nn.sigmoid(jnp.broadcast_to(pre, H.shape[:2] + (m,)))
  H_post = 2 * jax.nn.sigmoid(jnp.broadcast_to(post, H.shape[:2] + (m,)))
  H_res = reference_sinkhorn(
    jnp.broadcast_to(res, H.shape[:2] + (m, m)), cfg.sinkhorn_iters
  )
  out = f(jnp.einsum('btm,btmd->btd', H_pre, H))
  return jnp.einsum('btij,btjd->btid', H_res, H) + jnp.einsum(
    'btm,btd->btmd', H_post, out
  )
