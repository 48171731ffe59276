"""Training compute from the config, counted in FLOPs (multiply-add = 2 FLOPs).

Per token, forward pass (Kaplan et al. 2020 conventions, plus the depth read):

  matmuls      2 * N_matmul, N_matmul = L_layers * (4 d^2 + 3 d f) + d V (the LM head)
  attention    2 * L_layers * T * d          (QK^T and AV, causal average T/2 each)
  depth reads  7 * d * sum over reads of the number of sources it weighs
               (key RMS: 2d, logit: 2d, weighted sum: 2d, softmax and scaling: ~d)
               + d per sublayer for the Block partial sum

A read of sublayer l weighs depth.num_valid_sources(l, S) sources and the final read
N + 1, so Full costs O(L^2 d) and Block O(L N d) per token (paper, Section 3).

Hyper-Connections / mHC with m streams (the same 'depth_read' term: the residual's own
arithmetic), per sublayer:
  read 2 m d, mixing 2 m^2 d, write 2 m d;
  dynamic HC: per-stream RMS 3 m d, projections 2 m d (m + 2);
  dynamic mHC: RMS of the m d concatenation 3 m d, projections 2 m d (m^2 + 2 m);
  mHC's Sinkhorn: ~8 m^2 per iteration plus 3 m^2 (independent of d);
plus (m - 1) d for the final sum of the streams. O(L m^2 d) per token.

A training step is 3x the forward pass (the backward pass costs twice the forward).
The depth-read term is what separates the residual modes; for the 4-layer, d = 128
models of the study grid (configs/default.py) it is 0.9% (Block, S = 8) to 2.1%
(Full) of the total.
"""

from __future__ import annotations

from attnres_jax import config as config_lib
from attnres_jax import depth

READ_FLOPS_PER_SOURCE_AND_CHANNEL = 7


def depth_read_sources(model_cfg) -> int:
  """Sources weighed by all reads of one token (0 for the standard residual)."""
  if model_cfg.residual not in ('full', 'block'):
    return 0
  num_sublayers = config_lib.num_sublayers(model_cfg)
  size = config_lib.effective_block_size(model_cfg)
  reads = [depth.num_valid_sources(l, size) for l in range(num_sublayers)]
  reads.append(depth.num_slots(num_sublayers, size))  # the final read
  if model_cfg.depth_window:
    reads = [min(n, model_cfg.depth_window + 1) for n in reads]
  return sum(reads)


def hyper_connection_flops(model_cfg) -> float:
  """Forward FLOPs per token of HC/mHC's stream arithmetic (0 for other residuals)."""
  if model_cfg.residual not in config_lib.HYPER_CONNECTIONS:
    return 0.0
  m, d = model_cfg.hc_streams, model_cfg.d_model
  per_sublayer = 2 * m * d + 2 * m * m * d + 2 * m * d
  if model_cfg.hc_dynamic:
    outputs = m * m + 2 * m if model_cfg.residual == 'mhc' else m + 2
    per_sublayer += 3 * m * d + 2 * m * d * outputs
  if model_cfg.residual == 'mhc':
    per_sublayer += 8 * m * m * model_cfg.sinkhorn_iters + 3 * m * m
  return float(config_lib.num_sublayers(model_cfg) * per_sublayer + (m - 1) * d)


def forward_flops_per_token(model_cfg, seq_len: int) -> dict[str, float]:
  d, f, layers = model_cfg.d_model, model_cfg.mlp_dim, model_cfg.num_layers
  matmul_params = layers * (4 * d * d + 3 * d * f) + d * model_cfg.vocab_size
  terms = {
      'matmul': 2.0 * matmul_params,
      'attention': 2.0 * layers * seq_len * d,
      'depth_read': float(READ_FLOPS_PER_SOURCE_AND_CHANNEL * d
                          * depth_read_sources(model_cfg)),
  }
  if model_cfg.residual == 'block':
    terms['depth_read'] += d * config_lib.num_sublayers(model_cfg)
  terms['depth_read'] += hyper_connection_flops(model_cfg)
  if model_cfg.depth_query_input:
    terms['depth_read'] += 2.0 * d * d * (config_lib.num_sublayers(model_cfg) + 1)
  terms['total'] = sum(terms.values())
  return terms


def training_flops(config) -> float:
  """FLOPs of a whole run: 3 x forward x tokens trained on."""
  per_token = forward_flops_per_token(config.model, config.train.seq_len)['total']
  tokens = config.train.num_steps * config.train.batch_size * config.train.seq_len
  return 3.0 * per_token * tokens


def residual_io_per_sublayer(model_cfg) -> dict[str, float]:
  """Memory I/O of the residual (not of the sublayers), per token and sublayer, in
  units of d elements, averaged over the L sublayers with the final read included:
  a counted model of this implementation's forward pass where every residual step
  reads each of its inputs once and writes each output once (scalars such as mixing
  coefficients, softmax statistics and inverse RMS are left out).

  standard  write: read h and f(h), write h'                       -> 2 read, 1 write
  hc, mhc   read: read the m streams, write h; write: read the m streams and f(h),
            write m streams; final: read m, write 1                -> 2m + 1, m + 1
  full, block (two-phase schedule): Phase 1, once per schedule segment, reads the
            completed slots and writes each of the segment's 2G sublayers a partial
            output o (d wide); Phase 2 reads o and the segment's valid local slots and
            writes h; the write reads f(h) (and the partial sum it adds to) and writes
            the slot; the final read reads every slot and writes h.
  One-shot AttnRes reads read every valid slot and write h.
  """
  num_sublayers = config_lib.num_sublayers(model_cfg)
  read = write = 0.0
  if model_cfg.residual == 'standard':
    read, write = 2.0 * num_sublayers, 1.0 * num_sublayers
  elif model_cfg.residual in config_lib.HYPER_CONNECTIONS:
    m = model_cfg.hc_streams
    read = (2 * m + 1) * num_sublayers + m
    write = (m + 1) * num_sublayers + 1
  else:
    from attnres_jax import residual as residual_lib  # pylint: disable=g-import-not-at-top
    res = residual_lib.AttnResResidual(model_cfg)
    size, layers_per_segment = res.block_size, res.segment_layers
    for l in range(num_sublayers):
      layer, which = divmod(l, 2)
      segment, layer_in_segment = divmod(layer, layers_per_segment)
      index, num_local_valid = res.local_index(layer_in_segment, which)
      first = 1 + segment * (2 * layers_per_segment // size)  # completed slots
      if res.two_phase:
        if layer_in_segment == 0 and which == 0:  # Phase 1 of the segment
          queries = 2 * min(layers_per_segment, model_cfg.num_layers - layer)
          read, write = read + first, write + queries
        read, write = read + 1 + num_local_valid, write + 1  # Phase 2
      else:
        read, write = read + first + num_local_valid, write + 1
      adds = l % size != 0  # a partial sum: the slot is read, then written
      read, write = read + 1 + adds, write + 1
    slots = depth.num_slots(num_sublayers, size)
    read, write = read + slots, write + 1  # the final read
  return {'read': read / num_sublayers, 'write': write / num_sublayers,
          'total': (read + write) / num_sublayers}
