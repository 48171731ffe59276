"""A conformance check for residuals (docs/extending.md): `check_residual(residual)`
runs one, on a tiny model, through what the library does with a residual.

  'declarations'  its config checks, label, statistics figures, FLOPs and I/O
                  declarations (`flops.py` reads them), and carry axes that name every
                  leaf of its carry (the pipeline constrains the carry with them);
  'train'         a few steps of the library's train step: finite losses that fall,
                  its `no_decay` parameters spared weight decay and the others decayed,
                  and a non-zero gradient in some step for every parameter of the
                  residual;
  'evaluate'      `evaluation.evaluate` with the analysis statistics, and the
                  per-sublayer gradient norms;
  'decode'        a cached prefill and one cached step equal to the full forward pass;
  'pipeline'      two train steps pipelined over 2 stages equal to one device (in a
                  child process with 2 CPU devices; skipped, with its reason, where the
                  residual refuses 2-layer chunks).

A failure raises `ConformanceError` naming the residual, the part and what differs;
success returns what was measured. `python -m attnres_jax.testing.conformance NAME`
runs it from a shell (NAME: a registered residual or a plug-in, 'module:Class' or
'file.py:Class'); the pipeline's child is `testing/pipeline_child.py`.
"""

from __future__ import annotations

import functools
import json
import math
import os
import subprocess
import sys
from collections.abc import Iterable
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from flax import nnx

from attnres_jax import config as config_lib
from attnres_jax import flops
from attnres_jax import residuals
from attnres_jax.evaluation import evaluate, plots, statistics
from attnres_jax.models import transformer as model_lib
from attnres_jax.residuals import registry
from attnres_jax.training import optim
from attnres_jax.training import step as train_lib

PARTS = ('declarations', 'train', 'evaluate', 'decode', 'pipeline')
# A model that compiles in seconds on a CPU: 4 layers (2-layer pipeline chunks).
MODEL = dict(vocab_size=64, d_model=16, num_layers=4, num_heads=2, mlp_dim=32)
BATCH, LENGTH = 4, 8
# float32, 10 sublayers: the cached attention and the pipeline's microbatches sum the
# same terms in another order (rounding only); a wrong cache slot, position or stage
# moves the logits and losses by percents.
DECODE_TOLERANCE = 1e-5
PIPELINE_LOSS_RTOL = 1e-5
# The declared forward FLOPs against XLA's count: XLA counts every elementwise op as one
# FLOP and a loop's body once (mHC's Sinkhorn iterations), `forward_flops` follows
# flops.py (a multiply-add is 2, a softmax about d). Declared / counted on the tiny
# model: ReZero 1, Block 0.86, Full 0.74, HC 1.05, mHC 1.57, the toy's 2 (it counts the
# add that the standard residual, subtracted, also does). Forgetting the layers (4x
# here) or the width (16x), or declaring 0, falls outside.
FLOPS_FACTOR = 3.0
# Parameters move by <= lr = 1e-2 a step; rounding of a gradient reaches them scaled by
# lr / eps = 10 (Adam's first steps), and they are O(1) (ulp 1.2e-7).
PIPELINE_PARAM_ATOL = 1e-5


class ConformanceError(AssertionError):
  """A residual does not do what the library expects of it."""


def train_config(**overrides) -> ml_collections.ConfigDict:
  """The optimizer of the check: a constant lr of 1e-2, decay 0.1, and a moderate
  Adam eps that keeps the first steps proportional to the gradient (the pipeline's
  comparison would otherwise amplify float32 rounding of tiny components)."""
  config = ml_collections.ConfigDict(
    dict(
      learning_rate=1e-2,
      warmup_steps=0,
      num_steps=100,
      schedule='constant',
      min_lr_ratio=0.1,
      decay_fraction=0.2,
      grad_clip=1.0,
      b1=0.9,
      b2=0.95,
      eps=1e-3,
      weight_decay=0.1,
      decay_embeddings=False,
    )
  )
  config.update(overrides)
  return config


def toy_batch(batch: int = BATCH, length: int = LENGTH, seed: int = 0):
  tokens = np.random.default_rng(seed).integers(
    1, MODEL['vocab_size'], (batch, length + 1)
  )
  return {
    'inputs': tokens[:, :-1].astype(np.int32),
    'targets': tokens[:, 1:].astype(np.int32),
    'weights': np.ones((batch, length), np.float32),
  }


