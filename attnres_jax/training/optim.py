"""The optimiser: AdamW with warmup + cosine / WSD / constant schedules, global-norm
clipping and a weight-decay mask.

No weight decay on norm gains (`scale`) and on the residual parameters that the
model's residual declares (`Residual.no_decay`: e.g. AttnRes pseudo-queries and
key-norm gains, whose decay pulls the depth weights back to uniform and the gains
towards zero rather than one, neither of which is regularisation); embeddings are
decayed only if `decay_embeddings` is set. The mask reads the model config, so a
residual's `no_decay` names spare its own parameters only: another residual's
parameter of the same name is decayed.

Gradient accumulation is not done here but in `train.train_step`, as a `lax.scan` over
microbatches inside one jitted step. Unlike `optax.MultiSteps`, one call of the step is
still one optimizer update on one batch from the data iterator, so the schedule,
logging, checkpoints (no half-accumulated gradients in the optimizer state) and
resumption do not depend on the accumulation factor.
"""

from __future__ import annotations


import jax
import ml_collections
import optax

from attnres_jax import config as config_lib
from attnres_jax import residuals


# Parameters (by their own name, the last key of the path) that are never decayed.
NO_DECAY = frozenset({'scale'})
# Within the residual's parameters (`layers/residual`, `final_residual`), the names
# that the model's residual declares in `no_decay` are spared.
RESIDUAL_MODULES = frozenset({'residual', 'final_residual'})
EMBEDDINGS = frozenset({'embedding'})


def learning_rate_schedule(config: ml_collections.ConfigDict) -> optax.Schedule:
  """Linear warmup from 0, then cosine / WSD decay to `min_lr_ratio * peak`, or flat.

  'wsd' (warmup-stable-decay) holds the peak and decays linearly over the last
  `decay_fraction` of `num_steps`.
  """
  peak, warmup, total = config.learning_rate, config.warmup_steps, config.num_steps
  final = peak * config.min_lr_ratio
  warm = optax.linear_schedule(0.0, peak, max(warmup, 1))
  if config.schedule == 'cosine':
    rest = optax.cosine_decay_schedule(
      peak, max(total - warmup, 1), alpha=config.min_lr_ratio
    )
  elif config.schedule == 'wsd':
    decay = max(1, min(total - warmup, round(config.decay_fraction * total)))
    stable = total - warmup - decay
    rest = optax.join_schedules(
      [optax.constant_schedule(peak), optax.linear_schedule(peak, final, decay)], [stable]
    )
  elif config.schedule == 'constant':
    rest = optax.constant_schedule(peak)
  else:
    raise ValueError(
      f'Unknown schedule {config.schedule!r}; available: {config_lib.SCHEDULES}.'
    )
  if warmup == 0:
    return rest
  return optax.join_schedules([warm, rest], [warmup])


def _names(path) -> list[str]:
  """The dict keys of a parameter's path, its own name last."""
  keys = [getattr(k, 'key', getattr(k, 'name', None)) for k in path]
  return [k for k in keys if isinstance(k, str) and k != 'value']


def decay_mask(params, model_config=None, *, decay_embeddings: bool = False):
  """A pytree of bools like `params`: True where weight decay applies.

  `model_config` (a `ModelConfig` or the `model` section) names the residual whose
  `no_decay` is spared. Without it, every registered residual's: exact for an
  optimizer shared by models of the library's residuals, whose names are disjoint
  (a test checks), not for a residual whose names another's spares."""
  excluded = NO_DECAY if decay_embeddings else NO_DECAY | EMBEDDINGS
  if model_config is None:
    residual_no_decay = residuals.no_decay_names()
  else:
    residual_no_decay = residuals.make(model_config).no_decay

  def decayed(path, _):
    names = _names(path) or ['']
    if RESIDUAL_MODULES.intersection(names[:-1]) and names[-1] in residual_no_decay:
      return False
    return names[-1] not in excluded

  return jax.tree_util.tree_map_with_path(decayed, params)


def make_optimizer(
  config: ml_collections.ConfigDict, model_config=None
) -> tuple[optax.GradientTransformation, optax.Schedule]:
  """The optax transformation for `config` (the `train` section) and its schedule.
  `model_config`: the model's, whose residual's `no_decay` the mask spares (see
  `decay_mask`; every entry point that trains one model passes it)."""
  schedule = learning_rate_schedule(config)
  parts = []
  if config.grad_clip:
    parts.append(optax.clip_by_global_norm(config.grad_clip))
  parts.append(
    optax.adamw(
      schedule,
      b1=config.b1,
      b2=config.b2,
      eps=config.eps,
      weight_decay=config.weight_decay,
      mask=lambda params: decay_mask(
        params, model_config, decay_embeddings=config.decay_embeddings
      ),
    )
  )
  return optax.chain(*parts), schedule
