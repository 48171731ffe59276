"""Model configuration: defaults and validation (raised before anything compiles)."""

from __future__ import annotations

import ml_collections

RESIDUAL_MODES = ('standard', 'full', 'block', 'hc', 'mhc')
HYPER_CONNECTIONS = ('hc', 'mhc')  # residuals of m parallel streams (hyper_connections.py)
REMAT_POLICIES = ('none', 'sublayer', 'layer')
DTYPES = ('float32', 'bfloat16')
DEPTH_READS = ('one_shot', 'two_phase')
DEPTH_NORMALIZERS = ('softmax', 'sigmoid')
DEPTH_MIXINGS = ('attention', 'scalars')


def depth_variant_fields(cfg) -> list[str]:
  """The ablation switches that differ from the paper's read."""
  defaults = dict(depth_query_input=False, depth_normalizer='softmax',
                  depth_key_norm=True, depth_mixing='attention', depth_window=0,
                  depth_heads=1)
  return [name for name, value in defaults.items() if cfg.get(name, value) != value]


def model_config(**overrides) -> ml_collections.ConfigDict:
  """The default (tiny) model config, with `overrides` applied."""
  cfg = ml_collections.ConfigDict(dict(
      vocab_size=256,          # bytes
      d_model=128,
      num_layers=4,            # Transformer blocks; L = 2 * num_layers sublayers
      num_heads=4,
      mlp_dim=384,             # SwiGLU hidden width
      residual='block',        # 'standard' | 'full' | 'block' | 'hc' | 'mhc'
      block_size=2,            # S: sublayers per AttnRes block ('block' only)
      tie_embeddings=True,
      rope_theta=10_000.0,
      norm_eps=1e-6,           # PreNorm and final RMSNorm
      attn_res_eps=1e-6,       # key RMSNorm of the depth read
      dtype='float32',         # compute dtype; the depth read is always float32
      param_dtype='float32',
      scan_layers=True,        # False: unrolled Python loop (debugging, test reference)
      remat='none',            # 'none' | 'sublayer' | 'layer'
      # How Full/Block reads are computed: 'two_phase' (the paper's block schedule:
      # Phase 1 reads the completed blocks once per schedule segment for all its
      # queries, Phase 2 merges each sublayer's newer sources by online softmax) or
      # 'one_shot' (one softmax over all sources per read: the reference).
      depth_read='two_phase',
      # Layers per schedule segment (Phase 1 once per segment); 0 picks one (see
      # residual.default_segment_layers). Block: a segment covers whole blocks.
      schedule_layers=0,
      # Two-phase reads: a backward pass that keeps one depth buffer (memory linear
      # in depth); False uses plain autodiff. One-shot reads always use autodiff.
      linear_memory_backward=True,
      # Ablations of the read (paper Section 5), all off by default. They run the
      # generic one-shot read (set depth_read='one_shot').
      depth_query_input=False,   # query += W RMSNorm(latest source) / sqrt(d), W: d x d
      depth_normalizer='softmax',  # 'softmax' | 'sigmoid'
      depth_key_norm=True,       # False: logits from the raw sources
      depth_mixing='attention',  # 'attention' | 'scalars' (DenseFormer-style weights)
      depth_window=0,            # > 0: the embedding + the last W sources only
      depth_heads=1,             # > 1: per channel-group depth weights
      # Hyper-Connections ('hc', Zhu et al.) and mHC ('mhc', DeepSeek): see
      # docs/comparators.md. m residual streams; the input-dependent (dynamic) part of
      # the mixing weights on or off; Sinkhorn-Knopp iterations of mHC's projection.
      hc_streams=4,
      hc_dynamic=True,
      sinkhorn_iters=20,
  ))
  cfg.update(overrides)
  return cfg


# Fields that choose how the same function is computed, not which function.
EXECUTION_FIELDS = ('scan_layers', 'remat', 'linear_memory_backward', 'depth_read',
                    'schedule_layers')


def num_sublayers(cfg) -> int:
  return 2 * cfg.num_layers


def effective_block_size(cfg) -> int:
  """S in sublayers: 1 for Full, the configured size for Block."""
  if cfg.residual == 'full':
    return 1
  return cfg.block_size


