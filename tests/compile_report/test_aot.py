"""Ahead-of-time compilation for TPU topologies (compile_report/aot.py, hlo_cost.py)
on a CPU host.

The compiles need libtpu (pinned in requirements.txt); without it only the bad-input
tests run.
"""

import functools
import importlib.util
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attnres_jax.compile_report import aot
from attnres_jax.compile_report import hlo_cost
from attnres_jax.compile_report import hlo_hbm
from attnres_jax.compile_report import step_summary
from attnres_jax.compile_report import tpu_topology
from attnres_jax.nn import sharding
from bench import aot as aot_cli
from configs import default as default_config
from tests.compile_report.v5e_operands import v5e_operands

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
needs_libtpu = pytest.mark.skipif(
  importlib.util.find_spec('libtpu') is None,
  reason='libtpu (the TPU compiler) is not installed',
)
# The loop-counted report of a scanned program against its unrolled twin: the issue's
# bound. The same dots run in both, so FLOPs differ only by the few elementwise ops
# XLA fuses differently around the loop.
COUNT_RTOL = 0.02


def tiny_config(**mesh):
  config = default_config.get_config('tiny')
  config.model.dtype = 'bfloat16'
  config.mesh.update(mesh)
  return config


def test_unknown_topology_names_the_form():
  for name in ('v5e', 'v9x:2x2', 'v5p:2x2x', ''):
    with pytest.raises(aot.AotError, match='the form is .*v5e:2x2'):
      aot.get_topology(name)


def test_missing_libtpu_names_the_fix(monkeypatch):
  real = importlib.util.find_spec
  monkeypatch.setattr(
    importlib.util,
    'find_spec',
    lambda name, *a: None if name == 'libtpu' else real(name, *a),
  )
  with pytest.raises(aot.AotError, match='libtpu.*pip install -r requirements.txt'):
    aot.get_topology('v5e:2x2')


@needs_libtpu
@pytest.mark.skipif(tpu_topology.host_has_tpu(), reason='the probe finds chips here')
def test_backend_start_up_is_quiet_without_tpu_chips():
  # JAX probes the installed libtpu at its first device query; importing the package
  # first describes the absent TPU host, so libtpu's five warning lines never appear,
  # nor JAX's INFO line on the failed TPU start-up.
  env = {
    k: v for k, v in os.environ.items() if not k.startswith(('JAX_PLATFORMS', 'TPU_'))
  }
  # Under absl's app (train.py, eval.py, bench/), which prints JAX's INFO logs, too.
  probe = (
    'from absl import app\n'
    'import attnres_jax, jax\n'
    'app.run(lambda argv: print(jax.default_backend()))\n'
  )
  done = subprocess.run(
    [sys.executable, '-c', probe], env=env, capture_output=True, text=True, timeout=300
  )
  assert done.returncode == 0, done.stderr
  assert done.stdout.strip() == 'cpu'
  assert 'TPU' not in done.stderr and 'tpu' not in done.stderr, done.stderr


@needs_libtpu
def test_libtpu_refusal_names_the_form():
  with pytest.raises(aot.AotError, match='refused.*the form is'):
    aot.get_topology('v5p:3x3x3')  # not a whole number of 2x2x1 hosts


@needs_libtpu
def test_mesh_that_does_not_divide_the_chips_is_refused():
  with pytest.raises(ValueError, match='does not cover the 4 devices'):
    aot.compile_report(tiny_config(shape=(3, 1, 1)), 'v5e:2x2')


@needs_libtpu
def test_cli_bad_input_exits_nonzero_and_writes_nothing(tmp_path):
  workdir = tmp_path / 'run'
  for extra in (['--topology=v5e:3'],):  # the other refusals: tests above
    result = subprocess.run(
      [
        sys.executable,
        os.path.join(ROOT, 'train.py'),
        f'--config={ROOT}/configs/default.py:tiny',
        '--compile_only',
        f'--workdir={workdir}',
        *extra,
      ],
      capture_output=True,
      text=True,
      timeout=300,
      env=dict(os.environ, JAX_PLATFORMS='cpu'),
      check=False,
    )
    assert result.returncode == 1, result.stderr
    assert 'FATAL' in result.stderr and (
      'topology' in result.stderr or 'devices' in result.stderr
    )
    assert not workdir.exists()


def _compile(function, *args):
  return jax.jit(function).lower(*args).compile()


