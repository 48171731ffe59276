"""The model config (a frozen, hashable dataclass) and the validation of a whole run
config, raised before anything compiles.

A run is read from one ml_collections file (`configs/default.py`, which lists every
knob; its `model` section is `ModelConfig`'s fields, defined here); the entry points
turn that section into a `ModelConfig` (`ModelConfig.from_config`), which the model
stores. `validate(config)` checks every
section of a run config with readable messages.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import math
from collections.abc import Mapping, Sequence
from typing import Any

import ml_collections

from attnres_jax.kernels import attention as attention_lib
from attnres_jax.parallel import pipeline_plan
from attnres_jax import residuals
from attnres_jax.nn import remat as remat_lib
from attnres_jax.nn import sharding

REMAT_POLICIES = remat_lib.REMAT_POLICIES
DTYPES = ('float32', 'bfloat16')
DEPTH_NORMALIZERS = ('softmax', 'sigmoid')
DEPTH_MIXINGS = ('attention', 'scalars')
SCHEDULES = ('cosine', 'wsd', 'constant')
TOKENIZERS = ('bytes', 'sentencepiece')
SECTIONS = ('model', 'data', 'train', 'mesh')

# Fields that choose how the same function is computed, not which function.
EXECUTION_FIELDS = (
  'scan_layers',
  'remat',
  'schedule_layers',
  'depth_dtype',
  'depth_kernel',
  'attention',
)
# Execution fields that became automatic rules (docs/design_choices.md): a config that
# sets one is refused with what replaced it.
REMOVED_FIELDS = {
  'depth_read': 'the read follows from the residual: the two-phase block schedule for '
  "the paper's read, the one-shot read for the ablations",
  'linear_memory_backward': 'AttnRes always trains through its linear-memory backward '
  '(plain autodiff is a test-only reference)',
  'backward_layer_barrier': 'removed: it traded step time for temporary memory, off by '
  'default',
  'depth_read_prefixes': "an internal rule: XLA's Phase 1 reads 4 buffer prefixes for "
  'Full AttnRes, the whole buffer for Block',
  'phase1_backward': 'an internal rule: with the Phase 1 kernel, the backward keeps '
  "Phase 1's results where its reads outweigh its outputs three times",
}
# The read ablations (paper Section 5); off = the paper's read.
ABLATION_FIELDS = (
  'depth_query_input',
  'depth_normalizer',
  'depth_key_norm',
  'depth_mixing',
  'depth_window',
  'depth_heads',
)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """The model: its size, its residual, and how it is computed. Hashable, so the
  model's GraphDef can be a static jit argument. The one place of the model fields and
  their defaults (a tiny Block AttnRes model), which `configs/default.py` starts from."""

  vocab_size: int = 256  # tokens (bytes: 256)
  d_model: int = 128  # model width D
  num_layers: int = 4  # Transformer layers; 2 sublayers each (attn, MLP)
  num_heads: int = 4  # attention heads (head width D / heads, even)
  mlp_dim: int = 384  # SwiGLU hidden width
  residual: str = 'block'  # 'standard' | 'full' | 'block' (AttnRes) | 'hc' |
  # 'mhc' | any mode in residuals.registry
  block_size: int = 2  # S: sublayers per block ('block'; 1 = Full)
  tie_embeddings: bool = True  # the output layer is the embedding table
  rope_theta: float = 10_000.0  # rotary embedding base
  norm_eps: float = 1e-6  # PreNorm and final RMSNorm epsilon
  attn_res_eps: float = 1e-6  # epsilon of the depth read's key RMSNorm
  dtype: str = 'float32'  # compute: 'float32' | 'bfloat16' (reads: float32)
  param_dtype: str = 'float32'  # parameters and optimizer state
  scan_layers: bool = True  # False: a Python loop over layers (debugging)
  # What the backward keeps (nn/remat.py): 'none' (all) | 'minimal' (the matmul
  # outputs) | 'sublayer' | 'layer' (their inputs) | 'offload' (TPU: 'minimal' kept
  # in host memory)
  remat: str = 'none'
  schedule_layers: int = 0  # layers per schedule segment (0: per residual)
  # AttnRes storage of the depth buffer, partial sums and Phase 1 outputs: '' = the
  # compute dtype | 'bfloat16' | 'float32' (softmax statistics and sums: float32)
  depth_dtype: str = ''
  # The Pallas kernels (AttnRes Phase 1 and its VJP; HC/mHC: the stream write and
  # mHC's Sinkhorn): 'auto' = on when the step is compiled for TPU devices and they
  # fit on chip, else XLA (kernels/pallas_mesh.py, choose_kernel) | 'xla' | 'pallas'
  # (off the TPU: Pallas interpret mode)
  depth_kernel: str = 'auto'
  # Causal attention (kernels/attention.py): 'auto' = splash on TPU devices, cuDNN on
  # GPUs where it supports the shape and dtype, else XLA | 'xla' | 'splash' (TPU;
  # interpret mode off it) | 'cudnn' (GPU)
  attention: str = 'auto'
  depth_query_input: bool = False  # ablation: query += W RMSNorm(latest source) / sqrt(D)
  depth_normalizer: str = 'softmax'  # ablation: 'softmax' | 'sigmoid'
  depth_key_norm: bool = True  # ablation: False = logits from the raw sources
  depth_mixing: str = 'attention'  # ablation: 'attention' | 'scalars' (DenseFormer)
  depth_window: int = 0  # ablation: > 0 reads the embedding + last W sources
  depth_heads: int = 1  # ablation: > 1 = per channel-group depth weights
  hc_streams: int = 4  # 'hc' / 'mhc': residual streams m (expansion rate)
  hc_dynamic: bool = True  # 'hc' / 'mhc': input-dependent part of the mixing
  sinkhorn_iters: int = 20  # 'mhc': Sinkhorn-Knopp iterations

  def __post_init__(self):
    _validate_model(self)

  @classmethod
  def from_config(cls, config: ModelConfig | Mapping[str, Any]) -> ModelConfig:
    """From a `model` config section (a ConfigDict or a dict); unknown fields are an
    error that lists the known ones."""
    if isinstance(config, ModelConfig):
      return config
    values = (
      config.to_dict() if isinstance(config, ml_collections.ConfigDict) else dict(config)
    )
    known = {field.name for field in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    removed = [name for name in unknown if name in REMOVED_FIELDS]
    if removed:
      why = '; '.join(f'{n} is no longer a field: {REMOVED_FIELDS[n]}' for n in removed)
      raise ValueError(f'Invalid model config: {why}.')
    if unknown:
      raise ValueError(
        f'Invalid model config: unknown fields {unknown}; the model '
        f'fields are: {", ".join(sorted(known))}.'
      )
    return cls(**values)

  def replace(self, **changes) -> ModelConfig:
    return dataclasses.replace(self, **changes)

  def to_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)

  @property
  def sublayers_per_layer(self) -> int:
    """A Transformer layer's sublayers: attention, then the MLP."""
    return 2

  @property
  def ablations(self) -> list[str]:
    """The read ablations that differ from the paper's read."""
    paper = ModelConfig.__dataclass_fields__
    return [
      name for name in ABLATION_FIELDS if getattr(self, name) != paper[name].default
    ]


