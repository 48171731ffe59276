"""mHC's Sinkhorn-Knopp as a Pallas TPU kernel and its VJP (`model.depth_kernel=
'pallas'` with residual 'mhc'): the same function as
`residuals/hyper/coefficients.sinkhorn` over the leading axes of [m, m, B, T] logits
(rows i, columns j).

In XLA each of the 20 iterations is its own fusions over the [m, m, B, T] maps,
forward, in the recomputation and in the backward, reading and writing them from
memory every half-step. Here a program holds a tile of tokens of the m x m logits in
VMEM for all iterations:

  forward:   per iteration, in float32 and the log domain, L <- L - lse_i(L) (the
             columns), then L <- L - lse_j(L) (the rows); then M = exp(L) normalised
             over j once more (`coefficients.sinkhorn`);
  backward:  the forward recomputed, each half-step's output Y kept in VMEM scratch,
             then back through the steps: dM -> dL = (dM - sum_j dM M) M, and for
             each half-step Y = X - lse(X): dX = dY - exp(Y) sum(dY) over the same
             axis. Only the logits are kept for the backward (as the XLA version's
             `jax.checkpoint` does).

A block is [m, m, t] of a [B, m, m, T] array: the tokens on the lanes, j on the
sublanes, i a leading axis (the sums over i are m element-wise adds, those over j
sublane reductions). The grid runs over (batch row, tile of T), both 'parallel'.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from attnres_jax.kernels import hyper_tiles

F32 = jnp.float32
_SQ = pl.squeezed
MAX_TILE = 512  # tokens a program: the scratch holds 2 iters [m, 8, t] float32 maps


def _lse_over_i(rows):
  """log sum_i exp(rows[i]) of m [m, t] arrays (as jax.nn.logsumexp: max shifted)."""
  top = functools.reduce(jnp.maximum, rows)
  top = jnp.where(jnp.abs(top) < jnp.inf, top, 0.0)
  return top + jnp.log(sum(jnp.exp(r - top) for r in rows))


def _lse_over_j(row):
  """log sum_j exp(row[j]) of one [m, t] array, [1, t]."""
  top = jnp.max(row, axis=0, keepdims=True)
  top = jnp.where(jnp.abs(top) < jnp.inf, top, 0.0)
  return top + jnp.log(jnp.sum(jnp.exp(row - top), axis=0, keepdims=True))


def _half_steps(rows, iters, keep):
  """The iterations on m rows [m, t] (row i: L[i, :, tokens]); `keep(k, rows)` is
  called with each half-step's output (k = 0 .. 2 iters - 1)."""

  def body(it, rows):
    lse = _lse_over_i(rows)
    rows = tuple(r - lse for r in rows)
    keep(2 * it, rows)
    rows = tuple(r - _lse_over_j(r) for r in rows)
    keep(2 * it + 1, rows)
    return rows

  return jax.lax.fori_loop(0, iters, body, rows)


def _normalised(rows):
  """M = exp(L) / sum_j exp(L), per row."""
  out = []
  for r in rows:
    e = jnp.exp(r)
    out.append(e / jnp.sum(e, axis=0, keepdims=True))
  return out


def forward_kernel(logits_ref, out_ref, *, m, iters):
  rows = tuple(logits_ref[i] for i in range(m))
  rows = _half_steps(rows, iters, lambda k, rows: None)
  for i, r in enumerate(_normalised(rows)):
    out_ref[i] = r


