"""A decoder-only Transformer LM whose residual connection is a plug-in.

One Transformer body for every residual mode (`cfg.residual`: standard, Full and Block
AttnRes, HC, mHC, or any registered in `residuals.registry`): the model is a
`DepthStack` of `TransformerLayer`s (attention, MLP) with an embedding in front and a
head behind; it builds its residual once (`Transformer.residual`), and the residual
alone decides the depth state that travels between sublayers (the stream, the AttnRes
buffer of sources, HC's streams), how each sublayer's input is read from it and its
output written to it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from attnres_jax import config as config_lib
from attnres_jax.kernels import attention as attention_lib
from attnres_jax.models.depth_stack import DepthStack
from attnres_jax.nn import kv_cache
from attnres_jax.nn import ops
from attnres_jax.nn import remat
from attnres_jax.nn import sharding
from attnres_jax.nn import stack as stack_lib

Array = jax.Array

ATTENTION, MLP = 0, 1  # the two sublayers of a Transformer layer, in order


def _param(init, shape, axes, rngs=None, dtype=jnp.float32) -> nnx.Param:
  """A parameter with logical axis names (mapped to a mesh in `nn/sharding.py`)."""
  value = init(rngs.params(), shape, dtype) if rngs is not None else init(shape, dtype)
  return nnx.Param(value, out_sharding=axes, eager_sharding=False)


def _dtype(name: str):
  return jnp.dtype(name)


class RMSNorm(nnx.Module):
  """RMSNorm with a learned gain, computed in float32."""

  def __init__(self, dim: int, *, eps: float, param_dtype):
    self.eps = eps
    self.scale = _param(jnp.ones, (dim,), ('embed',), dtype=param_dtype)

  def __call__(self, x: Array) -> Array:
    return _rms_norm(x, self.scale[...], self.eps)


@functools.partial(jax.checkpoint, static_argnums=(2,), prevent_cse=False)
def _rms_norm(x: Array, scale: Array, eps: float) -> Array:
  """Checkpointed: autodiff keeps x in its own dtype (bfloat16 in training) and
  reruns the rest, not the float32 copies of x and of the normed x that the products
  need. Without CSE barriers, so that the rerun fuses with its neighbours; the norms
  run in loops, where XLA cannot merge the rerun back into the forward (bench/aot.py
  d1024 v5p:2x2x1, the standard step: 46.82 -> 43.53 ms, temp 12.01 -> 10.77 GiB;
  44.29 ms with the barriers)."""
  normed = x.astype(jnp.float32) * ops.rms_inverse(x, eps)[..., None]
  return (normed * ops.lead(scale.astype(jnp.float32), x.ndim)).astype(x.dtype)


def rotary_embedding(x_BTNH: Array, positions_BT: Array, theta: float) -> Array:
  """Rotary position embedding (rotate-half form), computed in float32."""
  head_dim = x_BTNH.shape[-1]
  frequencies = theta ** (-jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
  angles_BTH = positions_BT[..., None].astype(jnp.float32) * frequencies[None, None]
  sin, cos = jnp.sin(angles_BTH)[:, :, None, :], jnp.cos(angles_BTH)[:, :, None, :]
  x1, x2 = jnp.split(x_BTNH.astype(jnp.float32), 2, axis=-1)
  rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return rotated.astype(x_BTNH.dtype)


class Attention(nnx.Module):
  """Causal multi-head self-attention with RoPE."""

  def __init__(self, cfg, *, rngs: nnx.Rngs):
    d, n = cfg.d_model, cfg.num_heads
    h = d // n
    pdt = _dtype(cfg.param_dtype)
    init = nnx.initializers.variance_scaling(
      1.0, 'fan_in', 'normal', in_axis=0, out_axis=(1, 2)
    )
    out_init = nnx.initializers.variance_scaling(
      1.0, 'fan_in', 'normal', in_axis=(0, 1), out_axis=2
    )
    self.query = _param(init, (d, n, h), ('embed', 'heads', 'head_dim'), rngs, pdt)
    self.key = _param(init, (d, n, h), ('embed', 'heads', 'head_dim'), rngs, pdt)
    self.value = _param(init, (d, n, h), ('embed', 'heads', 'head_dim'), rngs, pdt)
    self.out = _param(out_init, (n, h, d), ('heads', 'head_dim', 'embed'), rngs, pdt)
    self.rope_theta = cfg.rope_theta
    self.dtype = _dtype(cfg.dtype)
    self.kernel = cfg.attention  # kernels/attention.py

  def __call__(
    self,
    x_BTD: Array,
    positions_BT: Array,
    cache: kv_cache.KVCache | None = None,
    cache_index=None,
    start_B=None,
  ):
    """Self-attention; with a cache (decoding), writes this call's keys and values at
    `cache_index` and attends over the cache (`kv_cache.cached_attention`).

    Returns the output, and the updated cache when one is given.
    """
    x_BTD = x_BTD.astype(self.dtype)

    def project(w, what):  # a matmul output that remat='minimal' keeps
      y_BTNH = jnp.einsum('btd,dnh->btnh', x_BTD, w[...].astype(self.dtype))
      return remat.name(sharding.constrain(y_BTNH, attention_lib.QKV_AXES), what)

    q_BTNH = rotary_embedding(project(self.query, 'query'), positions_BT, self.rope_theta)
    k_BTNH = rotary_embedding(project(self.key, 'key'), positions_BT, self.rope_theta)
    v_BTNH = project(self.value, 'value')
    if cache is None:
      out_BTNH = attention_lib.causal_attention(q_BTNH, k_BTNH, v_BTNH, self.kernel)
      out_BTNH = remat.name(out_BTNH, 'attention')
      out_BTD = jnp.einsum('btnh,nhd->btd', out_BTNH, self.out[...].astype(self.dtype))
    else:
      out_BTNH, cache = kv_cache.cached_attention(
        q_BTNH, k_BTNH, v_BTNH, cache, cache_index, start_B
      )
      # One [B T, N H] x [N H, D] dot: as an einsum over (n, h), XLA transposed the
      # (large) weight to the (small) activation's order every step.
      b, t, n, h = out_BTNH.shape
      out_BTD = out_BTNH.reshape(b, t, n * h) @ self.out[...].astype(self.dtype).reshape(
        n * h, -1
      )
    out_BTD = sharding.constrain(out_BTD, sharding.HIDDEN)
    return out_BTD if cache is None else (out_BTD, cache)


class SwiGLU(nnx.Module):
  """The gated MLP: down(silu(gate(x)) * up(x))."""

  def __init__(self, cfg, *, rngs: nnx.Rngs):
    d, f = cfg.d_model, cfg.mlp_dim
    pdt = _dtype(cfg.param_dtype)
    init = nnx.initializers.lecun_normal()
    self.gate = _param(init, (d, f), ('embed', 'mlp'), rngs, pdt)
    self.up = _param(init, (d, f), ('embed', 'mlp'), rngs, pdt)
    self.down = _param(init, (f, d), ('mlp', 'embed'), rngs, pdt)
    self.dtype = _dtype(cfg.dtype)

  def __call__(self, x_BTD: Array) -> Array:
    x_BTD = x_BTD.astype(self.dtype)
    hidden = lambda w, what: remat.name(
      sharding.constrain(x_BTD @ w[...].astype(self.dtype), ('batch', 'length', 'mlp')),
      what,
    )
    gated = jax.nn.silu(hidden(self.gate, 'mlp_gate')) * hidden(self.up, 'mlp_up')
    out_BTD = gated @ self.down[...].astype(self.dtype)
    return sharding.constrain(out_BTD, sharding.HIDDEN)


class TransformerLayer(nnx.Module):
  """Two PreNorm sublayers (attention, MLP), following the layer contract
  (`nn/layer_contract.py`); the stack adds the parameters that the residual uses
  around them (`residual`: e.g. AttnRes pseudo-queries and key gains; None for the
  standard residual)."""

  def __init__(self, cfg, *, rngs: nnx.Rngs):
    pdt = _dtype(cfg.param_dtype)
    self.attention_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps, param_dtype=pdt)
    self.attention = Attention(cfg, rngs=rngs)
    self.mlp_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps, param_dtype=pdt)
    self.mlp = SwiGLU(cfg, rngs=rngs)

  def sublayer(
    self,
    which: int,
    h_BTD: Array,
    positions_BT: Array,
    cache: kv_cache.KVCache | None = None,
    cache_index=None,
    start_B=None,
  ):
    """f(h): the raw output of the attention (0) or MLP (1) sublayer.

    With a KV cache (decoding), the attention sublayer returns (output, new cache).
    """
    return self.sublayer_body(
      which, self.sublayer_norm(which, h_BTD), positions_BT, cache, cache_index, start_B
    )

  def sublayer_norm(self, which: int, h_BTD: Array) -> Array:
    """The first half of `sublayer`: its PreNorm."""
    return (self.attention_norm if which == ATTENTION else self.mlp_norm)(h_BTD)

  def sublayer_body(
    self,
    which: int,
    normed_BTD: Array,
    positions_BT: Array,
    cache: kv_cache.KVCache | None = None,
    cache_index=None,
    start_B=None,
  ):
    """The second half of `sublayer`: attention or MLP on its normed input."""
    if which == ATTENTION:
      return self.attention(normed_BTD, positions_BT, cache, cache_index, start_B)
    return self.mlp(normed_BTD)


class Transformer(DepthStack):
  """The language model. `residual` in the config picks the residual mode. A
  `DepthStack` of `TransformerLayer`s (`layers`, `residual`, `final_residual`,
  `final_read`, `run_depth` are the stack's)."""

  def __init__(self, cfg, *, rngs: nnx.Rngs):
    cfg = config_lib.ModelConfig.from_config(cfg)  # validates
    pdt = _dtype(cfg.param_dtype)
    d = cfg.d_model
    # Std 1/sqrt(d): tied logits h.E start with unit variance after the final norm.
    embed_init = nnx.initializers.normal(stddev=d**-0.5)
    self.embedding = _param(
      embed_init, (cfg.vocab_size, d), ('vocab', 'embed'), rngs, pdt
    )
    super().__init__(cfg, TransformerLayer, cfg, rngs=rngs)
    self.final_norm = RMSNorm(d, eps=cfg.norm_eps, param_dtype=pdt)
    if not cfg.tie_embeddings:
      self.lm_head = _param(
        nnx.initializers.lecun_normal(),
        (d, cfg.vocab_size),
        ('embed', 'vocab'),
        rngs,
        pdt,
      )

  # -- pieces shared by training, analysis and decoding ------------------------------

  def embed(self, tokens_BT: Array) -> Array:
    # The lookup reads the whole table (gathered on a mesh, as FSDP does for weights).
    table_VD = sharding.constrain(self.embedding[...], (None, None))
    x_BTD = jnp.take(table_VD, tokens_BT, axis=0).astype(_dtype(self.cfg.dtype))
    return sharding.constrain(x_BTD, sharding.HIDDEN)

  def head(self, h_BTD: Array) -> Array:
    x_BTD = self.final_norm(h_BTD)
    dtype = _dtype(self.cfg.dtype)
    if self.cfg.tie_embeddings:
      w_DV = self.embedding[...].astype(dtype).T
    else:
      w_DV = self.lm_head[...].astype(dtype)
    logits_BTV = jnp.einsum(
      'btd,dv->btv', x_BTD.astype(dtype), w_DV, preferred_element_type=jnp.float32
    )
    return sharding.constrain(logits_BTV, ('batch', 'length', 'vocab'))

  def init_cache(self, batch_size: int, max_length: int) -> tuple[kv_cache.KVCache, ...]:
    """An empty KV cache: one `KVCache` per layer, `max_length` slots each."""
    cfg = self.cfg
    n, h = cfg.num_heads, cfg.d_model // cfg.num_heads
    dtype = _dtype(cfg.dtype)
    return tuple(
      kv_cache.KVCache(
        jnp.zeros((batch_size, n, h, max_length), dtype),
        jnp.zeros((batch_size, n, max_length, h), dtype),
      )
      for _ in range(cfg.num_layers)
    )

  def decoding_layers(self) -> tuple[nnx.State, ...]:
    """The layers' parameters one state per layer (a copy, made once): passed to a
    jitted `decode` as `layers`, every weight is its own buffer, which the dots read
    in place; slicing the stacked parameters inside the step copies them every token."""
    _, layer_state = nnx.split(self.layers)
    return tuple(
      jax.tree.map(lambda x, i=i: x[i], layer_state) for i in range(self.cfg.num_layers)
    )

  def decode(
    self,
    tokens_BT: Array,
    cache: tuple[kv_cache.KVCache, ...],
    cache_index,
    start_B: Array | None = None,
    layers: tuple[nnx.State, ...] | None = None,
  ) -> tuple[Array, tuple[kv_cache.KVCache, ...]]:
    """Logits for the tokens in cache slots cache_index .. cache_index + T - 1, using
    and extending the KV cache: a prompt prefill or a chunk of it (T > 1) or one
    generation step (T = 1).

    `start_B`: the first slot of each row's sequence (left padding before it; default
    0). Positions count from it. `layers`: `decoding_layers()` (default: sliced from
    the stacked parameters here). The depth state is per token, so nothing about
    depth is cached across positions.
    """
    batch, num_new = tokens_BT.shape
    if start_B is None:
      start_B = jnp.zeros((batch,), jnp.int32)
    positions_BT = (cache_index + jnp.arange(num_new))[None, :] - start_B[:, None]
    graphdef, layer_state = nnx.split(self.layers)
    if layers is None:
      layers = tuple(
        jax.tree.map(lambda x, i=i: x[i], layer_state) for i in range(self.cfg.num_layers)
      )
    carry, cache = stack_lib.apply_layers_cached(
      self.residual,
      graphdef,
      layers,
      self.embed(tokens_BT),
      positions_BT,
      cache,
      cache_index,
      start_B,
      cfg=self.cfg,
    )
    h_BTD, _ = self.final_read(carry)
    return self.head(h_BTD), cache

  def __call__(self, tokens_BT: Array, positions_BT: Array | None = None, **stats):
    """Logits [B, T, V] in float32; with `collect_stats=True`, also per-sublayer
    statistics (`forward_embeddings`, whose keyword arguments `stats` are)."""
    return self.forward_embeddings(self.embed(tokens_BT), positions_BT, **stats)

  def forward_embeddings(
    self,
    x_BTD: Array,
    positions_BT: Array | None = None,
    *,
    collect_stats: bool = False,
    stats_weights_BT: Array | None = None,
  ):
    """The model from token embeddings on (e.g. to differentiate wrt the inputs).

    With `collect_stats`, also the per-sublayer statistics of `run_depth`.
    """
    out = self.run_depth(
      x_BTD,
      positions_BT,
      collect_stats=collect_stats,
      stats_weights_BT=stats_weights_BT,
    )
    h_BTD, stats = out if collect_stats else (out, None)
    logits_BTV = self.head(h_BTD)
    return (logits_BTV, stats) if collect_stats else logits_BTV


def convert_standard_to_attnres(standard_model: Transformer, attnres_cfg) -> Transformer:
  """A Full/Block model computing the standard model's function (up to RMSNorm eps).

  The shared weights are copied and the AttnRes parameters keep their initial values
  (zero queries, unit gains), so every read is the mean of its sources, which sum to
  the standard residual stream, and PreNorm removes the scale (`docs/method.md`, E2).
  """
  attnres_cfg = config_lib.ModelConfig.from_config(attnres_cfg)
  for name, value in standard_model.cfg.to_dict().items():
    requested = getattr(attnres_cfg, name)
    if (
      name not in ('residual', 'block_size') + config_lib.EXECUTION_FIELDS
      and requested != value
    ):
      raise ValueError(
        f'Cannot convert: config field {name!r} differs '
        f'({value!r} in the standard model, {requested!r} requested).'
      )
  target = Transformer(attnres_cfg, rngs=nnx.Rngs(0))
  nnx.update(target, nnx.state(standard_model, nnx.Param))
  return target


def count_params(model: nnx.Module) -> int:
  return sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
