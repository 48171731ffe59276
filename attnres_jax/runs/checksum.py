"""Checksums of array trees, to verify what a checkpoint restore read.

Orbax does not check the values it reads back: bytes flipped inside a compressed array
file can decode without complaint into wrong weights. `digest` is computed on the
devices from the bits of every element (any sharding gives the same digest), saved
with each checkpoint and compared by `verify` after a restore.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np


def _leaf_words(x: jax.Array) -> jax.Array:
  """The bits of each element of `x` as uint32 (floats bit-cast, not converted)."""
  if x.dtype == jnp.bool_:
    return x.astype(jnp.uint32)
  unsigned = jnp.dtype(f'uint{8 * x.dtype.itemsize}')
  return jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)


@jax.jit
def _digest_lanes(tree) -> jax.Array:
  """Two 32-bit weighted sums of every element's bits, the elements of all leaves in
  one sequence: sum(word_i * w_i) mod 2**32 with odd weights w_i, so that a change of
  any one element always changes both sums, and swapped elements change them too."""
  total = jnp.zeros((2,), jnp.uint32)
  offset = 0
  for leaf in jax.tree.leaves(tree):
    leaf = jnp.asarray(leaf)
    strides = [math.prod(leaf.shape[k + 1 :]) for k in range(leaf.ndim)]
    index = jnp.full(leaf.shape, offset, jnp.uint32)
    for k, stride in enumerate(strides):
      index = index + jax.lax.broadcasted_iota(jnp.uint32, leaf.shape, k) * jnp.uint32(
        stride % 2**32
      )
    words = _leaf_words(leaf)
    for lane, multiplier in enumerate((0x9E3779B1, 0x85EBCA6B)):
      weight = (index * jnp.uint32(2) + jnp.uint32(1)) * jnp.uint32(multiplier)
      total = total.at[lane].add(jnp.sum(words * weight, dtype=jnp.uint32))
    offset = (offset + leaf.size) % 2**32
  return total


def digest(tree) -> str:
  """A checksum of the values (bits) of an array tree, the same for any sharding."""
  lanes = np.asarray(jax.device_get(_digest_lanes(tree)), np.uint64)
  return f'{int(lanes[0]):08x}{int(lanes[1]):08x}'


class ChecksumError(ValueError):
  """A restored array tree's values differ from the checksum saved with them."""


def verify(step: int, name: str, tree, saved: dict | None) -> None:
  if saved is None or name not in saved:
    return  # a checkpoint written before checksums were recorded
  actual = digest(tree)
  if actual != saved[name]:
    raise ChecksumError(
      f'the {name} of checkpoint {step} do not match their checksum '
      f'(saved {saved[name]}, read {actual}): damaged array files'
    )
