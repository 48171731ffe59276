"""HC/mHC's stream write as a Pallas TPU kernel and its VJP (`model.depth_kernel=
'pallas'` with residual 'hc' or 'mhc'), the same function as `hyper_streams.write`,
and the dynamic coefficients' projections:

    H'_j = sum_i R_ij H_i + b_j f(h)

  forward:   the m streams and f(h) in, the m new streams out (storage dtype), the
             float32 accumulation inside the kernel;
  backward:  the streams' cotangents dH_i = sum_j R_ij dH'_j, f(h)'s
             df(h) = sum_j b_j dH'_j and the m^2 + m per-token weight cotangents
             dR_ij = <H_i, dH'_j>, db_j = <f(h), dH'_j> in one pass over the tiles:
             each stream and cotangent read once, no float32 copy of either in memory.

  gated read (dynamic HC/mHC; `gated_read`): the coefficients' projections, the
             read gates and h = sum_i a_i H_i from one read of the streams, and the
             whole backward (the read's, the projections' and the write's
             cotangents of the streams summed) from one more; `boundary`: the same
             with the write before it, on the same pass.

The kernels see the streams d-minor, as the TPU compiler lays them out for the XLA
version ([m, B, T, D]{3,2,1,0}): a program's block is a tile of tokens of every
stream, [m, t, D], the width on the lanes, so no relayout at the kernel's boundary.
The per-token weights travel tokens-minor, as the model computes them, as one
[B, m^2 + m, T] float32 array; inside, a product with the identity on the (otherwise
idle) MXU turns a block to tokens-major so that each weight is a [t, 1] column that
broadcasts over the lanes (and the weights' cotangents back).
The grid runs over (batch row, tile of T), both 'parallel' (a megacore chip splits
them). Off the TPU (the CPU tests) the same kernels run in Pallas interpret mode;
under the model's mesh they run per device in `jax.shard_map` (streams split over
batch and length; a split over the streams or the width is refused).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import PartitionSpec as P

from attnres_jax.kernels import pallas_mesh
from attnres_jax.nn import sharding

F32 = jnp.float32
_SQ = pl.squeezed
# What one program's blocks (double buffered) and float32 temporaries may take, and
# the headroom asked of Mosaic above that estimate (v5p has 64 MiB a core).
TILE_VMEM_BYTES = 32 * 2**20
HEADROOM_VMEM_BYTES = 16 * 2**20
VMEM_BYTES = 64 * 2**20
LANES = 128  # tokens per tile step: the per-token weights hold the tokens on lanes


# -- the kernels: one program = one tile of tokens of every stream ------------------


def _column(coef_tK, k):
  """Per-token weight k as a [t, 1] column (broadcasts over the lanes)."""
  return coef_tK[:, k : k + 1]


_TN = (((0,), (0,)), ((), ()))  # a^T . b
_NT = (((1,), (1,)), ((), ()))  # a . b^T
_HIGHEST = jax.lax.Precision.HIGHEST


def _eye(n):
  rows = jax.lax.broadcasted_iota(jnp.int32, (n, n), 0)
  return (rows == jax.lax.broadcasted_iota(jnp.int32, (n, n), 1)).astype(F32)


def _tokens_major(coef_Kt):
  """[K, t] (tokens on the lanes, as stored) -> [t, K]: a product with the identity
  on the MXU (exact at HIGHEST precision: each float32 value enters as bfloat16
  parts that sum back to it), where a vector transpose of a [K, t] block whose K is
  no multiple of 128 would need relayouts."""
  return jax.lax.dot_general(
    coef_Kt, _eye(coef_Kt.shape[0]), _TN, precision=_HIGHEST, preferred_element_type=F32
  )


def _tokens_minor(coef_tK):
  """[t, K] -> [K, t], the same way."""
  return jax.lax.dot_general(
    _eye(coef_tK.shape[1]), coef_tK, _NT, precision=_HIGHEST, preferred_element_type=F32
  )


def _write_values(coef_tK, h_tD, out_tD, m):
  """The new streams (float32 [t, D] each) from the streams and f(h) (float32),
  the sums in the XLA version's order."""
  new_tD = []
  for j in range(m):
    acc_tD = _column(coef_tK, j) * h_tD[0]
    for i in range(1, m):
      acc_tD = acc_tD + _column(coef_tK, i * m + j) * h_tD[i]
    new_tD.append(acc_tD + _column(coef_tK, m * m + j) * out_tD)
  return new_tD


def _write_backward_values(coef_tK, h_tD, out_tD, dnew_tD, m):
  """(the streams' cotangents, f(h)'s, the weights' [t, K]), float32, from the
  streams, f(h) and the new streams' cotangents (float32)."""
  lane_tK = jax.lax.broadcasted_iota(jnp.int32, coef_tK.shape, 1)
  dcoef_tK = jnp.zeros(coef_tK.shape, F32)

  def put(dcoef_tK, k, x_tD, y_tD):
    dot_t1 = jnp.sum(x_tD * y_tD, axis=1, keepdims=True)
    return jnp.where(lane_tK == k, dot_t1, dcoef_tK)

  dout_tD = None
  for j in range(m):
    term = _column(coef_tK, m * m + j) * dnew_tD[j]
    dout_tD = term if dout_tD is None else dout_tD + term
    dcoef_tK = put(dcoef_tK, m * m + j, dnew_tD[j], out_tD)
  dh_tD = []
  for i in range(m):
    acc_tD = None
    for j in range(m):
      term = _column(coef_tK, i * m + j) * dnew_tD[j]
      acc_tD = term if acc_tD is None else acc_tD + term
      dcoef_tK = put(dcoef_tK, i * m + j, h_tD[i], dnew_tD[j])
    dh_tD.append(acc_tD)
  return dh_tD, dout_tD, dcoef_tK


