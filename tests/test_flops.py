"""The compute count of a run (attnres_jax.flops) against hand counts."""

import dataclasses

import attnres_jax as ar
from attnres_jax import flops
from attnres_jax import residuals
from attnres_jax.residuals.attnres import residual as attnres


def residual_flops(cfg) -> float:
  return residuals.make(cfg).forward_flops()


def test_depth_read_sources_by_hand():
  # L = 6 sublayers. Full: sublayer l reads l + 1 sources, the final read 7.
  full = ar.model_config(num_layers=3, residual='full')
  assert attnres.depth_read_sources(full) == sum(range(1, 7)) + 7
  # Block S = 4: block 1 (sublayers 0..3) reads b0, then b0 + partial three times;
  # block 2 reads b0, b1, then b0, b1 + partial; the final read b0, b1, b2.
  block = ar.model_config(num_layers=3, residual='block', block_size=4)
  assert attnres.depth_read_sources(block) == (1 + 2 + 2 + 2) + (2 + 3) + 3
  assert residual_flops(ar.model_config(residual='standard')) == 0
  # A window of 2 caps each read, the final one too, at the embedding + 2 sources.
  window = ar.model_config(num_layers=3, residual='full', depth_window=2)
  assert attnres.depth_read_sources(window) == 1 + 2 + 3 + 3 + 3 + 3 + 3


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


def test_hyper_connection_flops_by_hand():
  # m = 2 streams, d = 8, 1 layer (2 sublayers), dynamic, 3 Sinkhorn iterations.
  common = dict(
    d_model=8, num_heads=2, mlp_dim=16, num_layers=1, hc_streams=2, sinkhorn_iters=3
  )
  hc = ar.model_config(residual='hc', **common)
  # read 2*2*8 + mixing 2*4*8 + write 2*2*8 = 128; norm 3*2*8 = 48; projections
  # W_m, W_r, W_beta: 2*2*8*(1 + 2 + 1) = 128; per sublayer 304; final sum 1*8.
  assert residual_flops(hc) == 2 * 304 + 8
  mhc = ar.model_config(residual='mhc', **common)
  # projections phi_pre, phi_post, phi_res: 2*16*(2 + 2 + 4) = 256; Sinkhorn
  # 8*4*3 + 3*4 = 108; per sublayer 128 + 48 + 256 + 108 = 540.
  assert residual_flops(mhc) == 2 * 540 + 8
  static = ar.model_config(residual='hc', hc_dynamic=False, **common)
  assert residual_flops(static) == 2 * 128 + 8
  terms = flops.forward_flops_per_token(mhc, seq_len=4)
  assert terms['depth_read'] == 2 * 540 + 8
  assert residual_flops(
    ar.model_config(residual='full')
  ) == 7 * 128 * attnres.depth_read_sources(ar.model_config(residual='full'))


def test_residual_io_by_hand():
  io = lambda **kw: flops.residual_io_per_sublayer(ar.model_config(num_layers=2, **kw))
  assert io(residual='standard') == {'read': 2.0, 'write': 1.0, 'total': 3.0}
  # m = 4, L = 4: reads 9 per sublayer + 4 for the final sum; writes 5 + 1.
  assert io(residual='mhc', hc_streams=4) == {
    'read': (4 * 9 + 4) / 4,
    'write': (4 * 5 + 1) / 4,
    'total': (40 + 21) / 4,
  }
  # Dynamic HC with the Pallas kernels: each read does the previous write (reads 4
  # streams and f(h), writes 4 and h); the last write alone (5 in, 4 out), then the
  # final sum (4 in, 1 out).
  assert io(residual='hc', hc_streams=4, depth_kernel='pallas') == {
    'read': (4 * 5 + 5 + 4) / 4,
    'write': (4 * 5 + 4 + 1) / 4,
    'total': (29 + 25) / 4,
  }
  # Block S = 2, L = 4, segments of 1 layer (2 sublayers, one block each).
  # Segment 0: Phase 1 reads slot 0, writes 2 o's; sublayer 0: Phase 2 reads o (no
  # local slot), writes h; write reads f, writes the slot. Sublayer 1: Phase 2 reads
  # o + the partial, writes h; write reads f and the partial, writes it.
  # Segment 1: the same with 2 completed slots. Final read: 3 slots, writes h.
  reads = (1 + 1 + 1 + 2 + 2) + (2 + 1 + 1 + 2 + 2) + 3
  writes = (2 + 1 + 1 + 1 + 1) + (2 + 1 + 1 + 1 + 1) + 1
  got = io(residual='block', block_size=2)
  assert got['read'] == reads / 4 and got['write'] == writes / 4
  # One-shot Full (the reference read): sublayer l reads its l + 1 slots, then f;
  # the final read 5.
  full = residuals.make(ar.model_config(num_layers=2, residual='full'))
  read, write = dataclasses.replace(full, one_shot=True).io_per_sublayer()
  assert read == (sum(l + 1 + 1 for l in range(4)) + 5) / 4
  assert write == (2 * 4 + 1) / 4