@needs_libtpu
def test_loop_bodies_counted_by_trip_count_nested_loops_too():
  """A scan over 4 layers with a 3-step fori_loop inside each, against the same
  program unrolled: equal FLOPs with loops counted, and equal to XLA's own count."""
  x, w = v5e_operands(jnp.bfloat16, (4, 256, 256))

  def program(x, w, unroll):
    def layer(h, w_layer):
      inner = lambda _, g: jnp.tanh(g @ w_layer)
      return jax.lax.fori_loop(0, 3, inner, h, unroll=unroll), None

    return jax.lax.scan(layer, x, w, unroll=unroll)[0].sum()

  scanned = hlo_cost.analyze(
    _compile(functools.partial(program, unroll=False), x, w).as_text()
  )
  unrolled_compiled = _compile(functools.partial(program, unroll=True), x, w)
  unrolled = hlo_cost.analyze(unrolled_compiled.as_text())
  assert (
    sorted(scanned['while_trip_counts']) == [3, 4] and not unrolled['while_trip_counts']
  )
  dots = 4 * 3 * 2 * 128 * 256 * 256  # per device: 128 of the 512 rows
  assert scanned['flops'] >= dots and scanned['flops_once'] < dots / 4
  np.testing.assert_allclose(scanned['flops'], unrolled['flops'], rtol=COUNT_RTOL)
  # Bytes are counted per loop iteration too, but the two programs move different
  # bytes (scanned, each iteration copies its carry; unrolled, the stacked weights are
  # copied on chip once): 3.60 vs 3.15 MB here, so no equality is claimed
  # (docs/scaling.md).
  assert scanned['bytes'] > 1.5 * scanned['bytes_once']
  # Our count of a loop-free program is XLA's own.
  np.testing.assert_allclose(
    unrolled['flops'], unrolled_compiled.cost_analysis()['flops'], rtol=COUNT_RTOL
  )


