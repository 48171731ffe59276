"""The train step: a pure jitted `train_step`, the train state and its sharded layout,
the eval step, and the memory check of a compiled step (the host loop:
`training/loop.py`).

Step s (1-based) is the s-th optimizer update: its metrics are those of the batch it
trained on (loss of the parameters before the update), and the checkpoint of step s
holds the state after s updates and s batches.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any

import flax
import jax
import jax.numpy as jnp
import ml_collections
import optax
from flax import nnx

from attnres_jax.evaluation import evaluate as evaluate_lib
from attnres_jax.models import transformer as model_lib
from attnres_jax.nn import sharding
from attnres_jax.runs import checkpointing
from attnres_jax.runs import metrics as metrics_lib
from attnres_jax.runs import workdir as workdir_lib

EVAL_FINAL_JSON = 'eval_final.json'


class NonFiniteLossError(FloatingPointError):
  """Training produced a non-finite loss or gradient norm."""


# Errors whose message says everything a user needs (train.py prints them alone).
RUN_ERRORS = (
  NonFiniteLossError,
  checkpointing.CheckpointSaveError,
  checkpointing.CheckpointRestoreError,
  metrics_lib.MetricsWriteError,
  workdir_lib.WorkdirLockedError,
  workdir_lib.RunConfigError,
)


@flax.struct.dataclass
class TrainState:
  """Everything a train step updates: step count, parameters, optimizer state.

  `params` is a pure dict (`nnx.to_pure_dict`); the model structure (graphdef)
  and the optimizer are static and passed to `train_step` separately.
  """

  step: jax.Array  # int32 scalar: optimizer updates done
  params: Any
  opt_state: Any


@dataclasses.dataclass
class TrainResult:
  state: TrainState
  step: int
  train_loss: float | None  # mean over the last logging interval of this run
  eval: dict[str, float] | None  # the final evaluation; None if stopped early


# -- pure functions -------------------------------------------------------------------


def train_step(
  state: TrainState,
  batch,
  *,
  graphdef,
  tx: optax.GradientTransformation,
  schedule: optax.Schedule | None = None,
  grad_accum_steps: int = 1,
  loss_fn=None,
) -> tuple[TrainState, dict[str, jax.Array]]:
  """One optimizer update on `batch`: the weighted mean cross-entropy's gradient.

  Metrics: loss (nats per token, before the update), grad_norm (before clipping),
  tokens (sum of weights) and, given the `schedule` of `tx`, learning_rate.

  With `grad_accum_steps` k > 1 the batch is split into k microbatches (rows i, i + k,
  ...), whose gradient sums are accumulated in a `lax.scan`; only one microbatch's
  activations are live at a time. The update is the same as for the whole batch, up to
  float summation order. `loss_fn`: another `loss_sums` (the pipelined one).
  """
  loss_fn = loss_fn or evaluate_lib.loss_sums
  grad_fn = jax.value_and_grad(
    functools.partial(loss_fn, graphdef=graphdef), has_aux=True
  )
  if grad_accum_steps == 1:
    (loss_sum, weight_sum), grad_sums = grad_fn(state.params, batch)
  else:
    k = grad_accum_steps
    micro = jax.tree.map(
      lambda x: x.reshape(x.shape[0] // k, k, *x.shape[1:]).swapaxes(0, 1), batch
    )

    def accumulate(carry, microbatch):
      (loss_sum, weight_sum), grad_sums = grad_fn(state.params, microbatch)
      return jax.tree.map(jnp.add, carry, (loss_sum, weight_sum, grad_sums)), None

    zeros = (
      jnp.zeros((), jnp.float32),
      jnp.zeros((), jnp.float32),
      jax.tree.map(jnp.zeros_like, state.params),
    )
    (loss_sum, weight_sum, grad_sums), _ = jax.lax.scan(accumulate, zeros, micro)
  denominator = jnp.maximum(weight_sum, 1.0)
  grads = jax.tree.map(lambda g: g / denominator, grad_sums)
  updates, opt_state = tx.update(grads, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
  metrics = {
    'loss': loss_sum / denominator,
    'grad_norm': optax.tree.norm(grads),
    'tokens': weight_sum,
  }
  if schedule is not None:
    metrics['learning_rate'] = schedule(state.step)
  return TrainState(step=state.step + 1, params=params, opt_state=opt_state), metrics


# -- checks that run before anything compiles ----------------------------------------


def compiled_memory_need(memory) -> int:
  """Bytes per device a compiled program needs: its `memory_analysis()` figures.

  The compiler's peak (`peak_memory_in_bytes`: the buffers live at once, arguments
  included) plus its code, where the backend reports a peak. `temp_size_in_bytes`
  is not what must fit: it grows with every loop and conditional in a program, past
  what is ever live at once (a 32-layer step run as eight scans: 60.4 GiB of
  temporaries, a peak of 40.6 GiB with its arguments). The peak is not bounded by
  that sum either: for a tiny TPU program it is above it (1.5 MiB against 0.3 MiB of
  arguments and no temporaries). Without a peak, the sum arguments + outputs - donated
  + temporaries + code.
  """
  peak = reported_peak_bytes(memory)
  if peak > 0:
    return max(peak, _held_bytes(memory)) + memory.generated_code_size_in_bytes
  return summed_memory_bytes(memory)


def _held_bytes(memory) -> int:
  """arguments + outputs - donated: what the program holds outside its temporaries."""
  return (
    memory.argument_size_in_bytes
    + memory.output_size_in_bytes
    - memory.alias_size_in_bytes
  )


def reported_peak_bytes(memory) -> int:
  """The compiler's peak from `memory_analysis()`, 0 where the backend reports none."""
  return getattr(memory, 'peak_memory_in_bytes', 0) or 0


