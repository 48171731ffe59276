"""The compute ladders of the compute-multiplier studies: bench/ladder.py trains one,
bench/scaling.py fits it. A ladder is a list of rungs (width, layers), one token rule
(tokens per non-embedding parameter, the same at every rung) and the residuals it
compares; every rung's model has head dimension 8 and a SwiGLU MLP of width 3d, and
trains in steps of 16 x 128 tokens with a tenth of them warmup.

- `EARLY`: 4 layers at every width, 4 tokens per parameter (the early-training
  regime); Block AttnRes at S = 4, i.e. N = 2 blocks. Sized to run 2 residuals x 3
  seeds on 2 shared CPU cores in about an hour.
- `OPTIMAL`: depth growing with width (4, 4, 6, 6 layers; 13k to 125k non-embedding
  parameters), 20 tokens per parameter (Chinchilla-style), Block AttnRes with a fixed
  N = 4 blocks, so S = 2L / 4 follows from the depth. Sized so that 2 residuals x 3
  seeds take about an hour on 2 idle CPU cores (a rung's cost grows as its parameters
  squared: the 8-layer rungs first planned, d = 40 and 48, would have taken 4x that).
- `OPTIMAL_10X`: the same rule at about 10x the parameters (0.3M to 2.7M, 6 to 10
  layers) in batches of 64 x 128 tokens, for a GPU host (bench/gpu_ladder.sh). Its
  largest rung reads the embedded corpus's training split about 11 times over.
"""

from __future__ import annotations

import dataclasses

from attnres_jax import modes

SEQ_LEN = 128  # the default sequence length
CHECKPOINT_EVERY = 500  # steps: a long rung resumes from here when interrupted


@dataclasses.dataclass(frozen=True)
class Ladder:
  name: str
  rungs: tuple[tuple[int, int], ...]  # (width d_model, layers), by increasing size
  tokens_per_param: int
  residuals: tuple[str, ...]  # the modes it may train (configs/default.py SWEEP_RUNS)
  compared: tuple[str, ...]  # what bench/ladder.py trains and fits by default
  blocks: int | None = None  # Block AttnRes with N blocks at every depth: a bare 'block'
  prefix: str = ''  # of its run names
  batch_size: int = 16  # sequences of SEQ_LEN tokens a step

  @property
  def batch_tokens(self) -> int:
    return self.batch_size * SEQ_LEN

  @property
  def widths(self) -> tuple[int, ...]:
    return tuple(width for width, _ in self.rungs)

  def layers(self, width: int) -> int:
    return dict(self.rungs)[width]

  def block_size(self, width: int) -> int | None:
    """S = 2L / N sublayers per block where the ladder fixes the block count N."""
    if self.blocks is None:
      return None
    sublayers = 2 * self.layers(width)
    if sublayers % self.blocks:
      raise ValueError(f'{sublayers} sublayers do not split into {self.blocks} blocks')
    return sublayers // self.blocks

  def run(self, mode: str, width: int) -> str:
    """The run name of a rung, e.g. EARLY ('block:4', 32) -> 'block_s4_d32',
    OPTIMAL ('block', 32) -> 'opt_block_n4_d32_l6'."""
    if mode == 'block' and self.blocks is not None:
      name = f'block_n{self.blocks}'
    else:
      name = modes.run_name(mode)
    # The depth is in the name where the ladder's depth varies.
    varies = len({layers for _, layers in self.rungs}) > 1
    depth = f'_l{self.layers(width)}' if varies else ''
    return f'{self.prefix}{name}_d{width}{depth}'

  def params(self, width: int) -> int:
    """Non-embedding parameters: 4 d^2 attention + 9 d^2 SwiGLU MLP (three d x 3d
    matrices) per layer; norms and the residual's few vectors left out."""
    return 13 * width * width * self.layers(width)

  def train_overrides(self, width: int) -> dict[str, int]:
    """The train fields of a rung (train.py --config.<key>=<value>): its step budget,
    warmup and checkpoint cadence."""
    steps = round(self.tokens_per_param * self.params(width) / self.batch_tokens)
    return {
      'train.batch_size': self.batch_size,
      'train.num_steps': steps,
      'train.warmup_steps': max(1, round(steps / 10)),
      'train.checkpoint_every': min(steps, CHECKPOINT_EVERY),
    }

  def model_fields(self, mode: str, width: int) -> dict[str, object]:
    return dict(
      modes.fields(mode, block_size=self.block_size(width)),
      d_model=width,
      num_layers=self.layers(width),
      num_heads=width // 8,
      mlp_dim=3 * width,
    )

  def sweep_runs(self) -> dict[str, dict[str, object]]:
    """Every (residual, rung) as a named sweep run (configs/default.py SWEEP_RUNS)."""
    return {
      self.run(mode, width): self.model_fields(mode, width)
      for mode in self.residuals
      for width in self.widths
    }


EARLY = Ladder(
  name='early',
  rungs=((24, 4), (32, 4), (40, 4), (48, 4)),
  tokens_per_param=4,
  residuals=('standard', 'full', 'block:4', 'mhc', 'hc'),
  compared=('standard', 'block:4'),
)
OPTIMAL = Ladder(
  name='optimal',
  rungs=((16, 4), (24, 4), (32, 6), (40, 6)),
  tokens_per_param=20,
  residuals=('standard', 'block', 'full'),
  compared=('standard', 'block'),
  blocks=4,
  prefix='opt_',
)
OPTIMAL_10X = Ladder(
  name='optimal_10x',
  rungs=((64, 6), (96, 8), (128, 8), (144, 10)),
  tokens_per_param=20,
  residuals=('standard', 'block', 'full'),
  compared=('standard', 'block'),
  blocks=4,
  prefix='opt10x_',
  batch_size=64,
)
LADDERS = {ladder.name: ladder for ladder in (EARLY, OPTIMAL, OPTIMAL_10X)}
