"""HC/mHC's Pallas TPU kernels (`model.depth_kernel='pallas'` with residual 'hc' or
'mhc'), each with its VJP, as the model calls them. One module per kernel:

  `hyper_write.write`:  the stream write H'_j = sum_i R_ij H_i + b_j f(h), the same
             function as `residuals/hyper/streams.write`: forward and backward each
             one pass over the tiles, no float32 copy of a stream in memory;
  `hyper_gated_read.gated_read` (dynamic HC/mHC): the coefficients' projections,
             the read gates and h = sum_i a_i H_i from one read of the streams, and
             the whole backward (the read's, the projections' and the write's
             cotangents of the streams summed) from one more;
  `hyper_boundary.boundary`: the same with the write before it, on the same pass;
  `sinkhorn_pallas.sinkhorn` (mHC): Sinkhorn-Knopp in VMEM.

What they share (`hyper_tiles.py`): a program's block is a tile of tokens of every
stream, [m, t, D], the width on the lanes, as the TPU compiler lays the streams out
for the XLA version; the per-token weights travel tokens-minor, [B, K, T] float32.
The grid runs over (batch row, tile of T), both 'parallel' (a megacore chip splits
them). Off the TPU (the CPU tests) the same kernels run in Pallas interpret mode;
under the model's mesh they run per device in `jax.shard_map` (streams split over
batch and length; a split over the streams or the width is refused).
"""

from __future__ import annotations

from attnres_jax.kernels.hyper_boundary import boundary
from attnres_jax.kernels.hyper_gated_read import gated_read
from attnres_jax.kernels.hyper_gated_read import normalised_projections
from attnres_jax.kernels.hyper_gated_read import read_gate
from attnres_jax.kernels.hyper_tiles import LANES
from attnres_jax.kernels.hyper_tiles import TILE_VMEM_BYTES
from attnres_jax.kernels.hyper_tiles import choose_tile
from attnres_jax.kernels.hyper_tiles import per_device
from attnres_jax.kernels.hyper_tiles import vmem_bytes
from attnres_jax.kernels.hyper_write import write

__all__ = [
  'LANES',
  'TILE_VMEM_BYTES',
  'boundary',
  'choose_tile',
  'gated_read',
  'normalised_projections',
  'per_device',
  'read_gate',
  'vmem_bytes',
  'write',
]
