"""The decoding step lowered for a TPU topology on abstract inputs (`aot`'s decode
row, `bench/decode_aot.py`): one token per row against a KV cache, the weights sharded
as training shards them."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from attnres_jax.inference import sampling
from attnres_jax.models import transformer as model_lib
from attnres_jax.nn import kv_cache
from attnres_jax.nn import sharding


def _structs(tree, shardings):
  return jax.tree.map(
    lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings
  )


def decode_lowered(config, mesh, rules, weights_dtype=None):
  """`sampling`'s one-token step lowered on abstract inputs for a batch of
  `train.batch_size` rows and a cache of `train.seq_len` slots: the parameters sharded
  as training shards them, each layer's as its slice of the stack, the weight matrices
  cast to `weights_dtype` when given (`sampling.serving_state`)."""
  cfg, rows, slots = config.model, config.train.batch_size, config.train.seq_len
  abstract = nnx.eval_shape(lambda: model_lib.Transformer(cfg, rngs=nnx.Rngs(0)))
  graphdef, abstract_state = nnx.split(abstract)
  specs = sharding.param_shardings(abstract_state, mesh, rules)  # a pure dict

  def served(state):
    _, state, layers = sampling.serving_state(nnx.merge(graphdef, state), weights_dtype)
    return nnx.to_pure_dict(state), tuple(nnx.to_pure_dict(x) for x in layers)

  state_dict, layer_dicts = jax.eval_shape(served, abstract_state)
  layer_specs = jax.tree.map(
    lambda s: NamedSharding(mesh, P(*s.spec[1:])), specs['layers']
  )
  state = jax.tree.map(lambda x: x, abstract_state)
  nnx.replace_by_pure_dict(state, _structs(state_dict, specs))
  layers = []
  for layer_dict in layer_dicts:
    layer = jax.tree.map(lambda x: x, nnx.split(abstract.layers)[1])
    nnx.replace_by_pure_dict(layer, _structs(layer_dict, layer_specs))
    layers.append(layer)

  def placed(shape, dtype, axes):
    spec = sharding.logical_to_spec(axes, rules, mesh=mesh, shape=shape)
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))

  cache = tuple(
    kv_cache.KVCache(
      placed(c.keys_BNHS.shape, c.keys_BNHS.dtype, kv_cache.KEYS_AXES),
      placed(c.values_BNSH.shape, c.values_BNSH.dtype, kv_cache.VALUES_AXES),
    )
    for c in jax.eval_shape(lambda: abstract.init_cache(rows, slots))
  )
  row = placed((rows,), jnp.int32, ('batch',))
  replicated = NamedSharding(mesh, P())
  scalar = lambda dtype: jax.ShapeDtypeStruct((), dtype, sharding=replicated)
  key = jax.eval_shape(lambda: jax.random.PRNGKey(0))
  args = (
    state,
    tuple(layers),
    row,
    cache,
    scalar(jnp.int32),
    row,
    jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=replicated),
    scalar(jnp.float32),
    scalar(jnp.int32),
    jax.ShapeDtypeStruct((1,), jnp.int32, sharding=replicated),
    placed((rows,), jnp.bool_, ('batch',)),
  )
  with sharding.logical_rules(mesh, rules):  # traced here: constrain as in serving
    return sampling._step.lower(graphdef, *args)  # pylint: disable=protected-access
