"""Weight decay per residual: a residual's `no_decay` names spare its own parameters
only (`optim.decay_mask` with the model config), so two residuals whose parameters
share a name each get their own decay."""

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from attnres_jax import residuals
from attnres_jax.models import transformer as model_lib
from attnres_jax.residuals import base
from attnres_jax.residuals import rezero
from attnres_jax.training import optim
from conftest import tiny_model_config, train_config


class Scales(nnx.Module):
  """Two parameters per sublayer, named as AttnRes's pseudo-query and key gain."""

  def __init__(self, cfg):
    dtype = jnp.dtype(cfg.param_dtype)
    self.query = base.param(jnp.ones, (2,), ('sublayers',), dtype)
    self.gain = base.param(jnp.ones, (2,), ('sublayers',), dtype)


@dataclasses.dataclass(frozen=True)
class ScaledResidual(rezero.ReZeroResidual):
  """h <- h + query * gain * f(h), ReZero's carry; decays both of its parameters."""

  no_decay = frozenset()

  def layer_params(self):
    return Scales(self.cfg)

  def write(self, inner, params, per_layer, layer_in_segment, which, out_BTD):
    scale = params.query[...][which] * params.gain[...][which]
    return inner + scale.astype(out_BTD.dtype) * out_BTD


@dataclasses.dataclass(frozen=True)
class SparedGainResidual(ScaledResidual):
  """The same parameters; spares its `gain` alone."""

  no_decay = frozenset({'gain'})


residuals.register('test_decay_scaled', ScaledResidual)
residuals.register('test_decay_spared_gain', SparedGainResidual)


def _spared(residual: str) -> set[str]:
  cfg = tiny_model_config(residual=residual, block_size=2)
  model = model_lib.Transformer(cfg, rngs=nnx.Rngs(0))
  params = nnx.to_pure_dict(nnx.state(model))
  mask = optim.decay_mask(params, cfg)
  # The optimizer applies the mask: with zero gradients only decayed weights move.
  tx, _ = optim.make_optimizer(
    train_config(warmup_steps=0, schedule='constant', weight_decay=0.1), cfg
  )
  zeros = jax.tree.map(jnp.zeros_like, params)
  updates, _ = jax.jit(tx.update)(zeros, tx.init(params), params)
  spared, still = set(), set()
  for (path, decayed), update in zip(
    jax.tree_util.tree_leaves_with_path(mask), jax.tree.leaves(updates)
  ):
    name = '/'.join(k.key for k in path)
    if not decayed:
      spared.add(name)
    if not np.any(update):
      still.add(name)
  assert spared == still
  return {name for name in spared if 'residual' in name}


def test_each_residual_spares_its_own_parameters_only():
  # 'query' and 'gain' under layers/residual in all three models.
  assert _spared('block') == {
    'layers/residual/query',
    'layers/residual/gain',
    'final_residual/query',
    'final_residual/gain',
  }
  assert _spared('test_decay_scaled') == set()
  assert _spared('test_decay_spared_gain') == {'layers/residual/gain'}


def test_the_library_residuals_spare_disjoint_names():
  """Without a model config the mask spares every registered residual's names (an
  optimizer shared by models of several residuals): exact for the library's."""
  library = ('standard', 'full', 'block', 'hc', 'mhc', 'rezero')
  declared = {name: residuals.registry.factory(name).no_decay for name in library}
  for a, b in itertools.combinations(library, 2):
    if residuals.registry.factory(a) is not residuals.registry.factory(b):
      assert not declared[a] & declared[b], (a, b)
