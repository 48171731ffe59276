"""Ahead-of-time TPU cost table: residual modes x model sizes x topologies, compiled on
this host with libtpu (attnres_jax/compile_report/aot.py). Per row: the train step's
estimated time (the compiler's roofline, loops counted) and its ratio to the standard
step's, the ratio of the compiler's per-kernel cycles summed with loops counted ("cyc
x"; they leave out Pallas kernels, which "+kern" adds at the program's own cycles per
roofline second: `step_summary.cycles_with_kernels`), MFU, HBM per device ("HBM GiB":
what must fit, the compiler's peak and the code, `training/step.py`'s
`compiled_memory_need`), temp memory / the standard's, the compiler's peak memory / the
standard's ("peak": `peak_memory_in_bytes`, what must fit; temp grows with the number
of loops beyond what is live at once, docs/results.md), bytes accessed, extra bytes
over the standard's, that extra / the residual's floor
(`Residual.min_extra_per_sublayer`, docs/method.md), collective bytes, and the bytes
that cross HBM (`hlo_hbm`: on-chip operands and prefetch copies' on-chip side left out,
which "bytes accessed" counts) with their extra over the standard's / the floor (the
floor's own measure), the ratio of their roofline to the standard's, and the estimate's
ratio to the standard whose scan holds as many layers per body ("vs std@G", where this
invocation compiled it: `standard@G` in --modes; a control for the loop structure,
which alone moves the estimate; docs/results.md).

  JAX_PLATFORMS=cpu python bench/aot.py --modes=standard,full --sizes=125m \\
      --topologies=v5p-8 --out=bench/results/aot.json
  JAX_PLATFORMS=cpu python bench/aot.py --modes=standard,block:4,block:8,full \\
      --sizes=d1024 --mesh=data --out=bench/results/aot_depth_core.json
  JAX_PLATFORMS=cpu python bench/aot.py --sizes=125m --seq_len=4096 --per_chip=4 \\
      --attention=xla --remat=minimal   # attention and remat as a user sets them

A row that does not fit says so (the compiler's HBM figures). Each compile runs in
this process one after another; big sizes take minutes and several GB of host memory.
"""

import argparse
import json
import os
import time

from attnres_jax import config as config_lib
from attnres_jax import modes
from attnres_jax import residuals
from attnres_jax.compile_report import aot

from configs import default as default_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The model fields SIZE_FIELDS, then seq_len and sequences per chip. 1B and 8B keep only
# each layer's input (remat='layer'): without, 1B needs 152 GB a v5p chip
# (bench/results/aot_1b_v5p64_remat_none.json).
SIZE_FIELDS = ('d_model', 'num_layers', 'num_heads', 'mlp_dim', 'remat')
SIZES = {
  '125m': (768, 12, 12, 2048, 'none', 2048, 8),
  '1b': (2048, 18, 16, 5632, 'layer', 4096, 4),
  'd1024': (1024, 8, 8, 4096, 'none', 1024, 8),  # the depth core's (docs/results.md)
  'd2048': (2048, 16, 16, 8192, 'none', 1024, 8),  # the depth core's, wider and deeper
  'd1024x32': (1024, 32, 8, 4096, 'none', 1024, 8),  # the depth core's, 32 layers deep
  '8b': (4096, 32, 32, 14336, 'layer', 8192, 1),
}
TOPOLOGIES = {
  'v5p-8': 'v5p:2x2x1',
  'v5p-64': 'v5p:4x4x2',
  'v5p-256': 'v5p:4x8x4',
  'v6e-256': 'v6e:16x16',
  'v5e-4': 'v5e:2x2',
}


MESHES = {'fsdp': (1, -1, 1), 'data': (-1, 1, 1)}  # mesh.shape (data, fsdp, tensor)


