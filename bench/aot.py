"""Ahead-of-time TPU cost table: residual modes x model sizes x topologies, compiled on
this host with libtpu (attnres_jax/aot.py). Per row: the train step's estimated time
(the compiler's roofline, loops counted), MFU, HBM per device and collective bytes.

  JAX_PLATFORMS=cpu python bench/aot.py --modes=standard,full --sizes=125m \\
      --topologies=v5p-8 --out=bench/results/aot.json

A row that does not fit says so (the compiler's HBM figures). Each compile runs in
this process one after another; big sizes take minutes and several GB of host memory.
"""

import argparse
import json
import os
import time

from attnres_jax import aot

from configs import default as default_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

MODES = {
  'standard': dict(residual='standard'),
  'block4': dict(residual='block', block_size=4),
  'block8': dict(residual='block', block_size=8),
  'full': dict(residual='full'),
  'hc': dict(residual='hc'),
  'mhc': dict(residual='mhc'),
}
# (model fields, seq_len, sequences per chip); FSDP over all chips. 1B and 8B keep only
# each layer's input (remat='layer'): without, 1B needs 152 GB a v5p chip
# (bench/results/aot_1b_v5p64_remat_none.json).
SIZES = {
  '125m': (
    dict(d_model=768, num_layers=12, num_heads=12, mlp_dim=2048, remat='none'),
    2048,
    8,
  ),
  '1b': (
    dict(d_model=2048, num_layers=18, num_heads=16, mlp_dim=5632, remat='layer'),
    4096,
    4,
  ),
  '8b': (
    dict(d_model=4096, num_layers=32, num_heads=32, mlp_dim=14336, remat='layer'),
    8192,
    1,
  ),
}
TOPOLOGIES = {
  'v5p-8': 'v5p:2x2x1',
  'v5p-64': 'v5p:4x4x2',
  'v5p-256': 'v5p:4x8x4',
  'v6e-256': 'v6e:16x16',
  'v5e-4': 'v5e:2x2',
}


def row_config(mode: str, size: str, chips: int):
  fields, seq_len, per_chip = SIZES[size]
  config = default_config.get_config()
  config.model.update(vocab_size=32768, dtype='bfloat16', **fields, **MODES[mode])
  config.train.update(seq_len=seq_len, batch_size=per_chip * chips)
  config.mesh.shape = (1, -1, 1)  # FSDP over every chip
  return config


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--modes', default='standard', help=f'of {",".join(MODES)}')
  parser.add_argument('--sizes', default='125m', help=f'of {",".join(SIZES)}')
  parser.add_argument('--topologies', default='v5p-8', help=f'of {",".join(TOPOLOGIES)}')
  parser.add_argument('--out', default=None, help='JSON file for the rows.')
  args = parser.parse_args(argv)
  rows = []
  print(
    f'{"mode":<9}{"size":<6}{"topology":<9}{"est. ms":>9}{"vs std":>7}{"MFU":>6}'
    f'{"HBM GiB":>9}{"coll. GB":>9}{"compile s":>10}  note'
  )
  for topo_label in args.topologies.split(','):
    topology = TOPOLOGIES[topo_label]
    for size in args.sizes.split(','):
      standard = None
      for mode in args.modes.split(','):
        chips = aot.get_topology(topology).num_chips
        config = row_config(mode, size, chips)
        start = time.perf_counter()
        row = dict(
          mode=mode,
          size=size,
          topology=topo_label,
          topology_name=topology,
          seq_len=config.train.seq_len,
          batch_size=config.train.batch_size,
        )
        try:
          step = aot.compile_report(config, topology, steps=('train',))['steps']['train']
        except ValueError as e:
          row['error'] = str(e)
        else:
          row.update(step)
          if mode == 'standard':
            standard = step['est_step_seconds']
        row['wall_seconds'] = time.perf_counter() - start
        rows.append(row)
        if args.out:  # after every row: a long table interrupted keeps what it ran
          with open(args.out, 'w', encoding='utf-8') as f:
            json.dump(rows, f, indent=1, default=str)
        if 'error' in row:
          print(f'{mode:<9}{size:<6}{topo_label:<9}  does not fit: {row["error"][:120]}')
          continue
        coll = sum(v['bytes'] for v in row['collectives'].values()) / 1e9
        ratio = row['est_step_seconds'] / standard if standard else float('nan')
        print(
          f'{mode:<9}{size:<6}{topo_label:<9}{row["est_step_seconds"] * 1e3:>9.1f}'
          f'{ratio:>7.2f}{row["est_mfu"]:>6.0%}'
          f'{row["memory"]["total_bytes"] / aot.GIB:>9.1f}{coll:>9.2f}'
          f'{row["compile_seconds"]:>10.0f}  time: '
          + ', '.join(f'{k} {v:.0%}' for k, v in row['time_shares'].items()),
          flush=True,
        )
  if args.out:
    print(f'Wrote {args.out}.')


if __name__ == '__main__':
  main()
