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
models of configs/sweep.py it is 0.9% (Block, S = 8) to 2.1% (Full) of the total.
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
  if model_cfg.get('depth_window', 0):
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
  if model_cfg.get('depth_query_input', False):
    terms['depth_read'] += 2.0 * d * d * (config_lib.num_sublayers(model_cfg) + 1)
  terms['total'] = sum(terms.values())
  return terms


def training_flops(config) -> float:
  """FLOPs of a whole run: 3 x forward x tokens trained on."""
  per_token = forward_flops_per_token(config.model, config.train.seq_len)['total']
  tokens = config.train.num_steps * config.train.batch_size * config.train.seq_len
  return 3.0 * per_token * tokens