def forward_kernel(coef_ref, streams_ref, out_ref, new_ref, *, m):
  """coef [K, t] (K = m^2 + m rows, R_ij at i m + j, then b_j; tokens on the lanes),
  streams [m, t, D], f(h) [t, D] -> new streams [m, t, D]."""
  coef_tK = _tokens_major(coef_ref[...])
  h_tD = [streams_ref[i].astype(F32) for i in range(m)]
  new_tD = _write_values(coef_tK, h_tD, out_ref[...].astype(F32), m)
  for j in range(m):
    new_ref[j] = new_tD[j].astype(new_ref.dtype)


def backward_kernel(
  coef_ref, streams_ref, out_ref, dnew_ref, dstreams_ref, dout_ref, dcoef_ref, *, m
):
  """coef [K, t], streams [m, t, D], f(h) [t, D], the new streams' cotangents
  [m, t, D] -> the streams' cotangents [m, t, D], f(h)'s [t, D] and the weights'
  [K, t] (float32; per token a reduction over the lanes)."""
  coef_tK = _tokens_major(coef_ref[...])
  h_tD = [streams_ref[i].astype(F32) for i in range(m)]
  dnew_tD = [dnew_ref[j].astype(F32) for j in range(m)]
  dh_tD, dout_tD, dcoef_tK = _write_backward_values(
    coef_tK, h_tD, out_ref[...].astype(F32), dnew_tD, m
  )
  dout_ref[...] = dout_tD.astype(dout_ref.dtype)
  for i in range(m):
    dstreams_ref[i] = dh_tD[i].astype(dstreams_ref.dtype)
  dcoef_ref[...] = _tokens_minor(dcoef_tK)


def vmem_bytes(tile, m, dim, itemsize, footprint=None):
  """On-chip memory of a kernel at `tile` tokens. `footprint`: (its stream-sized
  [t, D] blocks in and out, the float32 [t, D] values it works on); by default the
  write's backward, the larger write kernel: 3m + 2 blocks (streams, f(h), the
  cotangents in; the streams' and f(h)'s cotangents out) and 2m + 2 values. Blocks
  are double buffered, plus the weights and their cotangents, counted as [t, K]
  padded to 128 lanes, as they are inside."""
  num_blocks, num_values = footprint or (3 * m + 2, 2 * m + 2)
  blocks = num_blocks * tile * dim * itemsize + 2 * tile * 128 * 4
  return 2 * blocks + num_values * tile * dim * 4


def choose_tile(length, m, dim, itemsize, footprint=None):
  """Tokens per program: the largest multiple of 128 dividing `length` whose kernels
  fit TILE_VMEM_BYTES (at least 128), or all of T when no multiple of 128 divides it."""
  fits = [
    t
    for t in range(LANES, length + 1, LANES)
    if length % t == 0 and vmem_bytes(t, m, dim, itemsize, footprint) <= TILE_VMEM_BYTES
  ]
  if fits:
    return max(fits)
  return LANES if length % LANES == 0 else length


# -- the launches ---------------------------------------------------------------------


