"""The stream-sized steps of HC/mHC (`connections.py`) with hand-written VJPs:
the read `h = sum_i a_i H_i`, the write `H'_j = sum_i R_ij H_i + b_j f(h)` and the
normalised projections the dynamic coefficients start from.

Each one reads the streams in their storage dtype (the model dtype, bfloat16 on
accelerators), accumulates in float32 inside the fusion that reads them and stores
its stream-sized result in the storage dtype again. Autodiff would keep the float32
copies of the streams (and the normalised streams) as residuals for the backward pass,
stacked over the scanned layers; here a step keeps only its inputs (the streams
already stored for the backward, f(h), the per-token coefficients) and the backward
reads them again, every per-token weight gradient one reduction over d.

The sums over the m streams are m scaled adds (elementwise, fused with the reads),
never a dot contracting m: per token that would be a tiny m-wide product padded to a
tile. Shapes: streams [m, B, T, D]; per-token weights [m, B, T] and [m, m, B, T]
(tokens minor, so they fill the TPU's lane axis).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from attnres_jax.nn import sharding

F32 = jnp.float32
STREAMS = sharding.DEPTH_BUFFER  # [m, B, T, D]: the streams shard like the depth buffer
STREAM_AXIS = STREAMS[0]  # the logical name of a stream axis in parameters (never split)


def _stored(x_BTD):
  """x as stored, in its own dtype: an optimization barrier, so that XLA neither
  hoists a float32 convert of the consumer into the producer's fusion nor sinks the
  producer's into the consumer. On TPU the streams are laid out tokens-minor and the
  attention and MLP arrays d-minor; h, f(h) and their cotangents cross between the
  two by a relayout copy, and without the barrier that copy moved float32."""
  return jax.lax.optimization_barrier(x_BTD)


def weighted_sum(weights_MBT, streams_MBTD):
  """sum_i weights[i] streams[i] ([B, T, D], float32): m scaled adds. Weights
  [m, n, B, T] give n such sums at once, [n, B, T, D]."""
  lead = (1,) * (weights_MBT.ndim - 3)
  total = None
  for w_BT, h_BTD in zip(weights_MBT, streams_MBTD):
    term = w_BT[..., None] * h_BTD.astype(F32).reshape(lead + h_BTD.shape)
    total = term if total is None else total + term
  return total


def _dots(x_MBTD, y_BTD):
  """<x_i, y> over d per token, float32 [m, B, T]."""
  return jnp.sum(x_MBTD.astype(F32) * y_BTD.astype(F32)[None], axis=-1)


# -- the read: h = sum_i a_i H_i -----------------------------------------------------


@jax.custom_vjp
def read(read_MBT, streams_MBTD):
  """h [B, T, D] in the streams' dtype."""
  return _stored(weighted_sum(read_MBT, streams_MBTD).astype(streams_MBTD.dtype))


def _read_fwd(read_MBT, streams_MBTD):
  return read(read_MBT, streams_MBTD), (read_MBT, streams_MBTD)


def _read_bwd(saved, dh_BTD):
  read_MBT, streams_MBTD = saved
  dh_f32 = _stored(dh_BTD).astype(F32)
  d_streams = (read_MBT[..., None] * dh_f32[None]).astype(streams_MBTD.dtype)
  return _dots(streams_MBTD, dh_f32), d_streams


read.defvjp(_read_fwd, _read_bwd)


# -- the write: H'_j = sum_i R_ij H_i + b_j f(h) ---------------------------------------


@jax.custom_vjp
def write(mix_MMBT, write_MBT, streams_MBTD, out_BTD):
  """The new streams [m, B, T, D] in the streams' dtype; mix[i, j]: from i to j."""
  out_f32 = _stored(out_BTD).astype(F32)
  # One [m, B, T, D] expression (each stream broadcast over the m outputs), not a
  # stack of m sums: XLA split the stack into fusions that each read all m streams
  # and then copied their outputs into the stacked array.
  new = weighted_sum(mix_MMBT, streams_MBTD) + write_MBT[..., None] * out_f32[None]
  return new.astype(streams_MBTD.dtype)


def _write_fwd(mix_MMBT, write_MBT, streams_MBTD, out_BTD):
  new = write(mix_MMBT, write_MBT, streams_MBTD, out_BTD)
  return new, (mix_MMBT, write_MBT, streams_MBTD, out_BTD)


def _write_bwd(saved, d_new_MBTD):
  mix_MMBT, write_MBT, streams_MBTD, out_BTD = saved
  m = streams_MBTD.shape[0]
  d_new_MBTD = _stored(d_new_MBTD)
  # dR_ij = <H_i, dH'_j>, db_j = <f(h), dH'_j>: reductions over d, per token.
  # m reductions of rank-4 products (the streams' layout), not one of a rank-5
  # broadcast: for that XLA copied both operands, in float32, into another layout.
  d_mix = jnp.stack([_dots(streams_MBTD, d_new_MBTD[j]) for j in range(m)], axis=1)
  d_write = _dots(d_new_MBTD, out_BTD)
  # dH_i = sum_j R_ij dH'_j, df(h) = sum_j b_j dH'_j: scaled adds of the m cotangents.
  d_streams = weighted_sum(jnp.swapaxes(mix_MMBT, 0, 1), d_new_MBTD)  # [j][i]
  d_out = weighted_sum(write_MBT, d_new_MBTD)
  return (
    d_mix,
    d_write,
    d_streams.astype(streams_MBTD.dtype),
    _stored(d_out.astype(out_BTD.dtype)),
  )


