"""Small array helpers shared by the layers and the residuals."""

import jax
import jax.numpy as jnp


def lead(x: jax.Array, ndim: int) -> jax.Array:
  """`x` with leading axes of size 1 up to `ndim` axes: broadcasting made explicit
  (the tests run with rank promotion set to raise)."""
  return jnp.reshape(x, (1,) * (ndim - x.ndim) + x.shape)


def rms_inverse(x: jax.Array, eps: float) -> jax.Array:
  """1 / RMS(x) over the last axis, in float32."""
  x = x.astype(jnp.float32)
  return jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1) + eps)
