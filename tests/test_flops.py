"""The compute count of a run (attnres_jax.flops) against hand counts."""

import attnres_jax as ar
from attnres_jax import flops


def test_depth_read_sources_by_hand():
  # L = 6 sublayers. Full: sublayer l reads l + 1 sources, the final read 7.
  full = ar.model_config(num_layers=3, residual='full')
  assert flops.depth_read_sources(full) == sum(range(1, 7)) + 7
  # Block S = 4: block 1 (sublayers 0..3) reads b0, then b0 + partial three times;
  # block 2 reads b0, b1, then b0, b1 + partial; the final read b0, b1, b2.
  block = ar.model_config(num_layers=3, residual='block', block_size=4)
  assert flops.depth_read_sources(block) == (1 + 2 + 2 + 2) + (2 + 3) + 3
  assert flops.depth_read_sources(ar.model_config(residual='standard')) == 0
  # A window of 2 caps each read, the final one too, at the embedding + 2 sources.
  window = ar.model_config(num_layers=3, residual='full', depth_window=2,
                           linear_memory_backward=False)
  assert flops.depth_read_sources(window) == 1 + 2 + 3 + 3 + 3 + 3 + 3


def test_forward_flops_terms():
  cfg = ar.model_config(d_model=64, num_layers=2, mlp_dim=128, residual='standard')
  terms = flops.forward_flops_per_token(cfg, seq_len=32)
  assert terms['matmul'] == 2 * (2 * (4 * 64 * 64 + 3 * 64 * 128) + 64 * 256)
  assert terms['attention'] == 2 * 2 * 32 * 64
  assert terms['depth_read'] == 0
  full_cfg = ar.model_config(d_model=64, num_layers=2, mlp_dim=128, residual='full')
  full = flops.forward_flops_per_token(full_cfg, seq_len=32)
  assert full['depth_read'] == 7 * 64 * (sum(range(1, 5)) + 5)
  assert full['total'] > terms['total']
