"""What the linear-memory AttnRes backward (`backward.py`) keeps of a sublayer: its
VJP's float residuals, the rest recomputed."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _saveable(primitive, *avals, **params) -> bool:
  """What the sublayer's VJP closure keeps: everything computed from a float value,
  as plain autodiff keeps it. Values computed from integers and booleans alone (the
  causal mask from iotas, position indices) are recomputed in the backward pass:
  plain autodiff of a scan saves such loop-invariant values once, but a closure that
  the backward's scan returns would stack them once per segment (for attention, a
  boolean [B, N, T, T] mask per layer)."""
  del primitive, params
  return any(jnp.issubdtype(aval.dtype, jnp.inexact) for aval in avals)


def keeping_float_residuals(fn):
  """`fn` whose VJP keeps what `_saveable` allows and recomputes the rest."""
  return jax.checkpoint(fn, policy=_saveable, prevent_cse=False)
