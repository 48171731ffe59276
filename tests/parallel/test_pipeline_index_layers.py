"""The AttnRes chunk's parameters indexed in the whole layer stack
(`stack.run_layers(index_layers=True)`, what the linear-memory backward and a pipeline
chunk run): the same layers, the same forward pass, bitwise."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from attnres_jax.nn import segments
from attnres_jax.nn import stack
from conftest import tiny_model


def test_index_segment_layers_equals_the_grouped_slices():
  tree = {'w': jnp.arange(6 * 2 * 3.0).reshape(6, 2, 3), 'b': jnp.arange(6.0)}
  grouped, _ = segments.group_segments(tree, 6, 2)

  @jax.jit
  def both(segment):  # a traced segment, as in the scan
    indexed = segments.index_segment_layers(tree, segment, 2)
    sliced = segments.segment_layers_of(jax.tree.map(lambda x: x[segment], grouped), 2)
    return indexed, sliced

  for segment in range(3):
    indexed, sliced = both(segment)
    for a, b in zip(jax.tree.leaves(indexed), jax.tree.leaves(sliced)):
      np.testing.assert_array_equal(a, b)


def test_run_layers_indexing_the_stack_is_bitwise_the_same():
  # Block S=4 over 4 layers: segments of 2 layers, so each segment's scan step takes
  # two layers of the stack (and Full: one layer a segment, four steps).
  for residual_name, block_size in (('block', 4), ('full', 1)):
    model = tiny_model(residual_name, block_size, random_depth=True, num_layers=4)
    residual = model.residual
    graphdef, state = nnx.split(model.layers)
    x_BTD = jax.random.normal(jax.random.key(3), (2, 5, model.cfg.d_model))
    positions_BT = jnp.broadcast_to(jnp.arange(5), (2, 5))

    def run(index_layers, state=state, residual=residual, graphdef=graphdef, x=x_BTD):
      carry, _ = stack.run_layers(
        residual,
        graphdef,
        state,
        x,
        positions_BT,
        cfg=model.cfg,
        index_layers=index_layers,
      )
      return carry

    grouped, indexed = (jax.jit(run, static_argnums=0)(flag) for flag in (False, True))
    for a, b in zip(jax.tree.leaves(indexed), jax.tree.leaves(grouped)):
      np.testing.assert_array_equal(a, b)
