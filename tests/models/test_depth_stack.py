"""`DepthStack` over a user's own layers (attnres_jax/models/depth_stack.py): the
example of docs/extending.md, run as it stands there, trains; its gradients equal
those of the method's one-shot reads in plain jnp (`residuals/attnres/method.py`);
Block with S = 1 equals Full; the layer contract is checked before anything is built.
"""

import dataclasses
import pathlib
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import attnres_jax as ar
from attnres_jax.residuals.attnres import method

from conftest import randomize_depth_params

DOC = pathlib.Path(__file__).parents[2] / 'docs' / 'extending.md'
SECTION = '## AttnRes over your own layers'
WIDTH, NUM_LAYERS, PER_LAYER = 16, 3, 3


def doc_blocks():
  """The Python blocks of the section, in order."""
  text = DOC.read_text()
  section = text[text.index(SECTION) :]
  section = section[: section.index('\n## ', len(SECTION))]
  return re.findall(r'```python\n(.*?)```', section, flags=re.DOTALL)


@pytest.fixture(scope='module')
def example():
  """The namespace of the section's first block: the layer, the model, the config."""
  namespace = {}
  exec(compile(doc_blocks()[0], str(DOC), 'exec'), namespace)  # pylint: disable=exec-used
  return namespace


def test_the_docs_example_trains(example):
  blocks = doc_blocks()
  assert len(blocks) == 2
  exec(compile(blocks[1], str(DOC), 'exec'), example)  # pylint: disable=exec-used
  losses = example['losses']
  assert np.all(np.isfinite(losses))
  # Adam at 1e-2 on one repeated batch of 4 x 16 tokens: the loss falls every run.
  assert losses[-1] < losses[0] - 0.1, losses


def make_stack(example, residual='block', block_size=2, **overrides):
  cfg = ar.StackConfig(
    d_model=WIDTH,
    num_layers=NUM_LAYERS,
    sublayers_per_layer=PER_LAYER,
    residual=residual,
    block_size=block_size,
    **overrides,
  )
  stack = ar.DepthStack(cfg, example['MixerLayer'], WIDTH, 2 * WIDTH, rngs=nnx.Rngs(0))
  return randomize_depth_params(stack)


def method_final_read(stack, x_BTD):
  """The stack as the method states it: a list of L n sublayers, one-shot reads."""
  graphdef, state = nnx.split(stack.layers)
  positions_BT = jnp.broadcast_to(jnp.arange(x_BTD.shape[1]), x_BTD.shape[:2])
  sublayers = []
  for k in range(NUM_LAYERS):
    layer = nnx.merge(graphdef, jax.tree.map(lambda x, k=k: x[k], state))
    for which in range(PER_LAYER):
      sublayers.append(
        lambda h, layer=layer, which=which: layer.sublayer_body(
          which, layer.sublayer_norm(which, h), positions_BT
        )
      )
  rows = lambda name: jnp.concatenate(
    [
      getattr(stack.layers.residual, name)[...].reshape(NUM_LAYERS * PER_LAYER, -1),
      getattr(stack.final_residual, name)[...][None],
    ]
  )
  return method.block_attnres(
    sublayers,
    x_BTD,
    rows('query'),
    rows('gain'),
    block_size=stack.residual.block_size,
    eps=stack.cfg.attn_res_eps,
  )


def loss_and_grads(stack, x_BTD, read):
  """A loss of the final read that weighs every channel and token differently, and
  its gradients with respect to the stack's parameters and the inputs."""
  w_BTD = jnp.sin(jnp.arange(x_BTD.size, dtype=jnp.float32)).reshape(x_BTD.shape)
  graphdef, params = nnx.split(stack)

  def loss(params, x_BTD):
    return jnp.sum(w_BTD * read(nnx.merge(graphdef, params), x_BTD))

  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(params, x_BTD)


