"""AttnRes Phase 1 as a Pallas TPU kernel and its VJP (`model.depth_kernel`: 'pallas',
or 'auto' where the step is compiled for TPU devices).

Same contract as `depth.phase1`: Q queries (gains folded in) against the first
`num_valid` slots of the depth buffer [K, B, T, D], returning per query the max logit
and the sum of exponentials ([B, T], float32; the max stop-gradient) and the
unnormalised output [B, T, D] in `out_dtype`. The Pallas calls per device are
`depth_pallas_device.py` (grid, layouts, HBM traffic), the kernels
`depth_pallas_kernels.py`. The forward is an online softmax over the slot steps; the
backward takes the forward's max and treats each slot on its own, so a call handed
an earlier call's results (`kept`: the linear-memory backward keeps them where its
rule says, `residuals/attnres/choices.py`) runs no forward kernel.

Each call's CostEstimate charges the slots it reads: num_valid where it is a Python
int; where it is traced (the scan over segments), the mean over the scan stated by
`expected_valid`, or all K (an upper bound). Within `cotangent_into`, the VJP adds
the buffer's cotangent into a carried one in place.

Off the TPU (CPU tests, a CPU run with depth_kernel='pallas') the same kernels run
in Pallas interpret mode. Under the model's mesh the kernels run per device in
`jax.shard_map` (the buffer split over batch and length); a buffer split over its
width or its slots is refused.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from attnres_jax.kernels import pallas_mesh
from attnres_jax.kernels.depth_pallas_device import backward_device
from attnres_jax.kernels.depth_pallas_device import forward_device

# -- the device split and the custom VJP ----------------------------------------------


def _sharded(fn, shape, in_specs, out_specs):
  """`fn` per device under the active mesh, the buffer [K, B, T, D] split as the
  sharding rules say over batch and length (a split over slots or width is refused),
  or `fn` as is on one device."""
  split = pallas_mesh.batch_length_split(shape, 'the depth buffer', 'slots')
  if split is None:
    return fn
  mesh, b, t = split
  spec = dict(
    buf=P(None, b, t, None),  # [K, B, T, D]
    rms=P(None, b, t),  # [K, B, T]
    stat=P(b, None, t),  # [B, Q, T]
    out=P(b, t, None),  # [B, T, D]
    rep=P(),
  ).get
  named = lambda axes: () if not axes else (axes,) if isinstance(axes, str) else axes
  return jax.shard_map(
    functools.partial(fn, psum_axes=named(b) + named(t)),
    mesh=mesh,
    in_specs=jax.tree.map(spec, in_specs),
    out_specs=jax.tree.map(spec, out_specs),
    check_vma=False,
  )


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def _phase1(buf_KBTD, folded_QD, nv, rms_KBT, bound, eps, out_dtype, width_minor):
  return _phase1_fwd(
    buf_KBTD, folded_QD, nv, rms_KBT, bound, eps, out_dtype, width_minor
  )[0]


def _phase1_fwd(buf_KBTD, folded_QD, nv, rms_KBT, bound, eps, out_dtype, width_minor):
  del width_minor
  rms = None if rms_KBT is None else 'rms'
  fn = _sharded(
    functools.partial(forward_device, bound=bound, eps=eps, out_dtype=out_dtype),
    buf_KBTD.shape,
    ('rep', 'rep', 'buf', rms),
    ('stat', 'stat', ('out',) * folded_QD.shape[0]),
  )
  operands = (nv, folded_QD, buf_KBTD, rms_KBT)  # the device functions' order
  out = fn(*operands)
  return out, (*operands, out[0])


def _phase1_bwd(bound, eps, out_dtype, width_minor, residuals, cotangents):
  del out_dtype
  nv, folded_QD, buf_KBTD, rms_KBT, _ = residuals
  _, dsum_BQT, douts = cotangents  # the max is stop-gradient
  d_carry_KBTD, zeroed, d_first_BTD = _INTO.get() or (None, 0, None)
  if d_carry_KBTD is not None and (
    d_carry_KBTD.shape != buf_KBTD.shape or d_carry_KBTD.dtype != buf_KBTD.dtype
  ):
    raise ValueError(
      f"cotangent_into needs a carry of the buffer's shape and dtype "
      f'{buf_KBTD.shape} {buf_KBTD.dtype}, got {d_carry_KBTD.shape} '
      f'{d_carry_KBTD.dtype}.'
    )
  rms = None if rms_KBT is None else 'rms'
  carry, first = (
    None if x is None else kind
    for x, kind in ((d_carry_KBTD, 'buf'), (d_first_BTD, 'out'))
  )
  fn = _sharded(
    functools.partial(
      backward_device,
      bound=bound,
      eps=eps,
      num_zeroed=zeroed,
      width_minor=width_minor,
    ),
    buf_KBTD.shape,
    ('rep', 'rep', 'buf', rms, 'stat', 'stat', ('out',) * len(douts), carry, first),
    ('buf', rms, 'rep'),
  )
  dbuf_KBTD, drms_KBT, dfold_QD = fn(
    *residuals, dsum_BQT, tuple(douts), d_carry_KBTD, d_first_BTD
  )
  return dbuf_KBTD, dfold_QD, None, drms_KBT


_phase1.defvjp(_phase1_fwd, _phase1_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9, 10))
def _phase1_kept(
  buf_KBTD, folded_QD, nv, rms_KBT, max_BQT, sum_BQT, outs, bound, eps, dtype, wm
):
  """`_phase1` whose forward an earlier call on the same operands already ran: it
  returns that call's results (max, sum, outs) and differentiates as `_phase1`."""
  del buf_KBTD, folded_QD, nv, rms_KBT, bound, eps, dtype, wm
  return max_BQT, sum_BQT, outs


