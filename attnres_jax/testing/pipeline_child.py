"""The child process of the conformance check's pipeline part
(`conformance.check_pipeline`): two train steps of a residual's tiny model on one
device and pipelined over 2 stages, on 2 CPU devices.

  python -m attnres_jax.testing.pipeline_child '{"model": {...}, "imports": [...]}'

prints their losses and parameters as one JSON line; `imports` are modules that
register the residual (a plug-in name registers itself).
"""

from __future__ import annotations

import importlib
import json
import sys
from typing import Any

import jax
import numpy as np

from attnres_jax import config as config_lib
from attnres_jax.nn import sharding
from attnres_jax.parallel import pipeline, pipeline_plan
from attnres_jax.runs import checkpointing
from attnres_jax.testing.conformance import BATCH, toy_batch, train_config
from attnres_jax.training import optim
from attnres_jax.training import step as train_lib


def run_pipeline_steps(cfg, steps: int = 2) -> dict[str, Any]:
  """(In the child.) The losses and parameters of `steps` train steps on one device
  and pipelined over 2 stages (2 microbatches)."""
  if jax.device_count() != 2:
    raise RuntimeError(f'the pipeline check needs 2 devices, got {jax.devices()}')
  tx, schedule = optim.make_optimizer(train_config(), cfg)
  batch = toy_batch()
  out = {}
  for name, mesh_overrides in (
    ('one_device', dict(shape=(1, 1, 1))),
    ('pipelined', dict(stage=2, shape=(1, 1, 1), num_microbatches=2)),
  ):
    mesh_config = sharding.default_mesh_config(**mesh_overrides)
    pipe = pipeline_plan.from_mesh_config(mesh_config)
    pipeline_plan.validate(pipe, cfg, batch_size=BATCH)
    mesh = sharding.make_mesh(mesh_config, jax.devices()[: mesh_config.stage])
    rules = sharding.rules_from_config(mesh_config)
    layout = train_lib.make_layout(cfg, tx, mesh, rules)
    state = train_lib.create_train_state(cfg, tx, 0, layout)
    step = train_lib.jit_train_step(
      layout,
      graphdef=checkpointing.abstract_model(cfg)[0],
      tx=tx,
      schedule=schedule,
      loss_fn=pipeline.make_loss_fn(pipe),
    )
    losses = []
    for _ in range(steps):
      state, metrics = step(state, layout.to_global(batch))
      losses.append(float(metrics['loss']))
    params = jax.tree.leaves(jax.device_get(state.params))
    out[name] = dict(losses=losses, params=[np.asarray(x).tolist() for x in params])
  return out


def main(argv: list[str]) -> None:
  spec = json.loads(argv[0])
  for module in spec['imports']:
    importlib.import_module(module)
  cfg = config_lib.ModelConfig(**spec['model'])
  print(json.dumps(run_pipeline_steps(cfg)))


if __name__ == '__main__':
  main(sys.argv[1:])
