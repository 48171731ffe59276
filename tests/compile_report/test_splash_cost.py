"""The splash kernels' analytic cost (compile_report/splash_cost.py), which the
report adds to the compiler's step estimate, and `train.py --compile_only --suggest`
(compile_report/suggest.py)."""

import importlib.util
import subprocess
import sys

import pytest

from attnres_jax.compile_report import aot
from attnres_jax.compile_report import hlo_cost
from attnres_jax.compile_report import suggest
from configs import default as default_config

needs_libtpu = pytest.mark.skipif(
  importlib.util.find_spec('libtpu') is None,
  reason='libtpu (the TPU compiler) is not installed',
)

# The forward splash kernel as the TPU compiler writes it (v5p, batch 4, 16 heads of
# 128, T = 4096 in blocks of 512): scratch outputs, the output, the log-sum-exp kept
# broadcast over 128 lanes; no CostEstimate.
_SPLASH_HLO = """
HloModule m

ENTRY %main (q: bf16[4,16,4096,128], k: bf16[4,16,4096,128], v: bf16[4,16,4096,128], dn: s8[1,8,8], bm: s8[1,8,8], i: s32[4096,128]) -> (f32[4,512,128], f32[4,512,128], f32[4,512,128], bf16[4,16,4096,128], f32[4,16,4096,128]) {
  %q = bf16[4,16,4096,128]{3,2,1,0} parameter(0)
  %k = bf16[4,16,4096,128]{3,2,1,0} parameter(1)
  %v = bf16[4,16,4096,128]{3,2,1,0} parameter(2)
  %dn = s8[1,8,8]{2,1,0} parameter(3)
  %bm = s8[1,8,8]{2,1,0} parameter(4)
  %i = s32[4096,128]{1,0} parameter(5)
  ROOT %splash_mha_fwd_residuals.1 = (f32[4,512,128]{2,1,0}, f32[4,512,128]{2,1,0}, f32[4,512,128]{2,1,0}, bf16[4,16,4096,128]{3,2,1,0}, f32[4,16,4096,128]{3,2,1,0}) custom-call(%dn, %bm, %q, %k, %v, %i), custom_call_target="tpu_custom_call", operand_layout_constraints={s8[1,8,8]{2,1,0}, s8[1,8,8]{2,1,0}, bf16[4,16,4096,128]{3,2,1,0}, bf16[4,16,4096,128]{3,2,1,0}, bf16[4,16,4096,128]{3,2,1,0}, s32[4096,128]{1,0}}, frontend_attributes={kernel_metadata={}}, backend_config={"custom_call_config": {"body": "..."}}
}
"""


def test_a_splash_kernel_counts_its_causal_half_analytically():
  """8 x 8 blocks, of which the 36 on or below the diagonal run: 2 matmuls of
  2 x T x T x 128 per head, times 36 / 64; one exp a visited score; q, k, v read and
  the output and the lane-broadcast log-sum-exp written."""
  heads, t, head_dim = 4 * 16, 4096, 128
  visited = heads * t * t * 36 / 64
  costs = hlo_cost.analyze(_SPLASH_HLO, peak_flops=459e12, hbm_bandwidth=2.76e12)  # v5p
  assert costs['flops'] == 2 * 2 * visited * head_dim
  assert costs['transcendentals'] == visited
  array = heads * t * head_dim
  assert costs['bytes'] == 3 * 2 * array + 2 * array + 4 * array
  # The compiler's estimate (here 1 ms, the kernel left out) gains the kernel's
  # roofline: its FLOPs at the peak (0.67 ms; its bytes would take 0.15 ms).
  seconds = hlo_cost.estimated_seconds(costs, 1e-3)
  assert seconds == pytest.approx(1e-3 + costs['flops'] / 459e12, rel=1e-12)
  # A compiler estimate that is not positive (seen on v6e) gives way to the roofline.
  assert hlo_cost.estimated_seconds(costs, -16.0) == costs['roofline']
  # Any other custom call keeps its operands' and results' sizes, no FLOPs.
  other = _SPLASH_HLO.replace('%splash_mha_fwd_residuals.1', '%other.1')
  assert hlo_cost.analyze(other)['flops'] == 0


def test_suggest_picks_the_highest_estimated_mfu_that_fits(monkeypatch):
  """The grid's choice, the compiles faked: a point that does not fit is passed over
  whatever its estimate; the best point is then compiled on the other layout, FSDP,
  which wins here."""
  config = default_config.get_config('tiny')
  data, fsdp = (-1, 1, 1), (1, -1, 1)
  estimates = {
    ('none', 8, data): 0.5,
    ('none', 16, data): 0.9,
    ('layer', 8, data): 0.4,
    ('layer', 16, data): 0.6,
    ('layer', 16, fsdp): 0.7,
  }

  def fake_report(candidate, topology, num_slices, steps):
    key = (candidate.model.remat, candidate.train.batch_size, tuple(candidate.mesh.shape))
    if key[:2] == ('none', 16):
      raise ValueError('The train step does not fit on v5p:2x2x1.')
    train = dict(
      memory=dict(need_bytes=1.0), est_step_seconds=1.0, est_mfu=estimates[key]
    )
    return {'steps': {'train': train}}

  monkeypatch.setattr(suggest, 'POLICIES', ('none', 'layer'))
  monkeypatch.setattr(suggest, 'BATCH_FACTORS', (1, 2))
  monkeypatch.setattr(aot, 'compile_report', fake_report)
  config.train.batch_size = 8  # 2 sequences on each of the 4 chips
  result = suggest.run_grid(config, 'v5p:2x2x1', out=sys.stdout)
  assert [(r['remat'], r['batch_size']) for r in result['rows']] == [
    key[:2] for key in estimates
  ]
  assert 'error' in result['rows'][1]
  assert suggest.flags(result['rows'][3]) == (
    '--config.model.remat=layer --config.train.batch_size=16'
  )
  assert suggest.flags(result['best']) == (
    "--config.model.remat=layer --config.train.batch_size=16 --config.mesh.shape='(1,-1,1)'"
  )


@needs_libtpu
def test_train_py_suggest_prints_the_flags_to_pass():
  """One grid point of the tiny standard run compiled for v5p:2x2x1: the flags
  printed are those of a point of the grid."""
  code = (
    'import sys; from attnres_jax.compile_report import suggest; '
    "suggest.POLICIES = ('minimal',); suggest.BATCH_FACTORS = (1,); "
    'suggest.MESH_SHAPES = (); '
    "sys.argv[1:] = ['--config=configs/default.py:tiny', "
    "'--config.model.residual=standard', '--compile_only', "
    "'--topology=v5p:2x2x1', '--suggest']; "
    "import runpy; runpy.run_path('train.py', run_name='__main__')"
  )
  result = subprocess.run(
    [sys.executable, '-c', code], capture_output=True, text=True, timeout=300
  )
  assert result.returncode == 0, result.stderr[-2000:]
  batch = default_config.get_config('tiny').train.batch_size
  assert result.stdout.strip().splitlines()[-1] == (
    f'--config.model.remat=minimal --config.train.batch_size={batch}'
  )
  assert 'remat=minimal' in result.stderr
