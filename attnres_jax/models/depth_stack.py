"""AttnRes (or any registered residual) over your own layers.

`DepthStack(cfg, MyLayer, *args, rngs=rngs, **kwargs)` builds `cfg.num_layers` layers
`MyLayer(*args, rngs=..., **kwargs)` stacked for `jax.lax.scan`, each of
`cfg.sublayers_per_layer` sublayers following the layer contract
(`nn/layer_contract.py`: `sublayer_norm(which, h)`, `sublayer_body(which, normed,
positions)`), checked before anything is built. Called on the inputs x [B, T, D] (an
embedding), it runs every sublayer through the residual of `cfg.residual` and returns
the final read h [B, T, D], the input of a final norm: with AttnRes, through the
block schedule, the linear-memory backward and the Pallas kernels where they apply,
as in the library's `Transformer`, which is a `DepthStack` with an embedding in front
and a head behind (`models/transformer.py`). `docs/extending.md` has an example.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from attnres_jax import config as config_lib
from attnres_jax import residuals
from attnres_jax.nn import layer_contract
from attnres_jax.nn import ops
from attnres_jax.nn import stack as stack_lib

Array = jax.Array
_MODEL_FIELDS = config_lib.ModelConfig.__dataclass_fields__


@dataclasses.dataclass(frozen=True)
class StackConfig:
  """What a residual and the layer stack read: `ModelConfig`'s fields of the same
  names and defaults (see there), less the Transformer's own (vocabulary, heads, MLP
  width, rotary embeddings), plus the sublayers per layer. Frozen and hashable (part
  of the stack's graph definition); validated on construction."""

  d_model: int = 128  # the width D of the inputs and of every sublayer's output
  num_layers: int = 4  # layers L
  sublayers_per_layer: int = 2  # sublayers n of each layer (AttnRes reads n L times)
  residual: str = 'block'  # a registered residual, or a plug-in 'module:Class'
  block_size: int = 2  # S: sublayers per block ('block'; 1 = Full)
  norm_eps: float = 1e-6  # HC/mHC: the streams' RMSNorm epsilon
  attn_res_eps: float = 1e-6  # epsilon of the depth read's key RMSNorm
  dtype: str = 'float32'  # compute dtype of the reads' results
  param_dtype: str = 'float32'  # the residual's parameters
  scan_layers: bool = True  # False: a Python loop over layers (debugging)
  remat: str = 'none'  # a remat policy (nn/remat.py): 'none' | 'minimal' | 'layer' | ...
  schedule_layers: int = 0  # layers per schedule segment (0: per residual)
  depth_dtype: str = ''  # AttnRes depth state storage ('' = the compute dtype)
  depth_kernel: str = 'auto'  # 'auto' (Pallas on TPU where it fits) | 'xla' | 'pallas'
  depth_query_input: bool = False  # the read ablations (ModelConfig's)
  depth_normalizer: str = 'softmax'
  depth_key_norm: bool = True
  depth_mixing: str = 'attention'
  depth_window: int = 0
  depth_heads: int = 1
  hc_streams: int = 4  # 'hc' / 'mhc': residual streams m
  hc_dynamic: bool = True  # 'hc' / 'mhc': input-dependent part of the mixing
  sinkhorn_iters: int = 20  # 'mhc': Sinkhorn-Knopp iterations

  def __post_init__(self):
    for name in ('d_model', 'num_layers', 'sublayers_per_layer'):
      value = getattr(self, name)
      if not residuals.base.is_int(value) or value < 1:
        residuals.base.invalid(f'{name} must be a positive integer, got {value!r}.')
    config_lib.validate_depth_fields(self, residuals.make(self))

  def replace(self, **changes) -> StackConfig:
    return dataclasses.replace(self, **changes)

  @property
  def ablations(self) -> list[str]:
    """The read ablations that differ from the paper's read."""
    return [
      name
      for name in config_lib.ABLATION_FIELDS
      if getattr(self, name) != _MODEL_FIELDS[name].default
    ]


class DepthStack(nnx.Module):
  """L layers of `layer_type` under the residual of `cfg` (a `StackConfig`, or the
  `ModelConfig` of a `Transformer`). Parameters: `layers` (every layer's, stacked on
  a leading 'layers' axis, each with the residual's `layers.residual`) and
  `final_residual` (the final read's)."""

  def __init__(self, cfg, layer_type, *layer_args, rngs: nnx.Rngs, **layer_kwargs):
    layer_contract.check_layer(layer_type)  # before anything is built or traced
    self.cfg = cfg
    # Static (part of the graph definition): a frozen dataclass of the config.
    self.residual = residual = residuals.make(cfg)
    self.layers = layer_contract.make_layers(
      layer_type, cfg.num_layers, rngs, *layer_args, residual=residual, **layer_kwargs
    )
    self.final_residual = residual.final_params()

  def __call__(self, x_BTD: Array, positions_BT: Array | None = None, **stats):
    """The final read h [B, T, D] after every layer, from the inputs x [B, T, D];
    with `collect_stats=True`, also the statistics (`run_depth`)."""
    return self.run_depth(x_BTD, positions_BT, **stats)

  def final_read(self, carry) -> tuple[Array, Array | None]:
    """The input of the final norm from the residual's final state, and the final
    read's per-token weights (AttnRes: depth weights; HC/mHC: stream RMS; else None)."""
    return self.residual.final(carry, self.final_residual)

  def run_depth(
    self,
    x_BTD: Array,
    positions_BT: Array | None = None,
    *,
    collect_stats: bool = False,
    stats_weights_BT: Array | None = None,
  ):
    """The final read h [B, T, D] after the layers, from the inputs x [B, T, D];
    `positions_BT` (default 0 .. T - 1) is handed to every `sublayer_body`.

    With `collect_stats`, also per-sublayer statistics (for analysis): means over
    tokens, weighted by `stats_weights_BT` (default: every token alike), stacked as
    [num_layers, sublayers_per_layer, ...] (the sublayers' input and output RMS, and
    the residual's own, e.g. AttnRes depth weights), plus the final read's
    (`Residual.final_statistics`) and its output's RMS (`final_input_rms`).
    """
    if x_BTD.shape[-1] != self.cfg.d_model:
      raise ValueError(
        f'The stack is {self.cfg.d_model} wide (d_model); its inputs are '
        f'{x_BTD.shape[-1]} wide (shape {x_BTD.shape}).'
      )
    if positions_BT is None:
      positions_BT = jnp.broadcast_to(jnp.arange(x_BTD.shape[1]), x_BTD.shape[:2])
    if collect_stats and stats_weights_BT is None:
      stats_weights_BT = jnp.ones(x_BTD.shape[:2], jnp.float32)
    graphdef, layer_state = nnx.split(self.layers)
    carry, stats = stack_lib.apply_layers(
      self.residual,
      graphdef,
      layer_state,
      x_BTD,
      positions_BT,
      cfg=self.cfg,
      collect_stats=collect_stats,
      stats_weights_BT=stats_weights_BT,
    )
    h_BTD, final_weights = self.final_read(carry)
    if not collect_stats:
      return h_BTD
    mean = functools.partial(
      stack_lib.token_mean, token_weights_BT=stats_weights_BT.astype(jnp.float32)
    )
    stats.update(self.residual.for_statistics().final_statistics(final_weights, mean))
    stats['final_input_rms'] = mean(1.0 / ops.rms_inverse(h_BTD, 0.0))
    return h_BTD, stats