def residual_name(residual) -> str:
  """The name a config gives `residual`: a registered name or plug-in as given (a
  plug-in is imported), a registered class's name, or an unregistered class registered
  under its plug-in name 'module:Class'."""
  if isinstance(residual, str):
    registry.factory(residual)  # an unknown name or a failing plug-in raises here
    return residual
  for name in residuals.names():
    if registry.factory(name) is residual:
      return name
  name = f'{residual.__module__}:{residual.__qualname__}'
  residuals.register(name, residual)
  return name


def _require(ok, message: str, *, residual: str, part: str) -> None:
  if not ok:
    raise ConformanceError(f'residual {residual!r}, {part}: {message}')


def check_residual(residual, *, parts: Iterable[str] = PARTS, steps: int = 3, **model):
  """Runs `residual` (a name, plug-in or Residual subclass) through `parts` on the
  tiny model `MODEL` with the `model` fields overridden; returns what each measured."""
  parts = tuple(parts)
  unknown = sorted(set(parts) - set(PARTS))
  if unknown:
    raise ValueError(f'Unknown parts {unknown}; the parts are {PARTS}.')
  name = residual_name(residual)
  cfg = config_lib.model_config(**{**MODEL, **model, 'residual': name})
  report: dict[str, Any] = {'residual': name}
  if 'declarations' in parts:
    report['declarations'] = check_declarations(cfg)
  if {'train', 'evaluate', 'decode'} & set(parts):
    trained, report['train'] = check_training(cfg, steps)
    if 'evaluate' in parts:
      report['evaluate'] = check_evaluation(trained)
    if 'decode' in parts:
      report['decode'] = check_decoding(trained)
  if 'pipeline' in parts:
    report['pipeline'] = check_pipeline(cfg)
  return report


def check_declarations(cfg) -> dict[str, Any]:
  residual, name = residuals.make(cfg), cfg.residual
  require = functools.partial(_require, residual=name, part='declarations')
  require(isinstance(residual, residuals.Residual), 'not a residuals.Residual.')
  residual.validate()
  require(isinstance(residual.label, str) and residual.label, 'an empty label.')
  json.dumps(residual.describe())  # an evaluation record holds it
  require(
    set(residual.figures) <= set(plots.FIGURES), f'unknown figures {residual.figures}'
  )
  forward = residual.forward_flops()
  require(math.isfinite(forward) and forward >= 0, f'forward_flops() = {forward}.')
  terms = flops.forward_flops_per_token(cfg, seq_len=LENGTH)
  require(terms['depth_read'] == forward, 'flops.py does not count forward_flops().')
  counted = counted_forward_flops(cfg)
  require(
    forward == counted == 0
    or (counted > 0 and 1 / FLOPS_FACTOR <= forward / counted <= FLOPS_FACTOR),
    f'forward_flops() = {forward} per token, XLA counts {counted} (see FLOPS_FACTOR).',
  )
  read, write = residual.io_per_sublayer()
  require(
    all(math.isfinite(v) and v > 0 for v in (read, write)),
    f'io_per_sublayer() = {(read, write)}: each a positive number of d elements.',
  )
  floor = residual.min_extra_per_sublayer()
  require(
    floor is None or (math.isfinite(floor) and floor >= 0),
    f'min_extra_per_sublayer() = {floor}.',
  )
  x = jax.ShapeDtypeStruct((BATCH, LENGTH, cfg.d_model), jnp.float32)
  carry = jax.eval_shape(residual.init, x)
  is_axes = lambda v: isinstance(v, tuple) and all(isinstance(a, str) for a in v)
  try:
    ranks = jax.tree.map(
      lambda names, leaf: len(names) == leaf.ndim,
      residual.carry_axes(),
      carry,
      is_leaf=is_axes,
    )
  except ValueError as e:
    raise ConformanceError(
      f'residual {name!r}, declarations: carry_axes() is not a tree like the carry '
      f'({jax.tree.structure(carry)}): {e}'
    ) from e
  require(all(jax.tree.leaves(ranks)), 'carry_axes() names a leaf by the wrong rank.')
  return dict(
    forward_flops=forward,
    counted_forward_flops=counted,
    io_per_sublayer=(read, write),
    min_extra_per_sublayer=floor,
    segment_layers=residual.segment_layers,
  )


