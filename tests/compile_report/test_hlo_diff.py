"""The compiler-cycle diff of two TPU programs (attnres_jax/compile_report/hlo_diff.py,
bench/hlo_diff.py), on tiny programs compiled for v5e:2x2 on this host."""

import importlib.util
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attnres_jax.compile_report import aot
from attnres_jax.compile_report import hlo_diff
from attnres_jax.compile_report import hlo_hbm
from bench import hlo_diff as hlo_diff_cli
from tests.compile_report.v5e_operands import v5e_operands

pytestmark = pytest.mark.skipif(
  importlib.util.find_spec('libtpu') is None,
  reason='libtpu (the TPU compiler) is not installed',
)


def _programs():
  """Two loops over 4 layers that differ by one reduction over the width per layer."""
  x, w = v5e_operands(jnp.float32, (4, 256, 256))

  def program(x, w, normalise):
    def layer(h, w_layer):
      h = jnp.tanh(h @ w_layer)
      if normalise:
        h = h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + 1e-6)
      return h, None

    return jax.lax.scan(layer, x, w)[0]

  return [
    jax.jit(program, static_argnums=2).lower(x, w, flag).compile().as_text()
    for flag in (False, True)
  ]


def test_groups_split_the_difference_loops_counted(tmp_path):
  base_text, other_text = _programs()
  chip = aot.get_topology('v5e:2x2').chip
  base, other = (
    hlo_diff.kernels(text, chip.peak_flops, chip.hbm_bandwidth)
    for text in (base_text, other_text)
  )
  assert hlo_diff.total_cycles(base) > 0
  rows = hlo_diff.diff(base, other)
  # The groups partition every kernel: their differences add up to the totals'.
  np.testing.assert_allclose(
    sum(row['delta_cycles'] for row in rows),
    hlo_diff.total_cycles(other) - hlo_diff.total_cycles(base),
    rtol=1e-9,
  )
  # The loop body runs 4 times: its kernels are counted so.
  assert {k.times for k in other if k.cycles} >= {1.0, 4.0}
  assert all(row['direction'] == 'fwd' for row in rows)  # nothing differentiated
  # What the other program adds (the normalisation's rsqrt) is found, as a group of
  # its own that costs cycles there and none in the base.
  added = {row['what'] for row in rows if row['base_cycles'] == 0 < row['delta_cycles']}
  assert 'fusion:rsqrt' in added
  # The bytes that cross HBM too: the groups' add up to each program's total.
  for role, text in (('base', base_text), ('other', other_text)):
    np.testing.assert_allclose(
      sum(row[f'{role}_hbm_bytes'] for row in rows),
      hlo_hbm.hbm_costs(text)['hbm_bytes'],
      rtol=1e-9,
    )
  by_bytes = [
    abs(row['delta_hbm_bytes']) for row in hlo_diff.diff(base, other, 'hbm_bytes')
  ]
  assert by_bytes == sorted(by_bytes, reverse=True)

  # The command line: the same totals, a table and the JSON.
  paths = [tmp_path / 'base.hlo.txt', tmp_path / 'other.hlo.txt']
  for path, text in zip(paths, (base_text, other_text)):
    path.write_text(text)
  out = tmp_path / 'diff.json'
  hlo_diff_cli.main([f'--base={paths[0]}', f'--other={paths[1]}', f'--out={out}'])
  written = json.loads(out.read_text())
  assert written['other_cycles'] == hlo_diff.total_cycles(other)
  assert len(written['groups']) == len(rows)


def test_a_program_without_cycles_is_refused(tmp_path):
  path = tmp_path / 'cpu.hlo.txt'
  path.write_text(jax.jit(lambda x: x * 2).lower(jnp.ones(4)).compile().as_text())
  with pytest.raises(SystemExit):
    hlo_diff_cli.main([f'--base={path}', f'--other={path}'])
