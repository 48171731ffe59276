"""Two compiled programs side by side in the TPU compiler's own cost (its per-kernel
cycles, loops counted; attnres_jax/compile_report/hlo_diff.py): the groups of kernels
whose cycles differ most, and the other program's costliest kernels. Takes the
optimized HLO that `bench/aot.py --hlo_dir` writes, e.g.

  JAX_PLATFORMS=cpu python bench/aot.py --sizes=d1024 --mesh=data \\
      --modes=standard,block:4/bf16/pallas --hlo_dir=/tmp/hlo --out=/tmp/aot.json
  python bench/hlo_diff.py --base=/tmp/hlo/standard_d1024_v5p-8/train.hlo.txt \\
      --other=/tmp/hlo/block:4+bf16+pallas_d1024_v5p-8/train.hlo.txt --out=/tmp/diff.json

Per group (forward / backward, kind, op): the compiler's cycles in each program, their
difference, the difference of our byte-or-FLOP roofline (ms at v5p's figures), and the
bytes that cross HBM in each (`hlo_hbm`; a Pallas kernel's from its CostEstimate,
which the cycles leave out). `--by=hbm_bytes` orders the groups by those bytes.
"""

import argparse
import json

from attnres_jax.compile_report import hlo_diff
from attnres_jax.compile_report import tpu_topology

V5P = tpu_topology.CHIPS['TPU v5']


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--base', required=True, help='Optimized HLO text (the reference).')
  parser.add_argument('--other', required=True, help='Optimized HLO text to compare.')
  parser.add_argument('--top', type=int, default=25, help='Groups and kernels shown.')
  parser.add_argument(
    '--by',
    choices=('cycles', 'hbm_bytes'),
    default='cycles',
    help='Groups ordered by their difference in cycles or in bytes that cross HBM.',
  )
  parser.add_argument('--out', help='JSON file for the rows.')
  args = parser.parse_args(argv)
  programs = {}
  for role in ('base', 'other'):
    with open(getattr(args, role)) as f:
      programs[role] = hlo_diff.kernels(f.read(), V5P.peak_flops, V5P.hbm_bandwidth)
  base_cycles, other_cycles = map(hlo_diff.total_cycles, programs.values())
  if not base_cycles:
    parser.error(f'{args.base} carries no estimated_cycles: not a TPU compile?')
  rows = hlo_diff.diff(programs['base'], programs['other'], by=args.by)
  print(
    f'cycles, loops counted: base {base_cycles:.4g}, other {other_cycles:.4g} '
    f'({other_cycles / base_cycles:.4f}x)\n'
  )
  print(
    f'{"delta Mcyc":>10} {"base":>8} {"other":>8} {"d roof ms":>9} '
    f'{"d HBM GB":>8} {"base":>7} {"other":>7}  group'
  )
  for row in rows[: args.top]:
    print(
      f'{row["delta_cycles"] / 1e6:+10.3f} {row["base_cycles"] / 1e6:8.3f} '
      f'{row["other_cycles"] / 1e6:8.3f} {row["delta_roofline_seconds"] * 1e3:+9.3f} '
      f'{row["delta_hbm_bytes"] / 1e9:+8.2f} {row["base_hbm_bytes"] / 1e9:7.2f} '
      f'{row["other_hbm_bytes"] / 1e9:7.2f}  {row["direction"]} {row["kind"]} '
      f'{row["what"]}'
    )
  print(f"\nThe other program's {args.top} costliest kernels (Mcycles, loops counted):")
  costliest = hlo_diff.costliest(programs['other'], args.top)
  for kernel in costliest:
    print(
      f'{kernel.times * kernel.cycles / 1e6:8.3f} x{kernel.times:<4.0f} '
      f'{kernel.direction} {kernel.kind:12s} {kernel.name:40s} {kernel.type_str[:60]}'
    )
  if args.out:
    with open(args.out, 'w') as f:
      json.dump(
        dict(
          base=args.base,
          other=args.other,
          base_cycles=base_cycles,
          other_cycles=other_cycles,
          groups=rows,
          costliest=[k._asdict() | dict(direction=k.direction) for k in costliest],
        ),
        f,
        indent=1,
      )
    print(f'Wrote {args.out}.')


if __name__ == '__main__':
  main()