def backward_kernel(logits_ref, dout_ref, dlogits_ref, kept_ref, *, m, iters):
  """kept_ref: [2 iters, m, m, t] scratch, each half-step's output."""

  def keep(k, rows):
    for i, r in enumerate(rows):
      kept_ref[k, i] = r

  rows = tuple(logits_ref[i] for i in range(m))
  rows = _half_steps(rows, iters, keep)
  d_rows = []
  for i, mat in enumerate(_normalised(rows)):
    d_mat = dout_ref[i]
    d_rows.append((d_mat - jnp.sum(d_mat * mat, axis=0, keepdims=True)) * mat)

  def back(it, d_rows):
    k = 2 * (iters - 1 - it)
    # Y = X - lse_j(X) (the rows): dX = dY - exp(Y) sum_j dY.
    d_rows = tuple(
      d - jnp.exp(kept_ref[k + 1, i]) * jnp.sum(d, axis=0, keepdims=True)
      for i, d in enumerate(d_rows)
    )
    # Y = X - lse_i(X) (the columns): dX = dY - exp(Y) sum_i dY.
    total = sum(d_rows)
    return tuple(d - jnp.exp(kept_ref[k, i]) * total for i, d in enumerate(d_rows))

  d_rows = jax.lax.fori_loop(0, iters, back, tuple(d_rows))
  for i, d in enumerate(d_rows):
    dlogits_ref[i] = d


def choose_tile(length):
  """The largest multiple of 128 dividing `length` up to MAX_TILE, or all of T."""
  fits = [t for t in range(128, min(length, MAX_TILE) + 1, 128) if length % t == 0]
  return max(fits) if fits else length


def _launch(kernel, args, iters, cost, scratch=False):
  batch, m, _, length = args[0].shape
  tile = choose_tile(length)
  block = pl.BlockSpec((_SQ, m, m, tile), lambda b, t: (b, 0, 0, t))

  def make(interpret):
    return pl.pallas_call(
      functools.partial(kernel, m=m, iters=iters),
      out_shape=jax.ShapeDtypeStruct(args[0].shape, F32),
      grid=(batch, length // tile),
      in_specs=[block] * len(args),
      out_specs=block,
      scratch_shapes=[pltpu.VMEM((2 * iters, m, m, tile), F32)] if scratch else [],
      compiler_params=pltpu.CompilerParams(dimension_semantics=('parallel', 'parallel')),
      cost_estimate=pl.CostEstimate(
        flops=int(cost[0]), transcendentals=int(cost[1]), bytes_accessed=int(cost[2])
      ),
      interpret=interpret,
    )

  return jax.lax.platform_dependent(
    *args, tpu=lambda *a: make(False)(*a), default=lambda *a: make(True)(*a)
  )


def _forward_device(logits_BMMT, *, iters):
  elements = logits_BMMT.size
  # Per entry and iteration: two log-sum-exps (an exp, ~4 flops; a log per sum).
  cost = (elements * (8 * iters + 3), elements * (2 * iters + 1), 2 * 4 * elements)
  return _launch(forward_kernel, (logits_BMMT,), iters, cost)


def _backward_device(logits_BMMT, dout_BMMT, *, iters):
  elements = logits_BMMT.size
  cost = (elements * (14 * iters + 6), elements * (4 * iters + 1), 3 * 4 * elements)
  return _launch(backward_kernel, (logits_BMMT, dout_BMMT), iters, cost, scratch=True)


def _maps(fn, shape, count):
  """`fn` per device on `count` [B, m, m, T] maps, split like the streams."""
  stream_shape = (shape[1], shape[0], shape[3], 1)
  return hyper_tiles.per_device(fn, stream_shape, ('maps',) * count, 'maps')


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _sinkhorn(logits_BMMT, iters):
  return _maps(functools.partial(_forward_device, iters=iters), logits_BMMT.shape, 1)(
    logits_BMMT
  )


def _sinkhorn_fwd(logits_BMMT, iters):
  return _sinkhorn(logits_BMMT, iters), logits_BMMT


def _sinkhorn_bwd(iters, logits_BMMT, dout_BMMT):
  fn = _maps(functools.partial(_backward_device, iters=iters), logits_BMMT.shape, 2)
  return (fn(logits_BMMT, dout_BMMT),)


_sinkhorn.defvjp(_sinkhorn_fwd, _sinkhorn_bwd)


def sinkhorn(logits_MMBT, iters: int):
  """`residuals/hyper/coefficients.sinkhorn(logits, iters, axes=(0, 1))` by the
  kernels: [m, m, B, T] float32, rows i, columns j."""
  logits_BMMT = jnp.moveaxis(logits_MMBT.astype(F32), 2, 0)
  return jnp.moveaxis(_sinkhorn(logits_BMMT, int(iters)), 0, 2)