def _launch(kernel, args, kinds, outs, m, cost, footprint=None, **kernel_options):
  """The pallas_call of `kernel` over (batch row, tile of T) on `args` whose blocks
  `kinds` name ('coef' [B, K, T], 'streams' [m, B, T, D], 'one' [B, T, D], 'whole':
  all of a small array in every program); `outs`: (kind, shape, dtype) per result;
  `cost`: (flops, HBM bytes); it and a result's shape may be functions of the tile
  (a 'partial' result's); `footprint`: `vmem_bytes`'. Mosaic on the TPU, interpret
  mode elsewhere."""
  streams = args[kinds.index('streams')]
  _, batch, length, dim = streams.shape
  tile = choose_tile(length, m, dim, streams.dtype.itemsize, footprint)
  vmem = vmem_bytes(tile, m, dim, streams.dtype.itemsize, footprint)
  if callable(cost):
    cost = cost(tile)

  def spec(kind, shape):
    if kind == 'coef':
      return pl.BlockSpec((_SQ, shape[1], tile), lambda b, t: (b, 0, t))
    if kind == 'streams':
      return pl.BlockSpec((m, _SQ, tile, dim), lambda b, t: (0, b, t, 0))
    if kind == 'one':
      return pl.BlockSpec((_SQ, tile, dim), lambda b, t: (b, t, 0))
    if kind == 'partial':  # one program's partial sums [B, T / tile, ...]
      rest = (0,) * (len(shape) - 2)
      return pl.BlockSpec((_SQ, _SQ, *shape[2:]), lambda b, t: (b, t, *rest))
    assert kind == 'whole', kind  # the same whole array for every program
    return pl.BlockSpec(shape, lambda b, t: (0,) * len(shape))

  outs = [
    (kind, shape(tile) if callable(shape) else shape, dtype)
    for kind, shape, dtype in outs
  ]

  def make(interpret):
    return pl.pallas_call(
      functools.partial(kernel, m=m, **kernel_options),
      out_shape=[jax.ShapeDtypeStruct(shape, dtype) for _, shape, dtype in outs],
      grid=(batch, length // tile),
      in_specs=[spec(kind, arg.shape) for kind, arg in zip(kinds, args)],
      out_specs=[spec(kind, shape) for kind, shape, _ in outs],
      compiler_params=pltpu.CompilerParams(
        dimension_semantics=('parallel', 'parallel'),
        vmem_limit_bytes=min(VMEM_BYTES, vmem + HEADROOM_VMEM_BYTES),
      ),
      cost_estimate=pl.CostEstimate(
        flops=int(cost[0]), transcendentals=0, bytes_accessed=int(cost[1])
      ),
      interpret=interpret,
    )

  return jax.lax.platform_dependent(
    *args, tpu=lambda *a: make(False)(*a), default=lambda *a: make(True)(*a)
  )


def _forward_device(coef_BKT, streams_MBTD, out_BTD):
  m, batch, length, dim = streams_MBTD.shape
  tokens, size = batch * length, streams_MBTD.dtype.itemsize
  cost = (
    tokens * dim * 2 * m * (m + 1),  # m + 1 multiply-adds per output element
    tokens * (dim * (2 * m + 1) * size + coef_BKT.shape[1] * 4),
  )
  (new_MBTD,) = _launch(
    forward_kernel,
    (coef_BKT, streams_MBTD, out_BTD),
    ('coef', 'streams', 'one'),
    [('streams', streams_MBTD.shape, streams_MBTD.dtype)],
    m,
    cost,
  )
  return new_MBTD


def _backward_device(coef_BKT, streams_MBTD, out_BTD, dnew_MBTD):
  m, batch, length, dim = streams_MBTD.shape
  tokens, size = batch * length, streams_MBTD.dtype.itemsize
  num_coef = coef_BKT.shape[1]
  cost = (
    # the m + 1 cotangents' multiply-adds and the m^2 + m dots, per element
    tokens * dim * 2 * (m * (m + 1) + num_coef),
    tokens * (dim * (3 * m + 2) * size + 2 * num_coef * 4),
  )
  return _launch(
    backward_kernel,
    (coef_BKT, streams_MBTD, out_BTD, dnew_MBTD),
    ('coef', 'streams', 'one', 'streams'),
    [
      ('streams', streams_MBTD.shape, streams_MBTD.dtype),
      ('one', out_BTD.shape, out_BTD.dtype),
      ('coef', coef_BKT.shape, F32),
    ],
    m,
    cost,
  )


def per_device(fn, shape, in_kinds, out_kinds):
  """`fn` per device under the active mesh, or `fn` as is on one device: the streams
  (of `shape`) split over batch and length as the sharding rules say, every operand
  and result (`in_kinds`, `out_kinds`: 'streams', 'one', 'coef', 'partial' or 'maps') alike;
  'whole' operands are whole on every device."""
  split = pallas_mesh.batch_length_split(shape, 'the HC/mHC streams', 'streams')
  if split is None:
    return fn
  mesh, b, t = split
  spec = dict(
    streams=P(None, b, t, None),  # [m, B, T, D]
    one=P(b, t, None),  # [B, T, D]
    coef=P(b, None, t),  # [B, K, T]
    maps=P(b, None, None, t),  # [B, m, m, T] (sinkhorn_pallas)
    partial=P(b, t),  # [B, T / tile, ...]: per-program partial sums
    whole=P(),  # small, on every device
  ).get
  return jax.shard_map(
    fn,
    mesh=mesh,
    in_specs=tuple(map(spec, in_kinds)),
    out_specs=tuple(map(spec, out_kinds))
    if isinstance(out_kinds, tuple)
    else spec(out_kinds),
    check_vma=False,
  )


# -- the custom VJP ---------------------------------------------------------------------


def _coefficients(mix_MMBT, write_MBT):
  """[B, m^2 + m, T] float32 (tokens minor, as the model computes them): R_ij at
  row i m + j, then b_j."""
  m = write_MBT.shape[0]
  flat_KBT = jnp.concatenate([mix_MMBT.reshape(m * m, *write_MBT.shape[1:]), write_MBT])
  return jnp.swapaxes(flat_KBT.astype(F32), 0, 1)


@jax.custom_vjp
def write(mix_MMBT, write_MBT, streams_MBTD, out_BTD):
  """`hyper_streams.write` by the Pallas kernels: the new streams [m, B, T, D] in the
  streams' dtype; mix[i, j]: from stream i to stream j. The per-token weights are
  float32 (as `Coefficients` holds them), and so are their cotangents."""
  return _write_fwd(mix_MMBT, write_MBT, streams_MBTD, out_BTD)[0]


def _write_fwd(mix_MMBT, write_MBT, streams_MBTD, out_BTD):
  coef_BKT = _coefficients(mix_MMBT, write_MBT)
  fn = per_device(
    _forward_device, streams_MBTD.shape, ('coef', 'streams', 'one'), 'streams'
  )
  new_MBTD = fn(coef_BKT, streams_MBTD, out_BTD)
  return new_MBTD, (coef_BKT, streams_MBTD, out_BTD)


def _write_bwd(saved, dnew_MBTD):
  coef_BKT, streams_MBTD, out_BTD = saved
  m = streams_MBTD.shape[0]
  fn = per_device(
    _backward_device,
    streams_MBTD.shape,
    ('coef', 'streams', 'one', 'streams'),
    ('streams', 'one', 'coef'),
  )
  dstreams_MBTD, dout_BTD, dcoef_BKT = fn(
    coef_BKT, streams_MBTD, out_BTD, dnew_MBTD.astype(streams_MBTD.dtype)
  )
  dcoef_KBT = jnp.swapaxes(dcoef_BKT, 0, 1)
  d_mix = dcoef_KBT[: m * m].reshape(m, m, *dcoef_KBT.shape[1:])
  return d_mix, dcoef_KBT[m * m :], dstreams_MBTD, dout_BTD


write.defvjp(_write_fwd, _write_bwd)


# -- HC/mHC's read with its coefficients: one read of the streams --------------------
#
# Dynamic HC's and mHC's read weights come from the streams themselves, through the
# normalised projections n (`hyper_streams.normed_projection`): HC's a_i = base_i +
# s tanh(n_i0) (each stream normalised on its own), mHC's a_i = sigmoid(base_i + s
# n_i) (the streams normalised together). The XLA path reads the streams twice before
# the branch (the projections, then the weighted sum) and, in the backward, three
# times more (the read's and the projections' VJPs, then the sum of the streams'
# cotangents). The kernels below do the projections, the gates and h = sum_i a_i H_i
# on one tile of tokens of every stream, and all of the backward on one read of the
# streams and of dh.


class _Columns:
  """The columns of a [t, R] block of the normalised projections: HC (`per_stream`,
  K = m + 2 projections per stream) stream i's at i K .. i K + K - 1, its read gate
  first, then each stream's inverse RMS (R = m K + m); mHC (K = m^2 + 2m over all
  streams) the K projections, the m read gates first, then the inverse RMS of all the
  streams together (R = K + 1). A group is the columns one inverse RMS normalises.
  `gate` [2, R] holds s (row 0) and base_i (row 1) at the read columns, zero
  elsewhere."""

  def __init__(self, m, num_out, per_stream):
    self.m, self.num_out, self.per_stream = m, num_out, per_stream
    self.num_groups = m if per_stream else 1
    self.num_rows = m * num_out + m if per_stream else num_out + 1

  def read(self, i):
    return i * self.num_out if self.per_stream else i

  @property
  def read_columns(self):
    return (
      slice(0, self.m * self.num_out, self.num_out)
      if self.per_stream
      else slice(0, self.m)
    )

  def inv_rms(self, g):
    return self.m * self.num_out + g if self.per_stream else self.num_out

  def group_of(self, i):
    return i if self.per_stream else 0

  def groups(self, lane_tR):
    """Per group, where its projection columns are."""
    if not self.per_stream:
      return [lane_tR < self.num_out]
    k = self.num_out
    return [(lane_tR >= g * k) & (lane_tR < (g + 1) * k) for g in range(self.m)]

  def activation(self, normed_tR):
    """What the gate scales: HC tanh(n), mHC n itself."""
    return jnp.tanh(normed_tR) if self.per_stream else normed_tR


def read_gate(scale, base_M, num_out, per_stream):
  """The gate [2, R] of `gated_read` and `boundary`: the read weights' scale s (a
  scalar) and bases [m] at the read columns (`_Columns`), zero elsewhere. HC: K =
  `num_out` projections per stream (`per_stream`); mHC: K over all streams."""
  cols = _Columns(base_M.shape[0], num_out, per_stream)
  gate_2R = jnp.zeros((2, cols.num_rows), jnp.float32)
  values = jnp.stack([jnp.broadcast_to(scale, base_M.shape), base_M])
  return gate_2R.at[:, cols.read_columns].set(values)


def normalised_projections(coef_RBT, m, num_out, per_stream):
  """The normalised projections out of `gated_read`'s rows [R, B, T], laid out as
  `hyper_streams.normed_projection` gives them: HC [K, m, B, T], mHC [K, B, T]."""
  if per_stream:  # [m K, B, T] -> [K, m, B, T]
    normed = coef_RBT[: m * num_out].reshape(m, num_out, *coef_RBT.shape[1:])
    return jnp.swapaxes(normed, 0, 1)
  return coef_RBT[:num_out]


def _read_weights(gate, act_tR, per_stream):
  """The read weights at the read columns: HC base + s tanh(n), mHC sigmoid(base +
  s n), in the XLA path's order of operations."""
  z_tR = gate[1:2] + gate[0:1] * act_tR
  return z_tR if per_stream else jax.nn.sigmoid(z_tR)


def _gated_read_values(phi_ref, gate, stored_tD, *, m, num_out, per_stream, eps):
  """(h float32 [t, D], the normalised projections and inverse RMS [t, R]) from the
  streams as stored ([t, D] each, the storage dtype: the dot's operands)."""
  cols = _Columns(m, num_out, per_stream)
  dim = stored_tD[0].shape[-1]
  projected_tR, h_tD, squares_t1 = None, [], []
  for i in range(m):
    term_tR = jax.lax.dot_general(
      stored_tD[i], phi_ref[i], (((1,), (0,)), ((), ())), preferred_element_type=F32
    )
    projected_tR = term_tR if projected_tR is None else projected_tR + term_tR
    h_tD.append(stored_tD[i].astype(F32))
    squares_t1.append(jnp.sum(h_tD[i] * h_tD[i], axis=1, keepdims=True))
  if per_stream:
    inv_rms_t1 = [jax.lax.rsqrt(sq / dim + eps) for sq in squares_t1]
  else:
    total_t1 = functools.reduce(jnp.add, squares_t1)
    inv_rms_t1 = [jax.lax.rsqrt(total_t1 / (m * dim) + eps)]
  lane_tR = jax.lax.broadcasted_iota(jnp.int32, projected_tR.shape, 1)
  coef_tR = projected_tR
  for g, in_group in enumerate(cols.groups(lane_tR)):
    coef_tR = jnp.where(in_group, projected_tR * inv_rms_t1[g], coef_tR)
    coef_tR = jnp.where(lane_tR == cols.inv_rms(g), inv_rms_t1[g], coef_tR)
  read_tR = _read_weights(gate, cols.activation(coef_tR), per_stream)
  acc_tD = None
  for i in range(m):
    term_tD = _column(read_tR, cols.read(i)) * h_tD[i]
    acc_tD = term_tD if acc_tD is None else acc_tD + term_tD
  return acc_tD, coef_tR


def _gated_read_backward_values(
  phi_ref,
  gate,
  coef_tR,
  dcoef_tR,
  stored_tD,
  dh_tD,
  dpassed_tD,
  *,
  m,
  num_out,
  per_stream,
):
  """(the streams' cotangents, float32 [t, D] each: the passed-through ones plus the
  read's and the projections'; the read gates' pre-activation cotangents [t, R] at
  the read columns; this tile's share of phi's, [P, R, D]: row c of slice p the sum
  over its tokens of column c's projection cotangent times stream p (HC, P = 1: the
  stream column c belongs to))."""
  cols = _Columns(m, num_out, per_stream)
  dim = stored_tD[0].shape[-1]
  dtype = stored_tD[0].dtype
  lane_tR = jax.lax.broadcasted_iota(jnp.int32, coef_tR.shape, 1)
  groups = cols.groups(lane_tR)
  act_tR = cols.activation(coef_tR)
  read_tR = _read_weights(gate, act_tR, per_stream)
  h_tD = [x.astype(F32) for x in stored_tD]
  # da_i = <H_i, dh> at the read columns; through mHC's sigmoid to its argument.
  dz_tR = jnp.zeros(coef_tR.shape, F32)
  for i in range(m):
    dot_t1 = jnp.sum(h_tD[i] * dh_tD, axis=1, keepdims=True)
    dz_tR = jnp.where(lane_tR == cols.read(i), dot_t1, dz_tR)
  if not per_stream:
    dz_tR = dz_tR * read_tR * (1 - read_tR)
  # The normalised projections' cotangent (through HC's tanh for the read gates);
  # then the raw projections' (times the inverse RMS) and the inverse RMS' (sum dn P
  # + its own).
  dact_tR = gate[0:1] * dz_tR
  if per_stream:
    dact_tR = dact_tR * (1 - act_tR * act_tR)
  dnormed_tR = dcoef_tR + dact_tR
  inv_rms_t1 = [_column(coef_tR, cols.inv_rms(g)) for g in range(cols.num_groups)]
  dprojected_tR = jnp.zeros(coef_tR.shape, F32)
  scale_t1 = []
  for g, in_group in enumerate(groups):
    dprojected_tR = jnp.where(in_group, dnormed_tR * inv_rms_t1[g], dprojected_tR)
    # P = n / r on the group's columns: d r = sum_k dn_k n_k / r (+ r's own).
    dn_p_tR = jnp.where(in_group, dnormed_tR * coef_tR, 0.0)
    d_inv_rms_t1 = jnp.sum(dn_p_tR, axis=1, keepdims=True) / inv_rms_t1[g]
    d_inv_rms_t1 = d_inv_rms_t1 + _column(dcoef_tR, cols.inv_rms(g))
    # r = (s / n + eps)^(-1/2) over n features: dr/dH = -r^3 H / n.
    features = dim if per_stream else m * dim
    scale_t1.append(-d_inv_rms_t1 * inv_rms_t1[g] ** 3 / features)
  dprojected_tR = dprojected_tR.astype(dtype)  # the dot's operands, as XLA's
  dphi_PRD, dstreams_tD = [], []
  for i in range(m):
    from_projection_tD = jax.lax.dot_general(
      dprojected_tR, phi_ref[i], _NT, preferred_element_type=F32
    )
    dstreams_tD.append(
      dpassed_tD[i]
      + _column(read_tR, cols.read(i)) * dh_tD
      + from_projection_tD
      + scale_t1[cols.group_of(i)] * h_tD[i]
    )
    mine_tR = (
      jnp.where(groups[i], dprojected_tR, jnp.zeros_like(dprojected_tR))
      if per_stream
      else dprojected_tR
    )
    term_RD = jax.lax.dot_general(mine_tR, stored_tD[i], _TN, preferred_element_type=F32)
    if per_stream and dphi_PRD:
      dphi_PRD[0] = dphi_PRD[0] + term_RD
    else:
      dphi_PRD.append(term_RD)
  return dstreams_tD, dz_tR, jnp.stack(dphi_PRD)


def _gated_read_into(phi_ref, gate_ref, stored_tD, h_ref, coef_ref, **options):
  """`_gated_read_values` of the streams as stored, into the results' blocks."""
  h_tD, coef_tR = _gated_read_values(phi_ref, gate_ref[...], stored_tD, **options)
  h_ref[...] = h_tD.astype(h_ref.dtype)
  coef_ref[...] = _tokens_minor(coef_tR)


def _gated_read_backward_from(
  phi_ref, gate_ref, coef_ref, dcoef_ref, stored_tD, dh_ref, dpassed_tD, **options
):
  """`_gated_read_backward_values` from the kernels' blocks (tokens-minor rows)."""
  return _gated_read_backward_values(
    phi_ref,
    gate_ref[...],
    _tokens_major(coef_ref[...]),
    _tokens_major(dcoef_ref[...]),
    stored_tD,
    dh_ref[...].astype(F32),
    dpassed_tD,
    **options,
  )


def gated_read_kernel(phi_ref, gate_ref, streams_ref, h_ref, coef_ref, **options):
  """phi [m, D, R] (`_gated_read_phi`), gate [2, R], streams [m, t, D] -> h [t, D]
  and the normalised projections with the inverse RMS [R, t] (float32, tokens on the
  lanes)."""
  stored_tD = [streams_ref[i] for i in range(options['m'])]
  _gated_read_into(phi_ref, gate_ref, stored_tD, h_ref, coef_ref, **options)


def gated_read_backward_kernel(
  phi_ref,
  gate_ref,
  coef_ref,
  dcoef_ref,
  streams_ref,
  dh_ref,
  dpassed_ref,
  dstreams_ref,
  dread_ref,
  dphi_ref,
  **options,
):
  """coef and its cotangent [R, t], the streams [m, t, D], dh [t, D] and the
  passed-through streams' cotangents [m, t, D] -> the streams' cotangents [m, t, D],
  the read gates' [R, t] and this tile's share of phi's [P, R, D]
  (`_gated_read_backward_values`)."""
  m = options['m']
  dstreams_tD, dread_tR, dphi_PRD = _gated_read_backward_from(
    phi_ref,
    gate_ref,
    coef_ref,
    dcoef_ref,
    [streams_ref[i] for i in range(m)],
    dh_ref,
    [dpassed_ref[i].astype(F32) for i in range(m)],
    **options,
  )
  for i in range(m):
    dstreams_ref[i] = dstreams_tD[i].astype(dstreams_ref.dtype)
  dread_ref[...] = _tokens_minor(dread_tR)
  dphi_ref[...] = dphi_PRD


def boundary_kernel(
  phi_ref, gate_ref, wcoef_ref, streams_ref, out_ref, new_ref, h_ref, coef_ref, **options
):
  """One sublayer's write and the next one's gated read: the write's weights
  [K_w, t], the streams before it [m, t, D] and f(h) [t, D] -> the new streams
  [m, t, D] (as stored), the next read's h [t, D] and its projections [R, t] (from
  the new streams as stored, exactly as the two kernels apart)."""
  m = options['m']
  wcoef_tK = _tokens_major(wcoef_ref[...])
  h_tD = [streams_ref[i].astype(F32) for i in range(m)]
  new_tD = _write_values(wcoef_tK, h_tD, out_ref[...].astype(F32), m)
  stored_tD = [x.astype(new_ref.dtype) for x in new_tD]
  for j in range(m):
    new_ref[j] = stored_tD[j]
  _gated_read_into(phi_ref, gate_ref, stored_tD, h_ref, coef_ref, **options)


def boundary_backward_kernel(
  phi_ref,
  gate_ref,
  coef_ref,
  dcoef_ref,
  wcoef_ref,
  streams_ref,
  out_ref,
  dh_ref,
  dnew_ref,
  dstreams_ref,
  dout_ref,
  dwcoef_ref,
  dread_ref,
  dphi_ref,
  **options,
):
  """The backward of `boundary_kernel`: the new streams recomputed from the streams
  and f(h) (not read), the gated read's backward on them (with the new streams'
  cotangent as the passed-through one), its streams' cotangent rounded to the
  storage dtype as the two kernels apart store it, then the write's backward ->
  the streams' cotangents [m, t, D], f(h)'s [t, D], the write weights' [K_w, t], the
  read gates' [R, t] and this tile's share of phi's [P, R, D]."""
  m = options['m']
  dtype = streams_ref.dtype
  wcoef_tK = _tokens_major(wcoef_ref[...])
  h_tD = [streams_ref[i].astype(F32) for i in range(m)]
  out_tD = out_ref[...].astype(F32)
  stored_tD = [x.astype(dtype) for x in _write_values(wcoef_tK, h_tD, out_tD, m)]
  dnew_tD, dread_tR, dphi_PRD = _gated_read_backward_from(
    phi_ref,
    gate_ref,
    coef_ref,
    dcoef_ref,
    stored_tD,
    dh_ref,
    [dnew_ref[j].astype(F32) for j in range(m)],
    **options,
  )
  dnew_tD = [x.astype(dtype).astype(F32) for x in dnew_tD]
  dh_tD, dout_tD, dwcoef_tK = _write_backward_values(wcoef_tK, h_tD, out_tD, dnew_tD, m)
  for i in range(m):
    dstreams_ref[i] = dh_tD[i].astype(dstreams_ref.dtype)
  dout_ref[...] = dout_tD.astype(dout_ref.dtype)
  dwcoef_ref[...] = _tokens_minor(dwcoef_tK)
  dread_ref[...] = _tokens_minor(dread_tR)
  dphi_ref[...] = dphi_PRD


def _gated_read_phi(phi, m, dtype):
  """The projection as the kernels' [m, D, R] (`_Columns`): HC's [D, K] copied into
  each stream's columns i K .. i K + K - 1, zero elsewhere; mHC's [m, D, K] as it
  is; zero in the inverse-RMS columns."""
  if phi.ndim == 3:  # mHC
    return jnp.pad(phi, ((0, 0), (0, 0), (0, 1))).astype(dtype)
  dim, num_out = phi.shape
  phi_MDR = jnp.einsum('ij,dk->idjk', jnp.eye(m, dtype=phi.dtype), phi)
  phi_MDR = phi_MDR.reshape(m, dim, m * num_out)
  return jnp.pad(phi_MDR, ((0, 0), (0, 0), (0, m))).astype(dtype)


def _partial_shape(batch, length, m, num_rows, dim, per_stream):
  """phi's per-tile partial sums [B, T / t, P, R, D] as a function of the tile."""
  slices = 1 if per_stream else m
  return lambda tile: (batch, length // tile, slices, num_rows, dim)


def _gated_read_forward_device(phi_MDR, gate_2R, streams_MBTD, **options):
  m, batch, length, dim = streams_MBTD.shape
  num_rows = phi_MDR.shape[-1]
  tokens, size = batch * length, streams_MBTD.dtype.itemsize
  cost = (
    tokens * m * dim * (2 * num_rows + 2 + 2),  # projections, squares, the read
    tokens * ((m + 1) * dim * size + num_rows * 4) + phi_MDR.size * size,
  )
  return _launch(
    gated_read_kernel,
    (phi_MDR, gate_2R, streams_MBTD),
    ('whole', 'whole', 'streams'),
    [
      ('one', (batch, length, dim), streams_MBTD.dtype),
      ('coef', (batch, num_rows, length), F32),
    ],
    m,
    cost,
    **options,
  )


def _gated_read_backward_device(
  phi_MDR, gate_2R, coef_BRT, dcoef_BRT, streams_MBTD, dh_BTD, dpassed_MBTD, **options
):
  m, batch, length, dim = streams_MBTD.shape
  num_rows = phi_MDR.shape[-1]
  tokens, size = batch * length, streams_MBTD.dtype.itemsize
  partial = _partial_shape(batch, length, m, num_rows, dim, options['per_stream'])
  cost = lambda tile: (
    # da, the projections' two dots, the streams' cotangent sums
    tokens * m * dim * (2 + 4 * num_rows + 6),
    tokens * ((3 * m + 1) * dim * size + 3 * num_rows * 4)
    + phi_MDR.size * size
    + math.prod(partial(tile)[1:]) * batch * 4,
  )
  return _launch(
    gated_read_backward_kernel,
    (phi_MDR, gate_2R, coef_BRT, dcoef_BRT, streams_MBTD, dh_BTD, dpassed_MBTD),
    ('whole', 'whole', 'coef', 'coef', 'streams', 'one', 'streams'),
    [
      ('streams', streams_MBTD.shape, streams_MBTD.dtype),
      ('coef', coef_BRT.shape, F32),
      ('partial', partial, F32),
    ],
    m,
    cost,
    **options,
  )


def _per_token_projection(phi, streams_MBTD):
  """(phi whole on every device, its number of projections K, whether per stream):
  HC's [D, K], mHC's [m, D, K]."""
  whole = sharding.constrain(phi, (None,) * phi.ndim)
  return whole, phi.shape[-1], phi.ndim == 2


def gated_read(phi, gate_2R, streams_MBTD, eps):
  """Dynamic HC's or mHC's read with its coefficients' projections, from one read of
  the streams: (h [B, T, D] in the streams' dtype, [R, B, T] float32: the normalised
  projections n and the inverse RMS (`_Columns`), the streams passed through), where
  n equals `hyper_streams.normed_projection(phi, streams, eps, per_stream)` (HC:
  phi [D, K], per_stream; mHC: phi [m, D, K]) and h = sum_i a_i H_i with HC's
  a_i = gate[1, c] + gate[0, c] tanh(n_c), mHC's a_i = sigmoid(gate[1, c] +
  gate[0, c] n_c) at stream i's read column c. phi whole on every device (as
  there). T a multiple of 128 (`LANES`).
  The write reads the passed-through streams: its cotangent of them then reaches the
  backward kernel, which adds it to the read's and the projections' in the same
  pass (as separate cotangents, autodiff summed the three in another pass over
  3 m streams)."""
  phi, num_out, per_stream = _per_token_projection(phi, streams_MBTD)
  return _gated_read(phi, gate_2R, streams_MBTD, eps, num_out, per_stream)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _gated_read(phi, gate_2R, streams_MBTD, eps, num_out, per_stream):
  return _gated_read_fwd(phi, gate_2R, streams_MBTD, eps, num_out, per_stream)[0]


def _gated_read_fwd(phi, gate_2R, streams_MBTD, eps, num_out, per_stream):
  options = dict(num_out=num_out, per_stream=per_stream)
  fn = per_device(
    functools.partial(_gated_read_forward_device, eps=eps, **options),
    streams_MBTD.shape,
    ('whole', 'whole', 'streams'),
    ('one', 'coef'),
  )
  m = streams_MBTD.shape[0]
  h_BTD, coef_BRT = fn(_gated_read_phi(phi, m, streams_MBTD.dtype), gate_2R, streams_MBTD)
  out = (h_BTD, jnp.swapaxes(coef_BRT, 0, 1), streams_MBTD)
  return out, (phi, gate_2R, streams_MBTD, coef_BRT)


def _gated_read_bwd(eps, num_out, per_stream, saved, cotangents):
  del eps  # enters through the saved inverse RMS
  phi, gate_2R, streams_MBTD, coef_BRT = saved
  dh_BTD, dcoef_RBT, dpassed_MBTD = cotangents
  m, dtype = streams_MBTD.shape[0], streams_MBTD.dtype
  options = dict(num_out=num_out, per_stream=per_stream)
  fn = per_device(
    functools.partial(_gated_read_backward_device, **options),
    streams_MBTD.shape,
    ('whole', 'whole', 'coef', 'coef', 'streams', 'one', 'streams'),
    ('streams', 'coef', 'partial'),
  )
  dstreams_MBTD, dread_BRT, dphi_partial = fn(
    _gated_read_phi(phi, m, dtype),
    gate_2R,
    coef_BRT,
    jnp.swapaxes(dcoef_RBT, 0, 1).astype(F32),
    streams_MBTD,
    dh_BTD.astype(dtype),
    dpassed_MBTD.astype(dtype),
  )
  dphi, d_gate_2R = _gated_read_parameter_cotangents(
    dphi_partial, dread_BRT, coef_BRT, m, num_out, per_stream
  )
  return dphi.astype(phi.dtype), d_gate_2R, dstreams_MBTD


def _gated_read_parameter_cotangents(
  dphi_partial, dread_BRT, coef_BRT, m, num_out, per_stream
):
  """(phi's, the gate's [2, R]) from the backward kernel's per-tile partial sums
  [B, T / t, P, R, D] and the read gates' pre-activation cotangents [B, R, T]."""
  dphi_PRD = jnp.sum(dphi_partial, axis=(0, 1))
  if per_stream:
    # Row c belongs to stream c // K's copy of phi's column c % K: [D, K].
    dphi = jnp.sum(dphi_PRD[0, : m * num_out].reshape(m, num_out, -1), axis=0).T
  else:  # [m, D, K]
    dphi = jnp.swapaxes(dphi_PRD[:, :num_out], 1, 2)
  # gate: row 0 (s) gets sum dz act(n), row 1 (base) sum dz, at the read columns.
  act_BRT = jnp.tanh(coef_BRT) if per_stream else coef_BRT
  d_gate_2R = jnp.stack(
    [jnp.sum(dread_BRT * act_BRT, axis=(0, 2)), jnp.sum(dread_BRT, axis=(0, 2))]
  )
  return dphi, d_gate_2R


_gated_read.defvjp(_gated_read_fwd, _gated_read_bwd)


# -- one sublayer's write and the next one's gated read, fused --------------------------
#
# Between two sublayers the streams are written (`write`) and at once read back
# whole by the next sublayer's gated read. Fused, a tile of the new streams is read
# with its projections while it is still on chip: forward, the streams before the
# write and f(h) in, the new streams, the next h and its projections out (2m + 2
# stream-sized passes for the 3m + 2 of the two kernels apart); backward, the new
# streams are recomputed from the same inputs instead of read, and their cotangent
# goes from the gated read's backward to the write's on chip (3m + 3 passes for
# 6m + 3).


def _boundary_forward_device(
  phi_MDR, gate_2R, wcoef_BKT, streams_MBTD, out_BTD, **options
):
  m, batch, length, dim = streams_MBTD.shape
  num_rows, num_weights = phi_MDR.shape[-1], wcoef_BKT.shape[1]
  tokens, size = batch * length, streams_MBTD.dtype.itemsize
  cost = (
    # the write's multiply-adds, the projections, the squares and the read
    tokens * dim * (2 * m * (m + 1) + m * (2 * num_rows + 4)),
    tokens * ((2 * m + 2) * dim * size + (num_weights + num_rows) * 4)
    + phi_MDR.size * size,
  )
  return _launch(
    boundary_kernel,
    (phi_MDR, gate_2R, wcoef_BKT, streams_MBTD, out_BTD),
    ('whole', 'whole', 'coef', 'streams', 'one'),
    [
      ('streams', streams_MBTD.shape, streams_MBTD.dtype),
      ('one', out_BTD.shape, streams_MBTD.dtype),
      ('coef', (batch, num_rows, length), F32),
    ],
    m,
    cost,
    footprint=(2 * m + 2, 3 * m + 2),
    **options,
  )


def _boundary_backward_device(*args, **options):
  """args: phi [m, D, R], gate, the read's rows and their cotangent, the write's
  weights, the streams, f(h), dh and the new streams' cotangent."""
  phi_MDR, _, coef_BRT, _, wcoef_BKT, streams_MBTD, out_BTD, _, _ = args
  m, batch, length, dim = streams_MBTD.shape
  num_rows, num_weights = phi_MDR.shape[-1], wcoef_BKT.shape[1]
  tokens, size = batch * length, streams_MBTD.dtype.itemsize
  partial = _partial_shape(batch, length, m, num_rows, dim, options['per_stream'])
  cost = lambda tile: (
    # the write recomputed and its backward, the gated read's backward
    tokens * dim * (4 * m * (m + 1) + 2 * num_weights + m * (4 * num_rows + 8)),
    tokens * ((3 * m + 3) * dim * size + (2 * num_weights + 3 * num_rows) * 4)
    + phi_MDR.size * size
    + math.prod(partial(tile)[1:]) * batch * 4,
  )
  return _launch(
    boundary_backward_kernel,
    args,
    ('whole', 'whole', 'coef', 'coef', 'coef', 'streams', 'one', 'one', 'streams'),
    [
      ('streams', streams_MBTD.shape, streams_MBTD.dtype),
      ('one', out_BTD.shape, out_BTD.dtype),
      ('coef', wcoef_BKT.shape, F32),
      ('coef', coef_BRT.shape, F32),
      ('partial', partial, F32),
    ],
    m,
    cost,
    footprint=(3 * m + 3, 5 * m + 3),
    **options,
  )


def boundary(mix_MMBT, write_MBT, streams_MBTD, out_BTD, phi, gate_2R, eps):
  """`write(mix, write, streams, f(h))` and then `gated_read(phi, gate, new streams,
  eps)` in one kernel each way: (h [B, T, D] of the next read, its projections
  [R, B, T], the new streams [m, B, T, D]), the same values as the two apart. T a
  multiple of 128."""
  phi, num_out, per_stream = _per_token_projection(phi, streams_MBTD)
  wcoef_BKT = _coefficients(mix_MMBT, write_MBT)
  return _boundary(
    wcoef_BKT, streams_MBTD, out_BTD, phi, gate_2R, eps, num_out, per_stream
  )


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def _boundary(wcoef_BKT, streams_MBTD, out_BTD, phi, gate_2R, eps, num_out, per_stream):
  args = (wcoef_BKT, streams_MBTD, out_BTD, phi, gate_2R)
  return _boundary_fwd(*args, eps, num_out, per_stream)[0]


def _boundary_fwd(
  wcoef_BKT, streams_MBTD, out_BTD, phi, gate_2R, eps, num_out, per_stream
):
  m = streams_MBTD.shape[0]
  fn = per_device(
    functools.partial(
      _boundary_forward_device, num_out=num_out, per_stream=per_stream, eps=eps
    ),
    streams_MBTD.shape,
    ('whole', 'whole', 'coef', 'streams', 'one'),
    ('streams', 'one', 'coef'),
  )
  out_BTD = out_BTD.astype(streams_MBTD.dtype)
  phi_MDR = _gated_read_phi(phi, m, streams_MBTD.dtype)
  new_MBTD, h_BTD, coef_BRT = fn(phi_MDR, gate_2R, wcoef_BKT, streams_MBTD, out_BTD)
  saved = (wcoef_BKT, streams_MBTD, out_BTD, phi, gate_2R, coef_BRT)
  return (h_BTD, jnp.swapaxes(coef_BRT, 0, 1), new_MBTD), saved


def _boundary_bwd(eps, num_out, per_stream, saved, cotangents):
  del eps  # enters through the saved inverse RMS
  wcoef_BKT, streams_MBTD, out_BTD, phi, gate_2R, coef_BRT = saved
  dh_BTD, dcoef_RBT, dnew_MBTD = cotangents
  m, dtype = streams_MBTD.shape[0], streams_MBTD.dtype
  fn = per_device(
    functools.partial(_boundary_backward_device, num_out=num_out, per_stream=per_stream),
    streams_MBTD.shape,
    ('whole', 'whole', 'coef', 'coef', 'coef', 'streams', 'one', 'one', 'streams'),
    ('streams', 'one', 'coef', 'coef', 'partial'),
  )
  dstreams_MBTD, dout_BTD, dwcoef_BKT, dread_BRT, dphi_partial = fn(
    _gated_read_phi(phi, m, dtype),
    gate_2R,
    coef_BRT,
    jnp.swapaxes(dcoef_RBT, 0, 1).astype(F32),
    wcoef_BKT,
    streams_MBTD,
    out_BTD,
    dh_BTD.astype(dtype),
    dnew_MBTD.astype(dtype),
  )
  dphi, d_gate_2R = _gated_read_parameter_cotangents(
    dphi_partial, dread_BRT, coef_BRT, m, num_out, per_stream
  )
  return dwcoef_BKT, dstreams_MBTD, dout_BTD, dphi.astype(phi.dtype), d_gate_2R


_boundary.defvjp(_boundary_fwd, _boundary_bwd)