def row_config(
  mode: str,
  size: str,
  chips: int,
  mesh: str = 'fsdp',
  *,
  attention: str = 'auto',
  remat: str | None = None,
  seq_len: int | None = None,
  per_chip: int | None = None,
):
  """The row's config: the size's fields, `remat`, `seq_len` and `per_chip`
  (sequences per chip) where given instead of the size's."""
  *model_values, size_seq_len, size_per_chip = SIZES[size]
  fields = dict(zip(SIZE_FIELDS, model_values))
  fields.update(attention=attention, **({'remat': remat} if remat else {}))
  config = default_config.get_config()
  config.model.update(vocab_size=32768, dtype='bfloat16', **fields, **modes.fields(mode))
  config.train.update(
    seq_len=seq_len or size_seq_len, batch_size=(per_chip or size_per_chip) * chips
  )
  config.mesh.shape = MESHES[mesh]  # over every chip
  return config


def segment_layers(config) -> int:
  """Layers in the body of the scan over the row's layers (its residual's segments)."""
  model_cfg = config_lib.ModelConfig.from_config(config.model)
  return residuals.make(model_cfg).segment_layers


HEADER = (
  f'{"mode":<12}{"size":<6}{"topology":<9}{"est. ms":>9}{"vs std":>7}{"cyc x":>7}'
  f'{"+kern":>7}{"MFU":>6}{"HBM GiB":>9}{"temp":>7}{"peak":>7}{"GB acc.":>9}'
  f'{"extra":>7}{"/min":>6}{"coll. GB":>9}{"HBM GB":>8}{"/min":>6}{"x std":>7}'
  f'{"vs std@G":>9}{"compile s":>10}  note'
)


