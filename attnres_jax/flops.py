"""Training compute from the config, counted in FLOPs (multiply-add = 2 FLOPs).

Per token, forward pass (Kaplan et al. 2020 conventions, plus the residual's own
arithmetic):

  matmuls      2 * N_matmul, N_matmul = L_layers * (4 d^2 + 3 d f) + d V (the LM head)
  attention    2 * L_layers * T * d          (QK^T and AV, causal average T/2 each)
  depth_read   the residual's arithmetic (`Residual.forward_flops`): for AttnRes
               7 * d * sum over reads of the number of sources it weighs (key RMS: 2d,
               logit: 2d, weighted sum: 2d, softmax and scaling: ~d) + d per sublayer
               for the Block partial sum; for HC/mHC O(L m^2 d) (see
               `residuals/hyper/connections.py`); 0 for the standard residual.

A read of sublayer l weighs depth.num_valid_sources(l, S) sources and the final read
N + 1, so Full costs O(L^2 d) and Block O(L N d) per token (paper, Section 3).

A training step is 3x the forward pass (the backward pass costs twice the forward).
The depth-read term is what separates the residual modes; for the 4-layer, d = 128
models of the study grid (configs/default.py) it is 0.9% (Block, S = 8) to 2.1%
(Full) of the total.
"""

from __future__ import annotations

from attnres_jax import config as config_lib
from attnres_jax import residuals


def _residual(model_cfg):
  """The residual of a model config (a `ModelConfig` or a config section)."""
  return residuals.make(config_lib.ModelConfig.from_config(model_cfg))


def forward_flops_per_token(model_cfg, seq_len: int) -> dict[str, float]:
  d, f, layers = model_cfg.d_model, model_cfg.mlp_dim, model_cfg.num_layers
  matmul_params = layers * (4 * d * d + 3 * d * f) + d * model_cfg.vocab_size
  terms = {
    'matmul': 2.0 * matmul_params,
    'attention': 2.0 * layers * seq_len * d,
    'depth_read': _residual(model_cfg).forward_flops(),
  }
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
  coefficients, softmax statistics and inverse RMS are left out). Each residual
  counts its own (`Residual.io_per_sublayer`): standard 2 read, 1 write; HC/mHC
  2m + 1 + m/L read, m + 1 + 1/L write; AttnRes by its block schedule.
  """
  read, write = _residual(model_cfg).io_per_sublayer()
  return {'read': read, 'write': write, 'total': read + write}
