"""Training compute from the config, counted in FLOPs (multiply-add = 2 FLOPs).

Per token, forward pass (Kaplan et al. 2020 conventions, plus the depth read):

  matmuls      2 * N_matmul, N_matmul = L_layers * (4 d^2 + 3 d f) + d V (the LM head)
  attention    2 * L_layers * T * d          (QK^T and AV, causal average T/2 each)
  depth reads  7 * d * sum over reads of the number of sources it weighs
               (key RMS: 2d, logit: 2d, weighted sum: 2d, softmax and scaling: ~d)
               + d per sublayer for the Block partial sum

A read of sublayer l weighs depth.num_valid_sources(l, S) sources and the final read
N + 1, so Full costs O(L^2 d) and Block O(L N d) per token (paper, Section 3). A
training step is 3x the forward pass (the backward pass costs twice the forward).
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
  if model_cfg.residual == 'standard':
    return 0
  num_sublayers = config_lib.num_sublayers(model_cfg)
  size = config_lib.effective_block_size(model_cfg)
  reads = [depth.num_valid_sources(l, size) for l in range(num_sublayers)]
  reads.append(depth.num_slots(num_sublayers, size))  # the final read
  if model_cfg.depth_window:
    reads = [min(n, model_cfg.depth_window + 1) for n in reads]
  return sum(reads)


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
  if model_cfg.depth_query_input:
    terms['depth_read'] += 2.0 * d * d * (config_lib.num_sublayers(model_cfg) + 1)
  terms['total'] = sum(terms.values())
  return terms


def training_flops(config) -> float:
  """FLOPs of a whole run: 3 x forward x tokens trained on."""
  per_token = forward_flops_per_token(config.model, config.train.seq_len)['total']
  tokens = config.train.num_steps * config.train.batch_size * config.train.seq_len
  return 3.0 * per_token * tokens