@needs_libtpu
def test_a_conditional_counts_the_mean_of_its_branches():
  """A scan of 4 steps whose switch takes a one-matmul branch twice and a
  three-matmul branch twice: each branch weighed 1/2 of its caller gives the 8
  matmuls that run (counting only the first branch, as the HLO parser once did, gave
  4; every branch at full weight, 16). Once, as XLA's totals count: the larger
  branch."""
  x, w = v5e_operands(jnp.bfloat16, (256, 256))
  branches = [
    lambda h, w: jnp.tanh(h @ w),
    lambda h, w: jnp.tanh(jnp.tanh(jnp.tanh(h @ w) @ w) @ w),
  ]

  def program(x, w):
    def step(h, index):
      return jax.lax.switch(index // 2, branches, h, w), None

    return jax.lax.scan(step, x, jnp.arange(4))[0].sum()

  compiled = _compile(program, x, w)
  assert compiled.as_text().count(' conditional(') == 1
  scanned = hlo_cost.analyze(compiled.as_text())
  assert scanned['while_trip_counts'] == [4]
  dots = (2 * 1 + 2 * 3) * 2 * 128 * 256 * 256  # per device: 128 of the 512 rows
  # Besides the dots: a tanh per matmul and the final sum, 0.2% of the FLOPs.
  np.testing.assert_allclose(scanned['flops'], dots, rtol=0.005)
  # Counted once, as XLA counts (the estimate scales the compiler's time by the
  # ratio of the two): the larger branch, 3 matmuls.
  np.testing.assert_allclose(scanned['flops_once'], dots / 8 * 3, rtol=0.005)
  np.testing.assert_allclose(
    scanned['flops_once'], compiled.cost_analysis()['flops'], rtol=COUNT_RTOL
  )


@functools.lru_cache(maxsize=None)
def train_report(shape, stage=1, scan_layers=True, residual='standard'):
  """The train step's report for the tiny model on v5e:2x2 (cached: the FSDP compile
  of the standard model serves three tests)."""
  mesh = dict(shape=shape, stage=stage, num_microbatches=stage)
  config = tiny_config(**mesh)
  config.model.update(residual=residual, scan_layers=scan_layers)
  return aot.compile_report(config, 'v5e:2x2', steps=('train',))


@pytest.mark.parametrize(
  'num_layers, fields, units',
  [
    (8, dict(residual='block', block_size=8), 6.5),  # 6 + 2N/S, N = 2
    (8, dict(residual='block', block_size=4), 8.0),  # N = 4
    (8, dict(residual='full'), 16.0),  # 2(L/Q + Q) + 4/Q - 1, L = 16, Q = 4
    (16, dict(residual='block', block_size=4), 10.0),
    (16, dict(residual='full'), 24.0),
    (3, dict(residual='block', block_size=4), 6 + 2 * 2 / 4),  # N = ceil(6/4)
    (8, dict(residual='standard'), None),
  ],
)
def test_residual_floor_is_the_documented_minimum(num_layers, fields, units):
  """docs/method.md's table: the floor per sublayer in units of d, and in bytes a
  device for 8 x 1024 tokens of d = 1024 in bf16 (one unit 268 MB at 8 layers)."""
  config = default_config.get_config()
  config.model.update(num_layers=num_layers, d_model=1024, dtype='bfloat16', **fields)
  floor = aot.residual_floor(config.model, tokens=4 * 8 * 1024, num_devices=4)
  if units is None:
    assert floor is None
    return
  assert floor['units_per_sublayer'] == pytest.approx(units, rel=1e-12)
  unit_bytes = 1024 * 2 * 8 * 1024 * 2 * num_layers
  assert floor['bytes'] == pytest.approx(units * unit_bytes, rel=1e-12)


@needs_libtpu
def test_report_divides_extra_bytes_by_the_floor():
  """The train step's report carries the residual's floor (none for the standard
  residual: it is the reference), and the columns are (bytes - the standard step's) /
  floor, for the bytes accessed and for those that cross HBM. The standard step is the
  FSDP compile the tests above share; a Block AttnRes step is its figures with the
  floor of the tiny Block model (one compile fewer)."""
  standard = train_report((1, 4, 1))['steps']['train']
  assert standard['residual_floor'] is None
  assert aot.extra_over_floor(standard, standard) is None
  config = tiny_config()
  config.model.update(residual='block', block_size=2)
  floor = aot.residual_floor(config.model, tokens=8 * 32, num_devices=4)
  # tiny: d 32, 2 layers, S = 2 (N = 2: 6 + 2N/S = 8), 8 x 32 tokens, bf16, 4 devices
  assert floor == {'units_per_sublayer': 8.0, 'bytes': 8 * 32 * 2 * (8 * 32) * 4 / 4}
  block = dict(
    standard,
    bytes_accessed=standard['bytes_accessed'] + 3 * floor['bytes'],
    hbm_bytes=standard['hbm_bytes'] + 2 * floor['bytes'],
    residual_floor=floor,
  )
  assert aot.extra_over_floor(block, standard) == pytest.approx(3.0, rel=1e-12)
  hbm = aot.extra_over_floor(block, standard, key='hbm_bytes')
  assert hbm == pytest.approx(2.0, rel=1e-12)


@needs_libtpu
@pytest.mark.parametrize(
  'mesh, kinds',
  [
    (dict(shape=(1, 4, 1)), ('all-gather',)),  # FSDP
    (dict(shape=(1, 2, 2)), ('all-gather', 'all-reduce')),  # FSDP x tensor
    (dict(shape=(2, 1, 1), stage=2), ('collective-permute',)),  # 2 pipeline stages
  ],
  ids=['fsdp', 'tensor', 'stage2'],
)
def test_tiny_model_compiles_for_a_topology(mesh, kinds):
  report = train_report(**mesh)
  step = report['steps']['train']
  assert report['num_devices'] == 4 and step['flops'] > step['model_flops'] / 4 / 2
  for kind in kinds:
    assert (
      step['collectives'][kind]['count'] > 0 and step['collectives'][kind]['bytes'] > 0
    )
  memory = step['memory']
  assert 0 < memory['total_bytes'] < memory['capacity_bytes']
  # What must fit: the TPU compiler's peak (arguments included) and the code. (For a
  # program this small the peak is above the summed figure: temp is 0 here, and the
  # peak counts more than the arguments and temporaries.)
  assert memory['peak_bytes'] > memory['argument_bytes'] - memory['alias_bytes']
  assert memory['need_bytes'] == memory['peak_bytes'] + memory['code_bytes']
  assert step['est_step_seconds'] >= step['xla_seconds_loops_once'] > 0
  assert step['compiler_cycles_loops_counted'] > 0
  assert 'train' in aot.format_table(report)


@needs_libtpu
def test_scanned_step_counts_equal_unrolled_flops():
  """The production train step, scanned layers vs a Python loop over layers."""
  scanned, unrolled = (
    train_report((1, 4, 1), scan_layers=scan)['steps']['train'] for scan in (True, False)
  )
  assert scanned['while_trip_counts'] and not unrolled['while_trip_counts']
  np.testing.assert_allclose(scanned['flops'], unrolled['flops'], rtol=COUNT_RTOL)
  assert scanned['xla_flops_loops_once'] < 0.8 * unrolled['flops']
  # The compiler's cycles, loops counted: the scanned program does the unrolled one's
  # work plus its stacking of per-layer values (456k against 350k cycles here; with
  # its loop body counted once, 288k).
  assert (
    scanned['compiler_cycles_loops_counted'] >= unrolled['compiler_cycles_loops_counted']
  )


@needs_libtpu
def test_config_that_cannot_fit_hbm_is_refused():
  config = tiny_config(shape=(1, 4, 1))
  config.model.update(
    vocab_size=2**24, d_model=256, num_heads=2, mlp_dim=256, dtype='float32'
  )  # 4B embedding parameters, AdamW: > 16 GiB a device
  # The compiler refuses it (else check_memory would, from the compiled figures).
  with pytest.raises(
    ValueError,
    match=r'train step does not fit on v5e:2x2.*required .*'
    r'exceeds available HBM',
  ):
    aot.compile_report(config, 'v5e:2x2', steps=('train',))


@needs_libtpu
def test_two_slices_put_the_data_axis_across_slices():
  topo = aot.get_topology('v5e:2x2', num_slices=2)
  assert len(topo.devices) == 8 and topo.num_chips == 8
  mesh = sharding.make_mesh(tiny_config(shape=(2, 4, 1)).mesh, devices=topo.devices)
  slice_of = np.vectorize(lambda d: d.slice_index)(mesh.devices)[0, :, :, 0]
  np.testing.assert_array_equal(slice_of, [[0] * 4, [1] * 4])  # data: across slices
  with pytest.raises(ValueError, match='multiple of the 2 slices'):
    sharding.make_mesh(tiny_config(shape=(1, 8, 1)).mesh, devices=topo.devices)


# The TPU compiler's shape of a buffer reservation (a scan's stacked outputs) next to a
# custom call that reads and writes its arrays.
_CUSTOM_CALLS_HLO = """
HloModule m

ENTRY %main (p: s32[8,1024]) -> (f32[8,1024,1024], s32[8,1024]) {
  %p = s32[8,1024]{1,0} parameter(0)
  %buffer = f32[8,1024,1024]{2,1,0} custom-call(), custom_call_target="AllocateBuffer"
  %packed = s32[8,1024]{1,0} custom-call(%p), custom_call_target="Bitpack"
  ROOT %t = (f32[8,1024,1024]{2,1,0}, s32[8,1024]{1,0}) tuple(%buffer, %packed)
}
"""


def test_buffer_reservations_move_no_bytes_other_custom_calls_do():
  """AllocateBuffer (32 MiB here) counts nothing; a custom call with data counts its
  operand read and result written (32 KiB each)."""
  costs = hlo_cost.analyze(_CUSTOM_CALLS_HLO)
  assert costs['bytes'] == 2 * 8 * 1024 * 4


# A Pallas TPU kernel as the compiler writes it: a 5-slot buffer (5 x 4 MiB) whose
# kernel states in its CostEstimate that it loads two slots and writes one output.
_PALLAS_HLO = """
HloModule m

ENTRY %main (buf: bf16[5,2048,1024]) -> bf16[2048,1024] {
  %buf = bf16[5,2048,1024]{2,1,0} parameter(0)
  ROOT %out = bf16[2048,1024]{1,0} custom-call(%buf), custom_call_target="tpu_custom_call", backend_config={"custom_call_config": {"body": "..."}, "cost_estimate":{"flops":"6291456","transcendentals":"2048","bytes_accessed":"12582912","remote_bytes_transferred":"0"}}
}
"""


def test_a_pallas_kernel_counts_what_its_cost_estimate_states():
  """The kernel's BlockSpecs load 2 of the 5 slots (its CostEstimate: 3 x 4 MiB with
  the output): its operand's and result's sizes (6 x 4 MiB) would charge it the
  slots it skips. FLOPs and transcendentals come from the estimate too, and the
  bytes cross HBM (a kernel's blocks are DMAs between HBM and its on-chip memory)."""
  mib4 = 2048 * 1024 * 2
  costs = hlo_cost.analyze(_PALLAS_HLO)
  assert costs['bytes'] == 3 * mib4
  assert (costs['flops'], costs['transcendentals']) == (6291456, 2048)
  assert hlo_hbm.hbm_costs(_PALLAS_HLO)['hbm_bytes'] == 3 * mib4
  # With the buffer held on chip, only the result's share (1 of 6 x 4 MiB) of the
  # stated traffic crosses HBM.
  held = _PALLAS_HLO.replace('bf16[5,2048,1024]{2,1,0}', 'bf16[5,2048,1024]{2,1,0:S(1)}')
  assert hlo_hbm.hbm_costs(held)['hbm_bytes'] == pytest.approx(3 * mib4 / 6, rel=1e-12)
  # Without an estimate a custom call counts its operands and result, as before.
  plain = _PALLAS_HLO.replace('"tpu_custom_call"', '"SomeCall"')
  assert hlo_cost.analyze(plain)['bytes'] == 6 * mib4


# A fusion the compiler costs at 1000 cycles (8 MiB moved) beside the Pallas kernel
# above (12 MiB by its CostEstimate, no cycles of its own).
_CYCLES_AND_KERNEL_HLO = """
HloModule m

%fused (a: f32[1024,1024]) -> f32[1024,1024] {
  %a = f32[1024,1024]{1,0} parameter(0)
  ROOT %n = f32[1024,1024]{1,0} negate(%a)
}

ENTRY %main (x: f32[1024,1024], buf: bf16[5,2048,1024]) -> (f32[1024,1024], bf16[2048,1024]) {
  %x = f32[1024,1024]{1,0} parameter(0)
  %buf = bf16[5,2048,1024]{2,1,0} parameter(1)
  %y = f32[1024,1024]{1,0} fusion(%x), kind=kLoop, calls=%fused, backend_config={"estimated_cycles":"1000"}
  %out = bf16[2048,1024]{1,0} custom-call(%buf), custom_call_target="tpu_custom_call", backend_config={"custom_call_config": {"body": "..."}, "cost_estimate":{"flops":"6291456","transcendentals":"2048","bytes_accessed":"12582912","remote_bytes_transferred":"0"}}
  ROOT %t = (f32[1024,1024]{1,0}, bf16[2048,1024]{1,0}) tuple(%y, %out)
}
"""


def test_the_cycles_view_with_kernels_charges_them_at_the_programs_own_rate():
  """A Pallas kernel carries no cycles; `cycles_with_kernels` charges its roofline
  (12 MiB at unit bandwidth) at the cycles per roofline second of the rest (1000
  cycles for the fusion's 8 MiB): 1000 x (1 + 12 / 8)."""
  costs = hlo_cost.analyze(_CYCLES_AND_KERNEL_HLO)
  assert costs['cycles'] == 1000
  assert costs['roofline_pallas'] == 12 * 2**20
  assert step_summary.cycles_with_kernels(costs) == pytest.approx(2500, rel=1e-12)
  # Without a kernel the view is the cycles.
  assert step_summary.cycles_with_kernels(hlo_cost.analyze(_PREFETCH_HLO)) == 0


# A weight prefetched into on-chip memory (S(1)) and read there by a fusion, beside a
# fusion that reads an HBM operand: the TPU compiler's shapes of both.
_PREFETCH_HLO = """
HloModule m

%fused (a: f32[1024,1024]) -> f32[1024,1024] {
  %a = f32[1024,1024]{1,0} parameter(0)
  ROOT %n = f32[1024,1024]{1,0} negate(%a)
}

ENTRY %main (w: f32[1024,1024]) -> (f32[1024,1024], f32[1024,1024]) {
  %w = f32[1024,1024]{1,0} parameter(0)
  %cs = (f32[1024,1024]{1,0:S(1)}, f32[1024,1024]{1,0}, u32[]{:S(2)}) copy-start(%w)
  %cd = f32[1024,1024]{1,0:S(1)} copy-done(%cs)
  %on_chip = f32[1024,1024]{1,0} fusion(%cd), kind=kLoop, calls=%fused
  %off_chip = f32[1024,1024]{1,0} fusion(%w), kind=kLoop, calls=%fused
  ROOT %t = (f32[1024,1024]{1,0}, f32[1024,1024]{1,0}) tuple(%on_chip, %off_chip)
}
"""


def test_hbm_bytes_count_a_prefetched_weight_once():
  """A 4 MiB weight copied on chip and read there crosses HBM once (the copy's read)
  where "bytes accessed" counts it three times (read, on-chip write, on-chip read);
  besides, both fusions write their 4 MiB results to HBM and the other one reads the
  weight from HBM."""
  mib4 = 1024 * 1024 * 4
  assert hlo_cost.analyze(_PREFETCH_HLO)['bytes'] == (3 + 2 + 1) * mib4
  assert hlo_hbm.hbm_costs(_PREFETCH_HLO)['hbm_bytes'] == (1 + 2 + 1) * mib4


@pytest.mark.parametrize(
  'mode, layers',
  [('standard', 1), ('standard@2', 2), ('block:4', 2), ('block:8', 4), ('full', 2)],
)
def test_the_cost_table_pairs_each_row_with_the_standard_of_its_loop_structure(
  mode, layers
):
  """`bench/aot.py` compares a row's estimate with the standard compiled with as many
  layers per scan body ("vs std@G"): the row's segment length, d1024's 8 layers."""
  assert aot_cli.segment_layers(aot_cli.row_config(mode, 'd1024', 4, 'data')) == layers
