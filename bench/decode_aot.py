"""Decode traffic on the TPU compiler: the one-token step of Standard, Full and Block
AttnRes compiled ahead-of-time for a TPU topology on this host (libtpu), per token.

  JAX_PLATFORMS=cpu python bench/decode_aot.py        # the grid of docs/inference.md
  JAX_PLATFORMS=cpu python bench/decode_aot.py --batches=8 --contexts=1024 \\
      --weights_dtypes=bfloat16 --out=/tmp/decode_aot.json

The model is the depth-core shape (d_model 1024, 8 layers, 8 heads of 128, MLP 4096, vocab
32768, bf16 compute), data parallel over the topology's chips; the step is
`sampling`'s, with a cache of `--contexts` slots and the weights served as they are
(float32) or cast for serving (`sampling.serving_state`). Per row:

  XLA GB      the compiler's "bytes accessed" (every operand and result, on-chip too)
  est. us     the compiler's time estimate (its roofline over those bytes)
  async GB    the share of async copies (copy-start) in our count (`hlo_cost`)
  HBM GB      the bytes that cross HBM: operands and results that the compiler placed
              in on-chip memory (memory space S(1), the layout's `S(1)`) do not count;
              an async copy into on-chip memory counts its read from HBM
  HBM us      a roofline over the HBM bytes (per kernel the larger of FLOPs / peak and
              HBM bytes / bandwidth)

and each ratio to the standard model of the same batch, context and weights. Each
compile takes about a minute on 2 cores.
"""

import argparse
import json
import os
import time


from attnres_jax import config as config_lib
from attnres_jax import modes as modes_lib
from attnres_jax.compile_report import aot
from attnres_jax.compile_report import decode_lowering
from attnres_jax.compile_report import hlo_cost
from attnres_jax.compile_report import hlo_hbm
from attnres_jax.inference import sampling
from attnres_jax.nn import sharding

from configs import default as default_config

MODEL = dict(
  vocab_size=32768,
  dtype='bfloat16',
  d_model=1024,
  num_layers=8,
  num_heads=8,
  mlp_dim=4096,
  remat='none',
)


def row_config(mode: str, batch: int, context: int):
  config = default_config.get_config()
  config.model.update(**MODEL, **modes_lib.fields(mode))
  config.train.update(seq_len=context, batch_size=batch)
  config.mesh.shape = (-1, 1, 1)  # data parallel over every chip
  return config


def measure(mode, batch, context, weights_dtype, topo, dump_dir=None):
  config = row_config(mode, batch, context)
  config_lib.validate(config, num_devices=len(topo.devices))
  start = time.perf_counter()
  mesh = sharding.make_mesh(config.mesh, devices=topo.devices)
  rules = sharding.rules_from_config(config.mesh)
  lowered = decode_lowering.decode_lowered(config, mesh, rules, weights_dtype)
  compiled = lowered.compile()
  seconds = time.perf_counter() - start
  text = compiled.as_text()
  if dump_dir:  # the optimized HLO, to diff two modes
    os.makedirs(dump_dir, exist_ok=True)
    name = f'{mode}_b{batch}_c{context}_{weights_dtype or "float32"}.hlo'
    with open(os.path.join(dump_dir, name), 'w', encoding='utf-8') as f:
      f.write(text)
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  bandwidth = topo.chip.hbm_bandwidth / topo.devices_per_chip
  ours = hlo_cost.analyze(text, topo.device_peak_flops, bandwidth)
  hbm = hlo_hbm.hbm_costs(text, topo.device_peak_flops, bandwidth)
  return dict(
    mode=mode,
    batch=batch,
    context=context,
    weights_dtype=weights_dtype or 'float32',
    xla_bytes=float(cost.get('bytes accessed', 0.0)),
    est_seconds=float(cost.get('optimal_seconds', 0.0)),
    bytes=ours['bytes'],
    async_copy_bytes=ours['bytes_async_copies'],
    hbm_bytes=hbm['hbm_bytes'],
    hbm_seconds=hbm['hbm_seconds'],
    temp_bytes=compiled.memory_analysis().temp_size_in_bytes,
    compile_seconds=seconds,
  )


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--topology', default='v5p:2x2x1', help=aot.TOPOLOGY_FORM)
  parser.add_argument('--modes', default='standard,full,block:4', help=modes_lib.SYNTAX)
  parser.add_argument('--batches', default='8,64', help='Sequences (all chips).')
  parser.add_argument('--contexts', default='1024,2048', help='KV cache slots.')
  parser.add_argument(
    '--weights_dtypes',
    default='float32,bfloat16',
    help='float32: the parameters as trained; bfloat16: cast for serving.',
  )
  parser.add_argument('--out', default='bench/results/decode_aot.json', help='JSON.')
  parser.add_argument('--dump_hlo', default=None, help='Folder for the optimized HLO.')
  args = parser.parse_args(argv)
  try:
    modes = modes_lib.parse_list(args.modes)
  except ValueError as e:
    parser.error(f'--modes: {e}')
  dtypes = [None if d == 'float32' else d for d in args.weights_dtypes.split(',')]
  for d in dtypes:
    sampling._serving_dtype(d)  # pylint: disable=protected-access
  topo = aot.get_topology(args.topology)
  print(
    f'{args.topology}: {topo.num_chips} chips, data parallel; per device and token.\n'
    f'{"mode":<9}{"batch":>6}{"ctx":>6}{"weights":>9}{"XLA GB":>8}{"est. us":>9}'
    f'{"x std":>7}{"async GB":>9}{"HBM GB":>8}{"HBM us":>8}{"x std":>7}'
  )
  rows, base = [], {}
  for weights_dtype in dtypes:
    for batch in (int(b) for b in args.batches.split(',')):
      for context in (int(c) for c in args.contexts.split(',')):
        for mode in modes:
          row = measure(mode, batch, context, weights_dtype, topo, args.dump_hlo)
          key = (batch, context, row['weights_dtype'])
          if mode == 'standard':
            base[key] = row
          std = base.get(key)
          if std is not None:
            row['est_vs_standard'] = row['est_seconds'] / std['est_seconds']
            row['hbm_vs_standard'] = row['hbm_bytes'] / std['hbm_bytes']
            row['hbm_seconds_vs_standard'] = row['hbm_seconds'] / std['hbm_seconds']
          rows.append(row)
          print(
            f'{mode:<9}{batch:>6}{context:>6}{row["weights_dtype"][:8]:>9}'
            f'{row["xla_bytes"] / 1e9:>8.3f}{row["est_seconds"] * 1e6:>9.1f}'
            f'{row.get("est_vs_standard", float("nan")):>7.3f}'
            f'{row["async_copy_bytes"] / 1e9:>9.3f}{row["hbm_bytes"] / 1e9:>8.3f}'
            f'{row["hbm_seconds"] * 1e6:>8.1f}'
            f'{row.get("hbm_seconds_vs_standard", float("nan")):>7.3f}',
            flush=True,
          )
          if args.out:  # after every row: an interrupted grid keeps what it ran
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
            with open(args.out, 'w', encoding='utf-8') as f:
              json.dump(rows, f, indent=1)
  if args.out:
    print(f'Wrote {args.out}.')


if __name__ == '__main__':
  main()