def counted_forward_flops(cfg) -> float:
  """XLA's count of the forward pass's FLOPs per token, less the standard residual's
  (the layers unrolled: XLA counts a loop's body once); lowered, not compiled."""

  def count(c):
    graphdef, params = nnx.split(
      nnx.eval_shape(lambda: model_lib.Transformer(c, rngs=nnx.Rngs(0)))
    )
    tokens = jax.ShapeDtypeStruct((BATCH, LENGTH), jnp.int32)
    forward = jax.jit(lambda p, t: nnx.merge(graphdef, p)(t))
    return forward.lower(params, tokens).cost_analysis()['flops']

  unrolled = cfg.replace(scan_layers=False)
  standard = count(unrolled.replace(residual='standard'))
  return (count(unrolled) - standard) / (BATCH * LENGTH)


def _residual_leaves(tree) -> dict[str, Any]:
  """'layers/residual/alpha' -> leaf, for the residual's parameters."""
  leaves = {}
  for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
    keys = [str(getattr(k, 'key', getattr(k, 'name', k))) for k in path]
    if optim.RESIDUAL_MODULES.intersection(keys[:-1]):
      leaves['/'.join(keys)] = leaf
  return leaves


def check_training(cfg, steps: int):
  """(the model after `steps` train steps, what they measured)."""
  require = functools.partial(_require, residual=cfg.residual, part='train')
  model = model_lib.Transformer(cfg, rngs=nnx.Rngs(0))
  graphdef = nnx.graphdef(model)
  tx, schedule = optim.make_optimizer(train_config(), cfg)
  state = train_lib.init_train_state(cfg, tx, seed=0)
  no_decay = model.residual.no_decay
  for path, decayed in _residual_leaves(optim.decay_mask(state.params, cfg)).items():
    spared = path.rsplit('/', 1)[-1] in no_decay
    require(decayed != spared, f'{path} is {"" if decayed else "not "}decayed.')
  step = jax.jit(
    functools.partial(train_lib.train_step, graphdef=graphdef, tx=tx, schedule=schedule)
  )
  batch = jax.tree.map(jnp.asarray, toy_batch())
  losses = []
  for _ in range(steps):
    state, metrics = step(state, batch)
    losses.append(float(metrics['loss']))
  require(all(map(math.isfinite, losses)), f'losses {losses}.')
  require(losses[-1] < losses[0], f'the loss does not fall: {losses}.')
  # Adam's first moment holds the gradients of every step (decay is added after it):
  # zero only where no step had a gradient.
  grads = _residual_leaves(optax.tree_utils.tree_get(state.opt_state, 'mu'))
  unreached = sorted(path for path, g in grads.items() if not np.any(np.asarray(g)))
  require(not unreached, f'the loss does not reach {unreached} (zero gradient).')
  nnx.update(model, state.params)
  spared = sorted({p.rsplit('/', 1)[-1] for p in grads} & no_decay)
  return model, dict(losses=losses, residual_params=sorted(grads), spared_decay=spared)


def check_evaluation(model) -> dict[str, Any]:
  cfg = model.cfg
  require = functools.partial(_require, residual=cfg.residual, part='evaluate')
  batches = [toy_batch(seed=1)]
  metrics = evaluate.evaluate_model(model, batches, collect_stats=True)
  require(math.isfinite(metrics['loss']), f'loss {metrics["loss"]}.')
  require(metrics['num_tokens'] == BATCH * LENGTH, f'{metrics["num_tokens"]} tokens.')
  stats = metrics['stats']
  shape = (cfg.num_layers, 2)
  require(stats['input_rms'].shape == shape, f'input_rms {stats["input_rms"].shape}.')
  bad = sorted(k for k, v in stats.items() if not np.all(np.isfinite(v)))
  require(not bad, f'non-finite statistics {bad}.')
  norms = statistics.gradient_norms(model, batches)['grad_norm']
  require(norms.shape == shape and np.all(norms > 0), f'gradient norms {norms}.')
  return dict(loss=metrics['loss'], statistics=sorted(stats))


