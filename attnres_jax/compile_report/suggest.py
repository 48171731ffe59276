"""`train.py --compile_only --topology=... --suggest`: the remat policy and per-chip
batch to run, chosen from a small grid compiled for the topology.

The train step of every (remat policy in `POLICIES`) x (the config's sequences per
chip times `BATCH_FACTORS`) is compiled (`aot.compile_report`); of those that fit the
chip's HBM, the one with the highest estimated MFU (the estimated step's time per
token, the attention kernel's analytic cost included) is printed as the flags to
pass. Then that point is compiled on the other whole-mesh layouts of `MESH_SHAPES`
(data parallel, FSDP), and one that fits with a higher estimate wins: the layout can
matter more than the policy (the 1B step on v5p-64: 1237.5 ms on FSDP, where XLA
splits every weight matmul into windowed loops of collective permutes, 386.9 ms data
parallel). The estimate is an instrument with an error of a few percent (loop
structure alone moves it): a close second is worth a real run.
"""

from __future__ import annotations

import sys
from typing import Any

from attnres_jax.compile_report import aot
from attnres_jax.compile_report.tpu_topology import GIB

POLICIES = ('none', 'minimal', 'sublayer', 'layer')
BATCH_FACTORS = (0.5, 1, 2)  # sequences per chip, times the config's
# mesh.shape (data, fsdp, tensor) of the layouts tried at the grid's best point.
MESH_SHAPES = ((-1, 1, 1), (1, -1, 1))


def grid(config, num_chips: int) -> list[tuple[str, int]]:
  """(remat policy, global batch size) pairs: the config's per-chip batch (at least
  one sequence a chip) scaled by `BATCH_FACTORS`, whole sequences only."""
  per_chip = max(1, config.train.batch_size // num_chips)
  sizes = sorted({int(per_chip * f) for f in BATCH_FACTORS if per_chip * f >= 1})
  return [(policy, size * num_chips) for policy in POLICIES for size in sizes]


def run_grid(config, topology: str, num_slices: int = 1, out=sys.stderr) -> dict:
  """Compiles the grid's train steps; {'rows': one per point, 'best': the row with the
  highest estimated MFU among those that fit, or None}."""
  num_chips = aot.get_topology(topology, num_slices).num_chips

  def compile_point(policy: str, batch_size: int, mesh_shape=None) -> dict[str, Any]:
    candidate = config.copy_and_resolve_references()
    candidate.model.remat = policy
    candidate.train.batch_size = batch_size
    row: dict[str, Any] = dict(remat=policy, batch_size=batch_size)
    if mesh_shape is not None:
      candidate.mesh.shape = row['mesh_shape'] = tuple(mesh_shape)
    try:
      step = aot.compile_report(candidate, topology, num_slices, steps=('train',))
    except ValueError as e:
      row['error'] = str(e).splitlines()[0]
    else:
      train = step['steps']['train']
      row.update(
        need_bytes=train['memory']['need_bytes'],
        est_step_seconds=train['est_step_seconds'],
        est_mfu=train['est_mfu'],
      )
    print(row_line(row, batch_size // num_chips), file=out, flush=True)
    return row

  rows = [compile_point(*point) for point in grid(config, num_chips)]
  best = best_row(rows)
  if best is not None and config.mesh.stage == 1:  # the layouts, at the best point
    for shape in MESH_SHAPES:
      if tuple(shape) != tuple(config.mesh.shape):
        rows.append(compile_point(best['remat'], best['batch_size'], shape))
  return {'rows': rows, 'best': best_row(rows)}


def best_row(rows: list[dict]) -> dict | None:
  """The fitting row of the highest estimated MFU, or None."""
  fitting = [r for r in rows if 'error' not in r and r['est_mfu'] is not None]
  return max(fitting, key=lambda r: r['est_mfu']) if fitting else None


def row_line(row: dict, per_chip: int) -> str:
  head = f'remat={row["remat"]:<9} {per_chip:>4} seq/chip'
  if 'mesh_shape' in row:
    head += f' mesh.shape={row["mesh_shape"]}'
  if 'error' in row:
    return f'{head}  does not fit: {row["error"][:100]}'
  return (
    f'{head}  {row["need_bytes"] / GIB:>7.2f} GiB  {row["est_step_seconds"] * 1e3:>9.2f}'
    f' ms  MFU {row["est_mfu"]:.0%}'
  )


def flags(best: dict) -> str:
  text = (
    f'--config.model.remat={best["remat"]} --config.train.batch_size={best["batch_size"]}'
  )
  if 'mesh_shape' in best:
    shape = ','.join(str(n) for n in best['mesh_shape'])
    text += f" --config.mesh.shape='({shape})'"
  return text


def main(config, topology: str | None, num_slices: int) -> int:
  """Prints the grid and the best point's flags (stdout); exit code 1 with one line
  when nothing fits or the input is bad."""
  try:
    if not topology:
      raise aot.AotError(f'--suggest needs --topology, of the form {aot.TOPOLOGY_FORM}.')
    result = run_grid(config, topology, num_slices)
  except (aot.AotError, ValueError) as e:
    print(f'FATAL: {str(e).splitlines()[0]}', file=sys.stderr)
    return 1
  if result['best'] is None:
    print(f'FATAL: no point of the grid fits {topology}.', file=sys.stderr)
    return 1
  best = result['best']
  print(
    f'Best estimated step that fits {topology}: {best["est_step_seconds"] * 1e3:.2f} ms, '
    f'MFU {best["est_mfu"]:.0%}, {best["need_bytes"] / GIB:.2f} GiB a device. Pass:'
  )
  print(flags(best))
  return 0