def summed_memory_bytes(memory) -> int:
  """arguments + outputs - donated + temporaries + code, from `memory_analysis()`."""
  return (
    _held_bytes(memory) + memory.temp_size_in_bytes + memory.generated_code_size_in_bytes
  )


def check_memory(
  config: ml_collections.ConfigDict,
  memory_bytes: int | None = None,
  *,
  num_devices: int | None = None,
  compiled=None,
  what: str = 'The step',
) -> None:
  """Raises ValueError if the run cannot fit in a device's memory.

  Without `compiled`, a lower bound that never refuses a run that fits: the causal
  attention (`jax.nn.dot_product_attention`, XLA implementation) holds the scores of
  one layer, [microbatch, heads, seq_len, seq_len], split at best over all
  `num_devices` (default: all devices). With `compiled` (a step's `.lower(...)
  .compile()`, e.g. for a TPU topology ahead of time, `compile_report/aot.py`), the
  compiler's own figure per device, `compiled_memory_need`. Memory is `memory_bytes`,
  else the first device's limit, or the host's RAM for CPU devices.
  """
  tc, cfg = config.train, config.model
  if memory_bytes is None:
    stats = jax.local_devices()[0].memory_stats() or {}
    memory_bytes = stats.get('bytes_limit') or (
      os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES')
    )
  if compiled is not None:
    m = compiled.memory_analysis()
    need = compiled_memory_need(m)
    if need > memory_bytes:
      measure = (
        'at its peak' if reported_peak_bytes(m) > 0 else 'summed, no peak reported'
      )
      raise ValueError(
        f'{what} does not fit: it needs {need / 2**30:,.2f} GiB per device '
        f'({measure}; arguments {m.argument_size_in_bytes / 2**30:,.2f}, temporaries '
        f'{m.temp_size_in_bytes / 2**30:,.2f}), and a device has '
        f'{memory_bytes / 2**30:,.2f} GiB. Shard more (mesh.shape: fsdp, tensor; '
        'mesh.stage), lower the batch or seq_len, raise grad_accum_steps, or set '
        'model.remat.'
      )
    return
  itemsize = 2 if cfg.dtype == 'bfloat16' else 4
  scores = (tc.batch_size // tc.grad_accum_steps) * cfg.num_heads * tc.seq_len**2
  per_device = scores * itemsize / (num_devices or jax.device_count())
  if per_device > memory_bytes:
    raise ValueError(
      f'seq_len={tc.seq_len} cannot fit: the attention scores of one layer '
      f'([{tc.batch_size // tc.grad_accum_steps}, {cfg.num_heads}, {tc.seq_len}, '
      f'{tc.seq_len}] per microbatch) need at least {per_device / 2**30:,.1f} GiB per '
      f'device, and a device has {memory_bytes / 2**30:,.1f} GiB. Lower seq_len or '
      'the batch, or raise grad_accum_steps.'
    )


# -- the train state and the steps on a device mesh ----------------------------------


def init_train_state(
  model_config: ml_collections.ConfigDict, tx: optax.GradientTransformation, seed: int
) -> TrainState:
  """A fresh train state (step 0); jit it with `out_shardings` to create it sharded."""
  model = model_lib.Transformer(model_config, rngs=nnx.Rngs(seed))
  params = nnx.to_pure_dict(nnx.state(model))
  return TrainState(
    step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params)
  )


def make_layout(
  model_config, tx: optax.GradientTransformation, mesh: jax.sharding.Mesh, rules
) -> sharding.Layout:
  """Where the train state (from `eval_shape`) and the batches live on `mesh`."""
  abstract_model = nnx.eval_shape(
    lambda: model_lib.Transformer(model_config, rngs=nnx.Rngs(0))
  )
  abstract_state = jax.eval_shape(
    functools.partial(init_train_state, model_config, tx, 0)
  )
  return sharding.train_state_layout(
    abstract_state, nnx.state(abstract_model), tx, mesh, rules
  )


def create_train_state(
  model_config, tx, seed: int, layout: sharding.Layout
) -> TrainState:
  """The initial train state, created directly sharded (no full copy on one device)."""
  return jax.jit(
    functools.partial(init_train_state, model_config, tx, seed),
    out_shardings=layout.state,
  )()


def jit_train_step(
  layout: sharding.Layout,
  *,
  graphdef,
  tx,
  schedule=None,
  grad_accum_steps=1,
  loss_fn=None,
):
  """`train_step` jitted on the mesh: state donated, metrics replicated."""
  step = functools.partial(
    train_step,
    graphdef=graphdef,
    tx=tx,
    schedule=schedule,
    grad_accum_steps=grad_accum_steps,
    loss_fn=loss_fn,
  )
  return jax.jit(
    sharding.under_rules(step, layout),
    in_shardings=(layout.state, layout.batch),
    out_shardings=(layout.state, layout.replicated),
    donate_argnums=0,
  )


def jit_eval_step(layout: sharding.Layout, *, graphdef, collect_stats: bool = False):
  """`evaluate.eval_sums` jitted on the mesh: sums replicated."""
  step = functools.partial(
    evaluate_lib.eval_sums, graphdef=graphdef, collect_stats=collect_stats
  )
  return jax.jit(
    sharding.under_rules(step, layout),
    in_shardings=(layout.state.params, layout.batch),
    out_shardings=layout.replicated,
  )