def validate_model_config(cfg) -> None:
  """Raises ValueError with a readable message for an invalid model config."""

  def fail(message):
    raise ValueError(f'Invalid model config: {message}')

  for name in ('vocab_size', 'd_model', 'num_layers', 'num_heads', 'mlp_dim'):
    value = cfg.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
      fail(f'{name} must be a positive integer, got {value!r}.')
  if cfg.residual not in RESIDUAL_MODES:
    fail(f'residual must be one of {RESIDUAL_MODES}, got {cfg.residual!r}.')
  if cfg.residual == 'block':
    size = cfg.block_size
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
      fail(
          f'block_size is the number of sublayers per AttnRes block and must be an '
          f'integer >= 1, got {size!r} (1 = Full AttnRes; >= 2 * num_layers = one '
          'block).'
      )
  if cfg.d_model % cfg.num_heads:
    fail(
        f'num_heads={cfg.num_heads} does not divide d_model={cfg.d_model}.'
    )
  if (cfg.d_model // cfg.num_heads) % 2:
    fail(
        f'head dim d_model / num_heads = {cfg.d_model // cfg.num_heads} must be '
        'even for rotary embeddings.'
    )
  for name in ('dtype', 'param_dtype'):
    if cfg.get(name) not in DTYPES:
      fail(f'{name} must be one of {DTYPES}, got {cfg.get(name)!r}.')
  if cfg.depth_read not in DEPTH_READS:
    fail(f'depth_read must be one of {DEPTH_READS}, got {cfg.depth_read!r}.')
  if cfg.depth_normalizer not in DEPTH_NORMALIZERS:
    fail(f'depth_normalizer must be one of {DEPTH_NORMALIZERS}, got '
         f'{cfg.depth_normalizer!r}.')
  if cfg.depth_mixing not in DEPTH_MIXINGS:
    fail(f'depth_mixing must be one of {DEPTH_MIXINGS}, got {cfg.depth_mixing!r}.')
  if not isinstance(cfg.depth_window, int) or cfg.depth_window < 0:
    fail(f'depth_window must be an integer >= 0 (0 = no window), got '
         f'{cfg.depth_window!r}.')
  if (not isinstance(cfg.depth_heads, int) or cfg.depth_heads < 1
      or cfg.d_model % cfg.depth_heads):
    fail(f'depth_heads must be a positive divisor of d_model={cfg.d_model}, got '
         f'{cfg.depth_heads!r}.')
  variants = depth_variant_fields(cfg)
  if variants and cfg.residual != 'standard' and cfg.depth_read == 'two_phase':
    fail(f'depth_read="two_phase" computes the paper\'s softmax read only; the '
         f'ablations {variants} use the one-shot read: set depth_read="one_shot".')
  layers = cfg.get('schedule_layers', 0)
  if (not isinstance(layers, int) or isinstance(layers, bool) or layers < 0
      or layers > cfg.num_layers):
    fail(f'schedule_layers must be an integer in [0, num_layers={cfg.num_layers}] '
         f'(0 = automatic), got {layers!r}.')
  if (cfg.residual == 'block' and layers and layers < cfg.num_layers
      and (2 * layers) % cfg.block_size):
    fail(f'schedule_layers={layers} layers ({2 * layers} sublayers) does not cover '
         f'whole blocks of block_size={cfg.block_size} sublayers; use a multiple of '
         f'{cfg.block_size // 2 if cfg.block_size % 2 == 0 else cfg.block_size} '
         'layers, num_layers, or 0.')
  if cfg.residual in HYPER_CONNECTIONS:
    streams, iters = cfg.get('hc_streams'), cfg.get('sinkhorn_iters')
    if not isinstance(streams, int) or isinstance(streams, bool) or streams < 1:
      fail(f'hc_streams is the number of residual streams (expansion rate m) and must '
           f'be an integer >= 1, got {streams!r}.')
    if not isinstance(cfg.get('hc_dynamic'), bool):
      fail(f'hc_dynamic must be True or False, got {cfg.get("hc_dynamic")!r}.')
    if (cfg.residual == 'mhc' and (not isinstance(iters, int) or isinstance(iters, bool)
                                   or iters < 1)):
      fail(f'sinkhorn_iters must be an integer >= 1, got {iters!r}.')
    if variants:
      fail(f'the depth-read ablations {variants} apply to AttnRes, not to '
           f'residual={cfg.residual!r}.')
  if cfg.remat not in REMAT_POLICIES:
    fail(f'remat must be one of {REMAT_POLICIES}, got {cfg.remat!r}.')
  for name in ('norm_eps', 'attn_res_eps'):
    if not cfg.get(name, 0) > 0:
      fail(f'{name} must be > 0, got {cfg.get(name)!r}.')
  if not cfg.rope_theta > 0:
    fail(f'rope_theta must be > 0, got {cfg.rope_theta!r}.')
