"""The residuals' memory I/O per token and sublayer next to the papers' formulas, row
by row: the paper's count evaluated at the row's own N, S or m, this implementation's
count itemised, and what XLA's compiled forward pass moved (measured).

  python bench/io_table.py        # reads bench/results/residual_io.json

The rows and their HLO-measured totals come from `python bench/memory.py --io ...`
(bench/results/residual_io.json, which also holds the counted totals of
`attnres_jax.flops.residual_io_per_sublayer`). This script itemises that count and
checks that the items add up to it. Units: d elements per token, averaged over the L
sublayers, forward pass. Writes bench/results/io_table.json and io_table.md.

The papers' formulas (L sublayers, N blocks of S sublayers, m streams):
  standard           3d: read h and f(h), write h'
  Block AttnRes      (N/S + 5)d (AttnRes paper, Table 1)
  HC / mHC unfused   (5m + 1)d read + (3m + 1)d write = (8m + 2)d: the mHC paper's count
                     of its unfused formulation, 34d at m = 4 (the AttnRes paper's entry)
  mHC fused          (m + 1)d read + (3m + 1)d write = (4m + 2)d: the mHC paper's fused
                     kernels (its section 4.3.1, as we read it), 18d at m = 4
  Full AttnRes       none: we have no formula from the paper
"""

from __future__ import annotations

import json
import os

from absl import app, flags

from attnres_jax import config as config_lib
from attnres_jax import flops
from attnres_jax import modes
from attnres_jax import residuals
from attnres_jax.residuals.attnres import depth

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

FLAGS = flags.FLAGS
flags.DEFINE_string(
  'residual_io_json',
  os.path.join(REPO, 'bench', 'results', 'residual_io.json'),
  'Rows and HLO totals (bench/memory.py --io).',
)
# Names unique among the bench scripts: tests import several into one process.
flags.DEFINE_string(
  'io_table_out', os.path.join(REPO, 'bench', 'results'), 'Output directory.'
)


def model_config(mode: str, num_layers: int):
  """A residual mode (attnres_jax.modes: 'standard', 'block:4', 'mhc', ...) at
  `num_layers` layers of a small width (the counts are per d, so any width serves)."""
  return config_lib.ModelConfig(
    num_layers=num_layers, d_model=64, num_heads=1, mlp_dim=128, **modes.fields(mode)
  )


ITEMS = {  # item key: what it counts (d elements per token and sublayer)
  'update': "standard: read h and f(h), write h'",
  'read': 'HC/mHC read: read the m streams, write h',
  'write': 'HC/mHC write: read the m streams and f(h), write the m streams',
  'phase1_read': 'AttnRes Phase 1: read the blocks completed before the segment '
  '(once per segment, amortised)',
  'phase1_write': 'AttnRes Phase 1: write one partial output per query',
  'phase2': 'AttnRes Phase 2: read the partial output, write h',
  'partial_read_phase2': 'AttnRes Phase 2: read the running partial sum(s) of the '
  'segment',
  'partial_update': 'AttnRes write: read f(h), write the partial sum',
  'partial_read_update': 'AttnRes write: read the partial sum it adds to (again)',
  'final': 'the final read (once per model, amortised)',
}