@pytest.mark.parametrize('residual,block_size', [('full', 1), ('block', 2)])
def test_gradients_equal_the_methods_one_shot_reads(example, residual, block_size):
  """Through the two-phase block schedule and the linear-memory backward (the
  stack's own path) against autodiff of the method's Python loop. Full: segments of
  1 layer; Block S=2 over 3 sublayers a layer: blocks straddle layers, a segment of
  2 layers (3 blocks) and a last, shorter one."""
  stack = make_stack(example, residual, block_size)
  assert stack.layers.residual.query.shape == (NUM_LAYERS, PER_LAYER, WIDTH)
  assert stack.residual.custom_stack is not None  # the linear-memory backward runs
  x_BTD = jax.random.normal(jax.random.key(3), (2, 8, WIDTH))
  loss, grads = loss_and_grads(stack, x_BTD, lambda s, x: s(x))
  expected_loss, expected_grads = loss_and_grads(stack, x_BTD, method_final_read)
  # float32 throughout; the schedule sums the same terms in another order (online
  # softmax, a buffer of block sums) through 9 sublayers: a few ulps a step, ~1e-6
  # relative seen on these gradients of magnitude ~1-10.
  np.testing.assert_allclose(loss, expected_loss, rtol=1e-5)
  chex.assert_trees_all_close(grads, expected_grads, rtol=2e-5, atol=2e-5)


def test_block_size_one_equals_full(example):
  full = make_stack(example, 'full', 1)
  block = make_stack(example, 'block', 1)
  chex.assert_trees_all_equal(nnx.state(full), nnx.state(block))
  x_BTD = jax.random.normal(jax.random.key(4), (2, 8, WIDTH))
  read = lambda s, x: s(x)
  # The same schedule, one slot per sublayer: equal to float32 rounding (E1).
  chex.assert_trees_all_close(
    loss_and_grads(block, x_BTD, read),
    loss_and_grads(full, x_BTD, read),
    rtol=1e-6,
    atol=1e-6,
  )


@pytest.mark.parametrize('residual', ['standard', 'rezero', 'hc'])
def test_other_residuals_run_n_sublayers_a_layer(example, residual):
  """A residual's per-layer parameters have one row per sublayer; the standard
  residual is h + f(h) over every sublayer in order."""
  stack = make_stack(example, residual, hc_streams=2)
  x_BTD = jax.random.normal(jax.random.key(5), (2, 8, WIDTH))
  h_BTD = stack(x_BTD)
  assert h_BTD.shape == x_BTD.shape and np.all(np.isfinite(h_BTD))
  if residual == 'standard':
    graphdef, state = nnx.split(stack.layers)
    expected = x_BTD
    for k in range(NUM_LAYERS):
      layer = nnx.merge(graphdef, jax.tree.map(lambda x, k=k: x[k], state))
      for which in range(PER_LAYER):
        expected = expected + layer.sublayer_body(
          which, layer.sublayer_norm(which, expected), None
        )
    # float32, the same additions in the same order; scan against a loop.
    np.testing.assert_allclose(h_BTD, expected, rtol=1e-6, atol=1e-6)
  else:
    rows = jax.tree.leaves(nnx.state(stack.layers.residual))
    assert rows and all(leaf.shape[:2] == (NUM_LAYERS, PER_LAYER) for leaf in rows)


def test_a_layer_without_a_contract_method_is_one_error_before_anything_is_built(
  example,
):
  built = []

  class NoBody(nnx.Module):
    def __init__(self, *, rngs):
      built.append(True)

    def sublayer_norm(self, which, h_BTD):
      return h_BTD

  cfg = ar.StackConfig(d_model=WIDTH, num_layers=2, sublayers_per_layer=3)
  with pytest.raises(TypeError, match=r"NoBody .* no method 'sublayer_body'.*contract"):
    ar.DepthStack(cfg, NoBody, rngs=nnx.Rngs(0))
  assert not built


def test_stack_config_is_validated_and_shares_the_model_configs_fields():
  with pytest.raises(ValueError, match='sublayers_per_layer must be a positive'):
    ar.StackConfig(sublayers_per_layer=0)
  with pytest.raises(ValueError, match='residual must be one of'):
    ar.StackConfig(residual='nonsense')
  with pytest.raises(ValueError, match=r'schedule_layers=1 layers \(3 sublayers\)'):
    ar.StackConfig(sublayers_per_layer=3, block_size=2, schedule_layers=1)
  model_fields = ar.ModelConfig.__dataclass_fields__
  for field in dataclasses.fields(ar.StackConfig):
    if field.name != 'sublayers_per_layer':
      assert field.default == model_fields[field.name].default, field.name
  hash(ar.StackConfig())