def _phase1_kept_fwd(
  buf_KBTD, folded_QD, nv, rms_KBT, max_BQT, sum_BQT, outs, bound, eps, dtype, wm
):
  del bound, eps, dtype, wm
  return (max_BQT, sum_BQT, outs), (nv, folded_QD, buf_KBTD, rms_KBT, max_BQT)


def _phase1_kept_bwd(bound, eps, out_dtype, width_minor, residuals, cotangents):
  grads = _phase1_bwd(bound, eps, out_dtype, width_minor, residuals, cotangents)
  return (*grads, None, None, None)  # the kept results are constants


_phase1_kept.defvjp(_phase1_kept_fwd, _phase1_kept_bwd)

# What the context managers below set.
_INTO = contextvars.ContextVar('depth_pallas_into', default=None)
_EXPECTED_VALID = contextvars.ContextVar('depth_pallas_expected_valid', default=None)


@contextlib.contextmanager
def _setting(var, value):
  token = var.set(value)
  try:
    yield
  finally:
    var.reset(token)


def cotangent_into(d_carry_KBTD, *, num_zeroed=0, d_first_BTD=None):
  """A context: each VJP of `phase1` evaluated within it (the backward kernel traced)
  returns, as the buffer's cotangent, `d_carry_KBTD` (a cotangent of that buffer
  carried by a backward pass, of its shape and dtype) plus its own and, at slot 0,
  `d_first_BTD` (if given; num_valid >= 1), with the `num_zeroed` slots from
  num_valid on set to zero and the later ones left as they are. The backward kernel
  reads the carry at the valid slots and writes those and the zeroed ones in place
  (its own buffer, width on the lanes): no separate sum reads and writes the carry."""
  return _setting(_INTO, (d_carry_KBTD, num_zeroed, d_first_BTD))


def expected_valid(mean):
  """A context: each `phase1` traced within it with a traced num_valid (a scan over
  segments) has its kernels' CostEstimates charge `mean` slots a call, the mean of
  num_valid over the scan's calls, so that the compiler's total (per call times trip
  count) is what the kernels load. Outside it such a call is charged all K slots (an
  upper bound); a Python int num_valid is charged itself."""
  return _setting(_EXPECTED_VALID, mean)


def phase1(
  buffer_KBTD,
  queries_QD,
  gains_QD,
  *,
  eps,
  num_valid,
  inv_rms_KBT=None,
  out_dtype=jnp.float32,
  width_minor_cotangent=False,
  kept=None,
):
  """`depth.phase1` computed by the Pallas kernels (module docstring): a tuple over
  the Q queries of (max [B, T], sum of exponentials [B, T], output [B, T, D]). Its
  VJP within `cotangent_into` sums the buffer's cotangent into a carried one; outside
  it, with `width_minor_cotangent`, the kernel writes the buffer's cotangent width
  on the lanes, the layout a backward pass carries it in (the transposes in VMEM),
  not tokens on the lanes for the compiler to relayout. `kept`: this function's
  result for the same operands, computed earlier (a forward pass that kept it for
  its backward); the forward kernel is not run again, and the VJP is the same."""
  num_slots = buffer_KBTD.shape[0]
  if num_valid is None:
    num_valid = num_slots
  # The slots the kernels read per call (their CostEstimates).
  if isinstance(num_valid, (int, np.integer)):
    bound = min(int(num_valid), num_slots)
  else:
    mean = _EXPECTED_VALID.get()
    bound = num_slots if mean is None else float(mean)
  nv = jnp.clip(jnp.asarray(num_valid, jnp.int32), 0, num_slots).reshape(1)
  folded_QD = queries_QD.astype(jnp.float32) * gains_QD.astype(jnp.float32)
  settings = (bound, float(eps), jnp.dtype(out_dtype), bool(width_minor_cotangent))
  if kept is None:
    max_BQT, sum_BQT, outs = _phase1(buffer_KBTD, folded_QD, nv, inv_rms_KBT, *settings)
  else:
    max_BQT, sum_BQT = (jnp.stack([q[i] for q in kept], axis=1) for i in (0, 1))
    max_BQT, sum_BQT, outs = _phase1_kept(
      buffer_KBTD,
      folded_QD,
      nv,
      inv_rms_KBT,
      max_BQT,
      sum_BQT,
      tuple(q[2] for q in kept),
      *settings,
    )
  max_BQT = jax.lax.stop_gradient(max_BQT)
  return tuple((max_BQT[:, q], sum_BQT[:, q], out) for q, out in enumerate(outs))