def itemised_io(cfg) -> dict[str, float]:
  """This implementation's counted residual I/O, item by item (keys of ITEMS), per
  sublayer in d units; the items add up to `flops.residual_io_per_sublayer`."""
  num_sublayers = config_lib.num_sublayers(cfg)
  per = lambda x: x / num_sublayers
  if cfg.residual == 'standard':
    return {'update': 3.0}
  if cfg.residual in ('hc', 'mhc'):
    m = cfg.hc_streams
    return {'read': m + 1.0, 'write': 2.0 * m + 1, 'final': per(m + 1)}
  residual = residuals.make(cfg)
  size, sublayers_per_segment = residual.block_size, 2 * residual.segment_layers
  phase1_read = local_read = adds = 0
  for l in range(num_sublayers):
    segment, j = divmod(l, sublayers_per_segment)
    if j == 0:  # Phase 1 reads the slots completed before the segment
      phase1_read += 1 + segment * (sublayers_per_segment // size)
    local_read += j // size + (1 if j % size else 0)  # this segment's slots so far
    adds += l % size != 0  # the slot already holds a partial sum
  slots = depth.num_slots(num_sublayers, size)
  return {
    'phase1_read': per(phase1_read),
    'phase1_write': 1.0,
    'phase2': 2.0,
    'partial_read_phase2': per(local_read),
    'partial_update': 2.0,
    'partial_read_update': per(adds),
    'final': per(slots + 1),
  }


def paper_formula(cfg) -> list[tuple[str, float]]:
  """[(formula with the row's values, value in d)] of the papers' counts."""
  num_sublayers = config_lib.num_sublayers(cfg)
  if cfg.residual == 'standard':
    return [('3d', 3.0)]
  if cfg.residual == 'block':
    size = cfg.block_size
    blocks = -(-num_sublayers // size)
    return [(f'(N/S + 5)d, N = {blocks}, S = {size}', blocks / size + 5)]
  if cfg.residual in ('hc', 'mhc'):
    m = cfg.hc_streams
    return [
      (f'unfused (8m + 2)d, m = {m}', 8.0 * m + 2),
      (f'fused (4m + 2)d, m = {m}', 4.0 * m + 2),
    ]
  return []  # Full AttnRes: we have no formula from the paper


def main(argv):
  del argv
  os.makedirs(FLAGS.io_table_out, exist_ok=True)
  with open(FLAGS.residual_io_json, encoding='utf-8') as f:
    measured = json.load(f)
  rows, lines = (
    [],
    [
      '| residual | L | paper: formula at this row | paper | counted | counted items '
      '| HLO-measured |',
      '|---|---|---|---|---|---|---|',
    ],
  )
  for record in measured:
    cfg = model_config(record['mode'], record['num_layers'])
    items = itemised_io(cfg)
    counted = flops.residual_io_per_sublayer(cfg)['total']
    if abs(sum(items.values()) - counted) > 1e-9:  # two countings of the same model
      raise AssertionError(f'{record["mode"]}: items {sum(items.values())} != {counted}')
    paper = paper_formula(cfg)
    rows.append(
      dict(
        mode=record['mode'],
        num_layers=record['num_layers'],
        num_sublayers=config_lib.num_sublayers(cfg),
        counted_total=counted,
        counted_items=items,
        hlo_total=record['hlo_total'],
        paper=[dict(formula=f, value=v) for f, v in paper],
        hlo_shape=dict(
          d_model=record['d_model'],
          seq_len=record['seq_len'],
          batch_size=record['batch_size'],
          backend=record['backend'],
        ),
      )
    )
    lines.append(
      f'| {record["mode"]} | {config_lib.num_sublayers(cfg)} | '
      f'{"; ".join(f for f, _ in paper) or "-"} | '
      f'{" / ".join(f"{v:.3g}d" for _, v in paper) or "-"} | {counted:.4g}d | '
      f'{", ".join(f"{k} {v:.4g}" for k, v in items.items())} | '
      f'{record["hlo_total"]:.3g}d |'
    )
  lines += ['', 'Items: ' + '; '.join(f'{k}: {v}' for k, v in ITEMS.items()) + '.']
  table = '\n'.join(lines)
  with open(
    os.path.join(FLAGS.io_table_out, 'io_table.json'), 'w', encoding='utf-8'
  ) as f:
    json.dump(dict(items=ITEMS, rows=rows), f, indent=1)
  with open(os.path.join(FLAGS.io_table_out, 'io_table.md'), 'w', encoding='utf-8') as f:
    f.write(table + '\n')
  print(table)


if __name__ == '__main__':
  app.run(main)
