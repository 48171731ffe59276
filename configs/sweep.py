"""The small-scale reproduction grid: residual modes, the paper's ablations, depth.

  python train.py --config=configs/sweep.py:block_s4 --workdir=...
  python bench/sweep.py          # runs the whole grid x seeds (resumable)

Every run trains the same model size on the same tokens (budget: `BUDGET_STEPS` steps
of 16 x 128 bytes) and differs only in the named switches. With 3 seeds the grid took
1 h 42 min of run time on 2 CPU cores (modes 29 min, ablations 52, depths 21).
"""

import ml_collections

from configs import default

BUDGET_STEPS = 300

# name -> model overrides. The modes (paper Table/Fig. 6) ...
MODES = {
    'standard': dict(residual='standard'),
    'full': dict(residual='full'),
    'block_s2': dict(residual='block', block_size=2),
    'block_s4': dict(residual='block', block_size=4),
    'block_s8': dict(residual='block', block_size=8),
}
# ... the ablations of the read (paper Section 5), on Full AttnRes as in the paper ...
_ABLATION = dict(residual='full', depth_read='one_shot')
ABLATIONS = {
    'abl_input_query': dict(_ABLATION, depth_query_input=True),
    'abl_sigmoid': dict(_ABLATION, depth_normalizer='sigmoid'),
    'abl_no_key_norm': dict(_ABLATION, depth_key_norm=False),
    'abl_scalars': dict(_ABLATION, depth_mixing='scalars'),
    'abl_window2': dict(_ABLATION, depth_window=2),
    'abl_heads4': dict(_ABLATION, depth_heads=4),
}
# ... and depth at (about) constant compute: L * d^2 roughly fixed (paper Fig. 7).
# The middle point (4 layers, d=128) is 'standard' / 'block_s2' above.
DEPTHS = {}
for _layers, _width in ((2, 176), (8, 96)):
  for _mode, _extra in (('standard', dict(residual='standard')),
                        ('block', dict(residual='block', block_size=2))):
    DEPTHS[f'depth_l{_layers}_{_mode}'] = dict(
        _extra, num_layers=_layers, d_model=_width, mlp_dim=3 * _width)

# ... and the paper's comparators (Table 2/4): Hyper-Connections and mHC with m = 4
# streams, static and dynamic parts (attnres_jax/hyper_connections.py).
COMPARATORS = {
    'mhc': dict(residual='mhc', hc_streams=4),
    'hc': dict(residual='hc', hc_streams=4),
}

# ... and a compute ladder for the scaling fit L = A C^-alpha (bench/scaling.py): the
# same 4 layers at other widths (head dim 32, MLP 3d); the d = 128 rung is the runs
# above (`scaling_run(name, 128) == name`).
BASE_WIDTH = 128
SCALING_WIDTHS = (64, 96, BASE_WIDTH, 192)
SCALING_RESIDUALS = ('standard', 'full', 'block_s4', 'mhc', 'hc')


def scaling_run(name: str, width: int) -> str:
  return name if width == BASE_WIDTH else f'{name}_d{width}'


SCALING = {
    scaling_run(_name, _width): dict(
        {**MODES, **COMPARATORS}[_name], d_model=_width, num_heads=_width // 32,
        mlp_dim=3 * _width)
    for _name in SCALING_RESIDUALS for _width in SCALING_WIDTHS
    if _width != BASE_WIDTH}

RUNS = {**MODES, **ABLATIONS, **DEPTHS, **COMPARATORS, **SCALING}


def get_config(arg: str = 'block_s2') -> ml_collections.ConfigDict:
  if arg not in RUNS:
    raise ValueError(f'configs/sweep.py:<name>: unknown run {arg!r}; one of '
                     f'{sorted(RUNS)}.')
  config = default.get_config()
  config.model.update(RUNS[arg])
  config.train.num_steps = BUDGET_STEPS
  config.train.warmup_steps = 30
  config.train.checkpoint_every = BUDGET_STEPS
  config.train.log_every = 25
  return config
