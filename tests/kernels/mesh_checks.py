"""What the kernel tests on a device mesh share: the sharding rules they split the
kernels' operands by, the error they measure, and how they judge a child's results."""

import jax
import numpy as np

# Split over batch on 4 devices, and over batch and length (a parameter's gradient
# then sums per-device partials over two mesh axes).
MESH_RULES = {
  'batch': dict(batch=('data', 'fsdp')),
  'batch_length': dict(batch=('data',), length=('fsdp',)),
}


def max_relative_error(got, want) -> float:
  """The largest difference between two pytrees' leaves, each relative to the largest
  magnitude of its `want` leaf."""
  return max(
    float(np.abs(a - b).max() / (np.abs(b).max() + 1e-30))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want))
  )


def assert_mesh_results(results, count: int, tol: float):
  """A child's `count` results: the flags (names ending in 'per_device' or 'refused')
  true, every other entry an error of at most `tol`."""
  assert len(results) == count, sorted(results)
  for name, result in results.items():
    if name.endswith(('per_device', 'refused')):
      assert result is True, name
    else:
      assert result <= tol, (name, result)