write.defvjp(_write_fwd, _write_bwd)


# -- the dynamic coefficients' projections of the normalised streams -----------------


def _dot(rule, x, y, dtype):
  """A float32-accumulated dot whose operands are in the dtype of the stream-sized
  one (the streams' storage dtype): the dot reads the stored streams themselves
  rather than a float32 copy XLA would materialise for it (on TPU a float32 dot at
  default precision rounds its operands to bfloat16 anyway)."""
  return jnp.einsum(rule, x.astype(dtype), y.astype(dtype), preferred_element_type=F32)


def project_parts(phi, streams_MBTD, eps, per_stream):
  """(P, r): the projection of the raw streams with the outputs minor, [m, B, T, K]
  (HC) or [B, T, K] (mHC: one dot per stream, batched over m, then summed), and the
  inverse RMS [m, B, T] (HC) or [B, T] (mHC), float32. Each dot is a plain
  [tokens, D] x [D, K] product whose output keeps the streams' token order, so it
  asks nothing of the streams' layout."""
  h_f32 = streams_MBTD.astype(F32)
  if per_stream:  # HC: each stream over its d features; phi [D, K]
    projected = _dot('mbtd,dk->mbtk', streams_MBTD, phi, streams_MBTD.dtype)
    inv_rms = jax.lax.rsqrt(jnp.mean(jnp.square(h_f32), axis=-1) + eps)
  else:  # mHC: vec(H) over its m d features; phi [m, D, K]
    projected = _dot('mbtd,mdk->mbtk', streams_MBTD, phi, streams_MBTD.dtype)
    projected = jnp.sum(projected, axis=0)
    inv_rms = jax.lax.rsqrt(jnp.mean(jnp.square(h_f32), axis=(0, 3)) + eps)
  return projected, inv_rms


def normed_projection(phi, streams_MBTD, eps: float, per_stream: bool):
  """RMSNorm(x) phi without a gain, written as (x phi) / rms(x) so that the
  normalised streams are never stored: HC (`per_stream`) normalises each stream,
  [K, m, B, T]; mHC their concatenation, [K, B, T]. float32; the small result is
  transposed to its outputs leading (tokens minor) after the dot (`project_parts`).
  With the Pallas kernels the model computes them inside
  `kernels/hyper_gated_read.gated_read` instead."""
  # phi (D x K, K tiny) whole on every device: split over D (FSDP) XLA computes the
  # projection and dphi as windowed dot loops (all-gather, reduce-scatter) around
  # tokens-minor copies of the streams.
  phi = sharding.constrain(phi, (None,) * phi.ndim)
  normed = _normed_projection(phi, streams_MBTD, eps, per_stream)
  return jnp.moveaxis(normed, -1, 0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _normed_projection(phi, streams_MBTD, eps, per_stream):
  projected, inv_rms = project_parts(phi, streams_MBTD, eps, per_stream)
  return projected * inv_rms[..., None]


def _projection_fwd(phi, streams_MBTD, eps, per_stream):
  projected, inv_rms = project_parts(phi, streams_MBTD, eps, per_stream)
  return projected * inv_rms[..., None], (phi, streams_MBTD, projected, inv_rms)


def _projection_bwd(eps, per_stream, saved, dy):
  del eps  # eps enters only through the saved inverse RMS
  phi, streams_MBTD, projected, inv_rms = saved
  h_f32 = streams_MBTD.astype(F32)
  d_projected = dy * inv_rms[..., None]
  # r = (s / n + eps)^(-1/2), s = sum of squares over n features: dr/dH = -r^3 H / n.
  d_inv_rms = jnp.sum(dy * projected, axis=-1)
  n = h_f32.shape[-1] * (1 if per_stream else h_f32.shape[0])
  scale = -d_inv_rms * inv_rms**3 / n
  dtype = streams_MBTD.dtype
  if per_stream:
    d_phi = _dot('mbtk,mbtd->dk', d_projected, streams_MBTD, dtype)
    d_streams = _dot('mbtk,dk->mbtd', d_projected, phi, dtype)
  else:  # batched over m like the forward: no [B, T, m, D] product to transpose
    d_projected = jnp.broadcast_to(d_projected, (streams_MBTD.shape[0],) + dy.shape)
    d_phi = _dot('mbtk,mbtd->mdk', d_projected, streams_MBTD, dtype)
    d_streams = _dot('mbtk,mdk->mbtd', d_projected, phi, dtype)
    scale = scale[None]
  d_streams = d_streams + scale[..., None] * h_f32
  return d_phi, d_streams.astype(dtype)


_normed_projection.defvjp(_projection_fwd, _projection_bwd)