def model_config(**overrides) -> ModelConfig:
  """The default (tiny) model config with `overrides` applied (an unknown or removed
  field: a ValueError that says so)."""
  return ModelConfig.from_config(overrides)


def num_sublayers(cfg) -> int:
  return cfg.sublayers_per_layer * cfg.num_layers


_is_int = residuals.base.is_int


def _validate_model(cfg: ModelConfig) -> None:
  """Raises ValueError with a readable message for an invalid model config."""

  def fail(message):
    raise ValueError(f'Invalid model config: {message}')

  for name in ('vocab_size', 'd_model', 'num_layers', 'num_heads', 'mlp_dim'):
    value = getattr(cfg, name)
    if not _is_int(value) or value < 1:
      fail(f'{name} must be a positive integer, got {value!r}.')
  residual = residuals.make(cfg)  # an unknown mode: an error naming the known ones
  if cfg.d_model % cfg.num_heads:
    fail(f'num_heads={cfg.num_heads} does not divide d_model={cfg.d_model}.')
  if (cfg.d_model // cfg.num_heads) % 2:
    fail(
      f'head dim d_model / num_heads = {cfg.d_model // cfg.num_heads} must be '
      'even for rotary embeddings.'
    )
  if not isinstance(cfg.rope_theta, (int, float)) or not cfg.rope_theta > 0:
    fail(f'rope_theta must be > 0, got {cfg.rope_theta!r}.')
  if cfg.attention not in attention_lib.ATTENTION_SETTINGS:
    fail(
      f'attention must be one of {attention_lib.ATTENTION_SETTINGS}, got '
      f'{cfg.attention!r}.'
    )
  validate_depth_fields(cfg, residual)


def validate_depth_fields(cfg, residual) -> None:
  """Raises ValueError for an invalid value of a field that the residual and the
  layer stack read (`ModelConfig`'s, `DepthStack`'s `StackConfig`'s), then runs
  `residual.validate()`."""

  def fail(message):
    raise ValueError(f'Invalid model config: {message}')

  for name in ('dtype', 'param_dtype'):
    if getattr(cfg, name) not in DTYPES:
      fail(f'{name} must be one of {DTYPES}, got {getattr(cfg, name)!r}.')
  if cfg.depth_normalizer not in DEPTH_NORMALIZERS:
    fail(
      f'depth_normalizer must be one of {DEPTH_NORMALIZERS}, got '
      f'{cfg.depth_normalizer!r}.'
    )
  if cfg.depth_mixing not in DEPTH_MIXINGS:
    fail(f'depth_mixing must be one of {DEPTH_MIXINGS}, got {cfg.depth_mixing!r}.')
  if not _is_int(cfg.depth_window) or cfg.depth_window < 0:
    fail(
      f'depth_window must be an integer >= 0 (0 = no window), got {cfg.depth_window!r}.'
    )
  if not _is_int(cfg.depth_heads) or cfg.depth_heads < 1 or cfg.d_model % cfg.depth_heads:
    fail(
      f'depth_heads must be a positive divisor of d_model={cfg.d_model}, got '
      f'{cfg.depth_heads!r}.'
    )
  layers = cfg.schedule_layers
  if not _is_int(layers) or layers < 0 or layers > cfg.num_layers:
    fail(
      f'schedule_layers must be an integer in [0, num_layers={cfg.num_layers}] '
      f'(0 = automatic), got {layers!r}.'
    )
  if cfg.remat not in REMAT_POLICIES:
    fail(f'remat must be one of {REMAT_POLICIES}, got {cfg.remat!r}.')
  for name in ('norm_eps', 'attn_res_eps'):
    value = getattr(cfg, name)
    if not isinstance(value, (int, float)) or not value > 0:
      fail(f'{name} must be > 0, got {value!r}.')
  residual.validate()  # the fields the residual reads


# -- the run config -------------------------------------------------------------------


def validate_data(config) -> None:
  """Raises ValueError for an invalid `data` section (the tokenizer fields)."""
  name = config.tokenizer
  if name not in TOKENIZERS:
    raise ValueError(f'Unknown tokenizer {name!r}; available: {sorted(TOKENIZERS)}.')
  vocab_size = config.get('vocab_size')
  if name == 'bytes' and vocab_size not in (None, 256):
    raise ValueError(f"tokenizer='bytes' has 256 tokens; got vocab_size={vocab_size}.")
  if name == 'sentencepiece' and vocab_size is None and not config.get('tokenizer_path'):
    raise ValueError(
      "tokenizer='sentencepiece' needs data.vocab_size (a model is "
      'trained on the training split) or data.tokenizer_path.'
    )


def validate_train(config) -> None:
  """Raises ValueError for an invalid `train` section (loop and optimizer)."""

  def fail(message):
    raise ValueError(f'Invalid train config: {message}')

  def positive_int(name, allow_none=False):
    value = config.get(name)
    if value is None and allow_none:
      return
    if not _is_int(value) or value < 1:
      fail(
        f'{name} must be a positive integer{" or None" if allow_none else ""}, '
        f'got {value!r}.'
      )

  for name in (
    'batch_size',
    'seq_len',
    'num_steps',
    'log_every',
    'checkpoint_every',
    'grad_accum_steps',
  ):
    positive_int(name)
  for name in ('keep_checkpoints', 'max_eval_batches', 'eval_every'):
    positive_int(name, allow_none=True)
  if not isinstance(config.seed, int):
    fail(f'seed must be an integer, got {config.seed!r}.')
  if config.batch_size % config.grad_accum_steps:
    fail(
      f'grad_accum_steps={config.grad_accum_steps} does not divide '
      f'batch_size={config.batch_size}.'
    )
  if config.schedule not in SCHEDULES:
    fail(f'schedule must be one of {SCHEDULES}, got {config.schedule!r}.')
  if not (
    isinstance(config.learning_rate, (int, float))
    and math.isfinite(config.learning_rate)
    and config.learning_rate > 0
  ):
    fail(f'learning_rate must be a finite number > 0, got {config.learning_rate!r}.')
  if not 0 <= config.warmup_steps <= config.num_steps:
    fail(
      f'warmup_steps must be in [0, num_steps={config.num_steps}], '
      f'got {config.warmup_steps!r}.'
    )
  if not 0 <= config.min_lr_ratio <= 1:
    fail(f'min_lr_ratio must be in [0, 1], got {config.min_lr_ratio!r}.')
  if config.schedule == 'wsd' and not 0 < config.decay_fraction <= 1:
    fail(f'decay_fraction must be in (0, 1], got {config.decay_fraction!r}.')
  if config.weight_decay < 0:
    fail(f'weight_decay must be >= 0, got {config.weight_decay!r}.')
  if config.grad_clip is not None and config.grad_clip < 0:
    fail(
      f'grad_clip must be >= 0 or None (0 / None: no clipping), got {config.grad_clip!r}.'
    )


def validate(
  config: ml_collections.ConfigDict, *, num_devices: int | None = None
) -> None:
  """Validates a run config, every section and how they fit together (the pipeline,
  the batch over the data-parallel devices when `num_devices` is given): ValueError
  with a readable message, before anything compiles. The one validation pass of the
  entry points."""
  for section in SECTIONS:
    if section not in config:
      raise ValueError(f'Config has no {section!r} section.')
  model = ModelConfig.from_config(config.model)
  validate_data(config.data)
  validate_train(config.train)
  sharding.validate_mesh_config(config.mesh)
  rows = config.train.batch_size // config.train.grad_accum_steps  # per microbatch
  data_shards = 1
  if num_devices is not None:
    shape = sharding.mesh_shape(config.mesh, num_devices)
    rules = sharding.rules_from_config(config.mesh)
    data_shards = math.prod(shape[a] for a in sharding.mesh_axes('batch', rules))
    if rows % data_shards:
      raise ValueError(
        f'The microbatch of {rows} rows (batch_size / grad_accum_steps) '
        f'does not split over the {data_shards} data-parallel devices.'
      )
  pipeline_plan.validate(
    pipeline_plan.from_mesh_config(config.mesh), model, rows, data_shards
  )


def explain_config_overrides(argv: Sequence[str], default: str) -> str | None:
  """Why a `--config.a.b=v` override of `argv` names no config field (None: all do).

  For `train.py`, whose flag parser reports an unknown field only as "'b'". Loads
  the config file of `--config=path[:arg]` (else `default`) itself.
  """
  path = default
  for i, arg in enumerate(argv):
    if arg.startswith('--config='):
      path = arg.split('=', 1)[1]
    elif arg == '--config' and i + 1 < len(argv):
      path = argv[i + 1]
  path, _, arg = path.partition(':')
  try:
    spec = importlib.util.spec_from_file_location('_config_file', path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = module.get_config(arg) if arg else module.get_config()
  except Exception:  # pylint: disable=broad-except
    return None  # the config file's own error is the one to show
  for flag in argv:
    if not flag.startswith('--config.'):
      continue
    name = flag[len('--config.') :].split('=', 1)[0]
    node, walked = config, []
    for key in name.split('.'):
      if not isinstance(node, ml_collections.ConfigDict) or key not in node:
        if walked == ['model'] and key in REMOVED_FIELDS:
          return f'{flag!r}: model.{key} is no longer a field: {REMOVED_FIELDS[key]}.'
        where = '.'.join(walked) or 'the config'
        fields = (
          sorted(node.keys()) if isinstance(node, ml_collections.ConfigDict) else []
        )
        close = difflib.get_close_matches(key, fields, n=1)
        return (
          f'unknown config field {name!r} in {flag!r}'
          + (f'; did you mean {".".join(walked + close)!r}?' if close else '.')
          + (
            f' The fields of {where} are: {", ".join(fields)}.'
            if fields
            else f' ({where} is a value, not a section.)'
          )
        )
      node = node[key]
      walked.append(key)
  return None