def check_decoding(model, tolerance: float = DECODE_TOLERANCE) -> dict[str, Any]:
  cfg = model.cfg
  tokens = jnp.asarray(toy_batch(batch=2, length=6, seed=2)['inputs'])
  graphdef, params = nnx.split(model)
  decode = jax.jit(
    lambda p, t, c, i: nnx.merge(graphdef, p).decode(t, c, i), static_argnums=3
  )
  prefill, cache = decode(params, tokens[:, :5], model.init_cache(2, 6), 0)
  last, _ = decode(params, tokens[:, 5:], cache, 5)
  full = jax.jit(lambda p, t: nnx.merge(graphdef, p)(t))(params, tokens)
  cached = np.concatenate([prefill, last], axis=1)
  error = float(np.max(np.abs(cached - np.asarray(full))))
  _require(
    np.allclose(cached, full, rtol=tolerance, atol=tolerance),
    f'cached decoding differs from the full forward pass by {error:.3g}.',
    residual=cfg.residual,
    part='decode',
  )
  return dict(max_abs_error=error)


# -- the pipeline: a child process with 2 CPU devices --------------------------------


def _child_imports(name: str) -> list[str]:
  """The module the child imports so that `name` is registered there too (a plug-in
  name registers itself)."""
  if registry.is_plugin(name):
    return []
  module = registry.factory(name).__module__
  if module == '__main__':
    raise ConformanceError(
      f'residual {name!r}, pipeline: registered in __main__, which the 2-device child '
      "process cannot import; define it in a module or name it as 'module:Class'."
    )
  return [module]


def _child_env(num_devices: int) -> dict[str, str]:
  """This process's environment on `num_devices` CPU devices, with its import path."""
  env = dict(os.environ)
  flags = [
    flag
    for flag in env.get('XLA_FLAGS', '').split()
    if not flag.startswith('--xla_force_host_platform_device_count')
  ]
  env['XLA_FLAGS'] = ' '.join(
    [f'--xla_force_host_platform_device_count={num_devices}'] + flags
  )
  env['JAX_PLATFORMS'] = 'cpu'
  package_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  path = [package_root] + [os.path.abspath(p or os.curdir) for p in sys.path]
  env['PYTHONPATH'] = os.pathsep.join(dict.fromkeys(path))
  return env


def check_pipeline(cfg, timeout: float = 600) -> dict[str, Any]:
  require = functools.partial(_require, residual=cfg.residual, part='pipeline')
  refusal = residuals.make(cfg).pipeline_refusal(cfg.num_layers // 2)
  if refusal:
    return dict(refused=refusal)
  spec = dict(model=cfg.to_dict(), imports=_child_imports(cfg.residual))
  proc = subprocess.run(
    [sys.executable, '-m', 'attnres_jax.testing.pipeline_child', json.dumps(spec)],
    env=_child_env(2),
    capture_output=True,
    text=True,
    timeout=timeout,
  )
  require(proc.returncode == 0, f'the 2-device child failed:\n{proc.stderr[-5000:]}')
  out = json.loads(proc.stdout.strip().splitlines()[-1])
  one, piped = out['one_device'], out['pipelined']
  require(
    np.allclose(piped['losses'], one['losses'], rtol=PIPELINE_LOSS_RTOL, atol=0),
    f'losses {piped["losses"]} pipelined, {one["losses"]} on one device.',
  )
  gaps = [
    float(np.max(np.abs(np.asarray(a) - np.asarray(b)), initial=0.0))
    for a, b in zip(piped['params'], one['params'])
  ]
  require(
    max(gaps) <= PIPELINE_PARAM_ATOL,
    f"parameters differ from one device's by up to {max(gaps):.3g}.",
  )
  return dict(losses=piped['losses'], max_param_diff=max(gaps))


def main(argv: list[str]) -> None:
  if len(argv) != 1:
    raise SystemExit('usage: python -m attnres_jax.testing.conformance RESIDUAL')
  print(json.dumps(check_residual(argv[0]), default=str, indent=1))


if __name__ == '__main__':
  main(sys.argv[1:])