def parse_args(argv=None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--modes', default='standard', help=modes.SYNTAX)
  parser.add_argument('--sizes', default='125m', help=f'of {",".join(SIZES)}')
  parser.add_argument('--topologies', default='v5p-8', help=f'of {",".join(TOPOLOGIES)}')
  parser.add_argument('--mesh', default='fsdp', choices=sorted(MESHES))
  parser.add_argument('--attention', default='auto', help='model.attention of every row')
  parser.add_argument('--remat', default=None, help="model.remat (default: the size's)")
  parser.add_argument('--seq_len', type=int, default=None, help="default: the size's")
  parser.add_argument(
    '--per_chip', type=int, default=None, help="sequences per chip (default: the size's)"
  )
  parser.add_argument('--out', default=None, help='JSON file for the rows.')
  parser.add_argument(
    '--hlo_dir',
    default=None,
    help="Also write each row's optimized HLO to <dir>/<mode>_<size>_<topology>/ "
    "('/' in a mode written '+').",
  )
  args = parser.parse_args(argv)
  try:
    modes.parse_list(args.modes)
  except ValueError as e:
    parser.error(f'--modes: {e}')
  for flag, value, known in (
    ('sizes', args.sizes, SIZES),
    ('topologies', args.topologies, TOPOLOGIES),
  ):
    unknown = sorted(set(value.split(',')) - set(known))
    if unknown:
      parser.error(f'--{flag}: unknown {unknown}; known: {",".join(known)}')
  return args


def compile_row(args, mode: str, size: str, topo_label: str, baselines: dict) -> dict:
  """One row: the train step of `mode` at `size` compiled for the topology (or the
  error that stopped it), with its extra bytes over the floor against the standard
  of `baselines` ({'standard': its step, 'by_segment': {segment layers: the standard
  compiled with as many}}), which a standard row updates."""
  topology = TOPOLOGIES[topo_label]
  chips = aot.get_topology(topology).num_chips
  config = row_config(
    mode,
    size,
    chips,
    args.mesh,
    attention=args.attention,
    remat=args.remat,
    seq_len=args.seq_len,
    per_chip=args.per_chip,
  )
  start = time.perf_counter()
  row = dict(
    mode=mode,
    size=size,
    topology=topo_label,
    topology_name=topology,
    seq_len=config.train.seq_len,
    batch_size=config.train.batch_size,
    attention=config.model.attention,
    remat=config.model.remat,
  )
  try:
    hlo_dir = args.hlo_dir and os.path.join(
      args.hlo_dir, f'{mode.replace("/", "+")}_{size}_{topo_label}'
    )
    step = aot.compile_report(config, topology, steps=('train',), hlo_dir=hlo_dir)[
      'steps'
    ]['train']
  except ValueError as e:
    row['error'] = str(e)
  else:
    row.update(step, segment_layers=segment_layers(config))
    if config.model.residual == 'standard':
      baselines['by_segment'].setdefault(row['segment_layers'], step)
    standard = baselines['standard']
    if mode == 'standard':
      baselines['standard'] = step
    elif standard is not None:
      row['extra_over_floor'] = aot.extra_over_floor(step, standard)
      row['extra_hbm_over_floor'] = aot.extra_over_floor(step, standard, key='hbm_bytes')
  row['wall_seconds'] = time.perf_counter() - start
  return row


def row_line(row: dict, baselines: dict) -> str:
  """The table's line of a row, its ratios against the standard of `baselines`."""
  mode, size, topo_label = row['mode'], row['size'], row['topology']
  if 'error' in row:
    return f'{mode:<12}{size:<6}{topo_label:<9}  does not fit: {row["error"][:120]}'
  standard = baselines['standard']
  coll = sum(v['bytes'] for v in row['collectives'].values()) / 1e9
  nan = float('nan')
  ratio = lambda key, s=standard: row[key] / s[key] if s else nan
  memory_ratio = lambda key: (
    row['memory'][key] / standard['memory'][key]
    if standard and row['memory'].get(key) and standard['memory'].get(key)
    else nan
  )
  floor, hbm_floor = row.get('extra_over_floor'), row.get('extra_hbm_over_floor')
  times = lambda x: '-' if x is None else f'{x:.1f}'
  same_loops = baselines['by_segment'].get(row['segment_layers'])
  return (
    f'{mode:<12}{size:<6}{topo_label:<9}{row["est_step_seconds"] * 1e3:>9.1f}'
    f'{ratio("est_step_seconds"):>7.2f}'
    f'{ratio("compiler_cycles_loops_counted"):>7.3f}'
    f'{ratio("compiler_cycles_with_kernels"):>7.3f}{row["est_mfu"]:>6.0%}'
    f'{row["memory"]["need_bytes"] / aot.GIB:>9.1f}{memory_ratio("temp_bytes"):>7.2f}'
    f'{memory_ratio("peak_bytes"):>7.2f}'
    f'{row["bytes_accessed"] / 1e9:>9.1f}{ratio("bytes_accessed") - 1:>+7.0%}'
    f'{times(floor):>6}{coll:>9.2f}'
    f'{row["hbm_bytes"] / 1e9:>8.1f}{times(hbm_floor):>6}'
    f'{ratio("hbm_roofline_seconds"):>7.2f}'
    f'{ratio("est_step_seconds", same_loops):>9.2f}'
    f'{row["compile_seconds"]:>10.0f}  '
    + ('est.: roofline (compiler <= 0); ' if row.get('est_source') == 'roofline' else '')
    + 'time: '
    + ', '.join(f'{k} {v:.0%}' for k, v in row['time_shares'].items())
  )


def main(argv=None):
  args = parse_args(argv)
  rows = []
  print(HEADER)
  for topo_label in args.topologies.split(','):
    for size in args.sizes.split(','):
      baselines = {'standard': None, 'by_segment': {}}  # those compiled here
      for mode in args.modes.split(','):
        row = compile_row(args, mode, size, topo_label, baselines)
        rows.append(row)
        if args.out:  # after every row: a long table interrupted keeps what it ran
          with open(args.out, 'w', encoding='utf-8') as f:
            json.dump(rows, f, indent=1, default=str)
        print(row_line(row, baselines), flush=True)
  if args.out:
    print(f'Wrote {args.out}.')


if __name__ == '__main__':
  main()
