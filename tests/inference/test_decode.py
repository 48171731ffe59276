"""Decoding (model.decode, stack.apply_layers_cached, sampling.generate) against full
recomputation: ragged batches, stop tokens, chunked prefill, one compilation of the
one-token step, and a sharded step against one device (8 simulated devices, in a
child process as in tests/nn/test_sharding.py)."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from attnres_jax import model_config
from attnres_jax.inference import sampling
from attnres_jax import Transformer
from conftest import assert_greedy_choices, assert_same_greedy_run, child_result


VOCAB = 256
# (residual, block_size, depth_read): Block S=3 of 4 sublayers has a partial last block;
# one-shot reads take the reference path through the same residual interface.
MODES = [
  ('standard', 1, 'two_phase'),
  ('full', 1, 'two_phase'),
  ('block', 3, 'two_phase'),
  ('block', 2, 'one_shot'),
]
MODE_IDS = ['standard', 'full', 'block_S3', 'block_S2_one_shot']
PROMPTS = [[5, 70, 80], [0, 65, 66, 67, 68, 69, 70], [9, 8, 7, 6, 5]]  # ragged
# float32: the cache path attends with other matmul shapes (and over masked slots)
# than the full forward pass, so sums differ in order (rounding only); the bounds of
# tests/evaluation/test_eval.py's cached-generation test. A wrong mask, position or cache slot
# moves these O(1-10) logits by O(0.1-1).
ATOL, RTOL = 2e-4, 1e-4


def tiny_model(residual, block_size, depth_read='two_phase', *, seed=0):
  """A tiny model with random (non-uniform) depth queries and gains."""
  cfg = model_config(
    d_model=32,
    num_heads=2,
    mlp_dim=64,
    num_layers=2,
    residual=residual,
    block_size=block_size,
    vocab_size=VOCAB,
  )
  model = Transformer(cfg, rngs=nnx.Rngs(seed))
  if depth_read == 'one_shot':  # the test-only reference read (AttnResResidual)
    model.residual = dataclasses.replace(model.residual, one_shot=True)
  if model.final_residual is not None:
    keys = jax.random.split(jax.random.PRNGKey(seed + 100), 3)
    reads, final = model.layers.residual, model.final_residual
    reads.query[...] = jax.random.normal(keys[0], reads.query.shape)
    reads.gain[...] = 1 + 0.3 * jax.random.normal(keys[1], reads.gain.shape)
    final.query[...] = jax.random.normal(keys[2], final.query.shape)
  return model


@nnx.jit
def forward(model, tokens_BT):
  return model(tokens_BT)


def recomputed_logits(model, prompt, tokens, length=16):
  """The logits that chose each new token, from one uncached forward pass over the
  row alone (padded at its end to `length`: one compilation; a causal model ignores
  what follows)."""
  sequence = np.concatenate([prompt, tokens]).astype(np.int32)
  padded = np.zeros((1, length), np.int32)
  padded[0, : len(sequence)] = sequence
  logits = np.asarray(forward(model, jnp.asarray(padded)))[0]
  return logits[len(prompt) - 1 : len(prompt) - 1 + len(tokens)]


@pytest.mark.parametrize('residual,block_size,depth_read', MODES, ids=MODE_IDS)
def test_ragged_batch_and_chunked_prefill_equal_recomputation(
  residual, block_size, depth_read
):
  model = tiny_model(residual, block_size, depth_read)
  steps_before = sampling._step._cache_size()
  tokens, logits = sampling.generate(
    model, PROMPTS, 6, temperature=0.0, return_logits=True
  )
  # One compilation of the one-token step serves every position.
  assert sampling._step._cache_size() - steps_before <= 1
  for prompt, row_tokens, row_logits in zip(PROMPTS, tokens, logits):
    assert row_tokens.shape == (6,) and row_logits.shape == (6, VOCAB)
    want = recomputed_logits(model, np.asarray(prompt), row_tokens)
    np.testing.assert_allclose(row_logits, want, atol=ATOL, rtol=RTOL)
    assert_greedy_choices(row_tokens, want, atol=ATOL, rtol=RTOL)
  # Chunked prefill (chunk 3 does not divide the padded prompt of 7) equals one shot.
  chunked, chunked_logits = sampling.generate(
    model, PROMPTS, 6, temperature=0.0, return_logits=True, prefill_chunk=3
  )
  for a, b, la, lb in zip(tokens, chunked, logits, chunked_logits):
    assert_same_greedy_run(a, b, la, lb, atol=ATOL, rtol=RTOL)


def test_chunked_prefill_equals_one_shot_prefill():
  """Chunks of 1 and 4 (dividing the prompt of 8; 3, not dividing it, is checked in
  the ragged test): the logits of every prompt position equal one-shot prefill's."""
  model = tiny_model('block', 2)
  prompt_BT = jnp.asarray(np.random.default_rng(0).integers(1, VOCAB, (2, 8)), jnp.int32)
  decode = nnx.jit(lambda m, tokens, cache, index: m.decode(tokens, cache, index))
  one_shot, _ = decode(model, prompt_BT, model.init_cache(2, 8), 0)
  for chunk in (1, 4):
    cache, parts = model.init_cache(2, 8), []
    for index in range(0, 8, chunk):
      logits, cache = decode(
        model, prompt_BT[:, index : index + chunk], cache, jnp.int32(index)
      )
      parts.append(logits)
    np.testing.assert_allclose(
      jnp.concatenate(parts, axis=1), one_shot, atol=ATOL, rtol=RTOL
    )


def test_stop_tokens_end_rows():
  model = tiny_model('block', 3)
  free = sampling.generate(model, PROMPTS, 8, temperature=0.0)
  stop = int(free[1][2])  # row 1 stops at its third token at the latest
  stopped = sampling.generate(model, PROMPTS, 8, temperature=0.0, stop_tokens=[stop])
  for row_free, row_stopped in zip(free, stopped):
    hits = np.flatnonzero(row_free == stop)
    end = hits[0] + 1 if hits.size else len(row_free)
    np.testing.assert_array_equal(row_stopped, row_free[:end])
  assert len(stopped[1]) <= 3
  # An array batch keeps its shape: a stopped row repeats its stop token.
  batch = np.asarray([PROMPTS[2], PROMPTS[2][::-1]], np.int32)
  free_array = sampling.generate(model, batch, 8, temperature=0.0)
  stop = int(free_array[0, 1])
  stopped_array = sampling.generate(model, batch, 8, temperature=0.0, stop_tokens=[stop])
  assert stopped_array.shape == (2, 8)
  np.testing.assert_array_equal(
    stopped_array[0],
    [free_array[0, 0]] + [stop] * 7 if free_array[0, 0] != stop else [stop] * 8,
  )


def test_step_compiles_once_for_all_prompt_lengths_and_text_batches():
  model = tiny_model('full', 1)
  texts = sampling.generate_text(model, ['ROMEO:', 'O', ''], 4, temperature=0.0)
  single = sampling.generate_text(model, 'ROMEO:', 4, temperature=0.0)
  assert isinstance(texts, list) and len(texts) == 3 and texts[0] == single
  compiled = sampling._step._cache_size()
  # Another prompt length (the same cache length bucket) reuses the batch-1 step.
  sampling.generate_text(model, 'O', 4, temperature=0.0)
  assert sampling._step._cache_size() == compiled


def bf16_rounded(model):
  """A copy of `model` whose weight matrices hold their values rounded to bfloat16
  (still float32): what serving with bfloat16 weights computes with."""
  graphdef, state = nnx.split(model)
  round_trip = lambda x: x.astype(jnp.bfloat16).astype(x.dtype)
  rounded = jax.tree_util.tree_map_with_path(
    lambda path, x: (
      round_trip(x)
      if {getattr(k, 'key', None) for k in path[:2]}
      & {'embedding', 'lm_head', 'attention', 'mlp'}
      else x
    ),
    state,
  )
  return nnx.merge(graphdef, rounded)


def test_bfloat16_serving_weights():
  """weights_dtype='bfloat16' serves from bfloat16 copies of the weight matrices alone:
  the same logits as the model whose matrices (and nothing else) are rounded to
  bfloat16; norm gains and depth parameters stay float32."""
  model = tiny_model('block', 3)
  graphdef, state, layers = sampling.serving_state(model, 'bfloat16')
  assert state['embedding'].dtype == jnp.bfloat16
  assert state['final_norm']['scale'].dtype == jnp.float32
  assert state['final_residual']['query'].dtype == jnp.float32
  for layer in layers:
    assert layer['mlp']['down'].dtype == layer['attention']['out'].dtype == jnp.bfloat16
    assert layer['mlp_norm']['scale'].dtype == jnp.float32
    assert layer['residual']['query'].dtype == jnp.float32
  # The default serves the parameters as they are.
  _, plain, plain_layers = sampling.serving_state(model)
  assert plain['embedding'].dtype == plain_layers[0]['mlp']['down'].dtype == jnp.float32
  tokens, logits = sampling.generate(
    model, PROMPTS, 4, temperature=0.0, return_logits=True, weights_dtype='bfloat16'
  )
  want_tokens, want = sampling.generate(
    bf16_rounded(model), PROMPTS, 4, temperature=0.0, return_logits=True
  )
  for a, b, la, lb in zip(tokens, want_tokens, logits, want):
    # The same float32 arithmetic on the same (bf16-representable) weights: the dots
    # only see a bf16 operand upcast where the reference has the float32 equal.
    assert_same_greedy_run(a, b, la, lb, atol=ATOL, rtol=RTOL)
  with pytest.raises(ValueError, match='weights_dtype'):
    sampling.generate(model, PROMPTS, 2, weights_dtype='int8')
  with pytest.raises(ValueError, match='weights_dtype'):
    sampling.generate_text(model, 'O', 2, weights_dtype='no_such_dtype')


def test_bad_input_is_a_clear_error():
  model = tiny_model('standard', 1)
  with pytest.raises(ValueError, match='at least one token'):
    sampling.generate(model, [[1, 2], []], 3)
  with pytest.raises(ValueError, match='prefill_chunk'):
    sampling.generate(model, [1, 2], 3, prefill_chunk=0)


# -- sharded decoding: the child runs with 8 simulated devices -------------------------

SHARDED_MODEL = dict(
  vocab_size=VOCAB, d_model=32, num_heads=4, mlp_dim=64, num_layers=2, block_size=2
)


def run_sharded_checks() -> dict:
  """Prefill + 3 one-token steps on a (2, 2, 2) mesh and on one device."""
  from attnres_jax.nn import kv_cache  # pylint: disable=g-import-not-at-top
  from attnres_jax.nn import sharding  # pylint: disable=g-import-not-at-top

  assert jax.device_count() == 8, jax.devices()
  mesh = sharding.make_mesh(sharding.default_mesh_config(shape=(2, 2, 2)))
  rules = sharding.rules_from_config(sharding.default_mesh_config())
  tokens_BT = jnp.asarray(np.random.default_rng(0).integers(1, VOCAB, (4, 9)), jnp.int32)
  start_B = jnp.asarray([0, 2, 1, 0], jnp.int32)  # left padding in some rows
  out = {}
  for residual in ('standard', 'block'):
    model = tiny_model(residual, 2)
    graphdef, state = nnx.split(model)
    layers = model.decoding_layers()

    def run(state, layers, cache, on_mesh):
      def decode(state, layers, tokens, cache, index):
        if not on_mesh:
          return nnx.merge(graphdef, state).decode(
            tokens, cache, index, start_B, layers=layers
          )
        with sharding.logical_rules(mesh, rules):
          return nnx.merge(graphdef, state).decode(
            tokens, cache, index, start_B, layers=layers
          )

      decode = jax.jit(decode, donate_argnums=3)
      logits = []
      step_logits, cache = decode(state, layers, tokens_BT[:, :6], cache, 0)
      logits.append(step_logits)
      for index in range(6, 9):
        step_logits, cache = decode(
          state, layers, tokens_BT[:, index : index + 1], cache, jnp.int32(index)
        )
        logits.append(step_logits)
      return np.concatenate([np.asarray(x) for x in logits], axis=1), cache, decode

    reference, _, _ = run(state, layers, model.init_cache(4, 16), False)

    # The parameters placed by their logical axis names, as training places them.
    abstract = nnx.state(nnx.eval_shape(lambda: model))
    pure = jax.device_put(
      nnx.to_pure_dict(state), sharding.param_shardings(abstract, mesh, rules)
    )
    nnx.replace_by_pure_dict(state, pure)
    sharded_model = nnx.merge(graphdef, state)
    layers_sharded = sharded_model.decoding_layers()
    cache = kv_cache.shard_cache(model.init_cache(4, 16), mesh, rules)
    got, cache, decode = run(state, layers_sharded, cache, True)
    out[residual] = dict(
      max_abs_diff=float(np.max(np.abs(got - reference))),
      scale=float(np.max(np.abs(reference))),
      keys_spec=str(cache[0].keys_BNHS.sharding.spec),
      values_spec=str(cache[0].values_BNSH.sharding.spec),
      weight_sharded=not layers_sharded[0]['mlp']['gate'].sharding.is_fully_replicated,
      compiled=decode._cache_size(),
    )
  return out


@pytest.fixture(scope='module')
def sharded_result():
  return child_result(__file__, 8)


@pytest.mark.parametrize('residual', ['standard', 'block'])
def test_sharded_decode_step_equals_one_device(sharded_result, residual):
  got = sharded_result[residual]
  # float32: per-device partial sums (heads over 'tensor', the contraction over the
  # FSDP-split model width) reduced across devices in another order: ulps of the
  # logits, far below a wrong shard or a missed reduction (whole percents).
  assert got['max_abs_diff'] <= 1e-5 * max(1.0, got['scale']), got
  # The cache is laid out like the activations: batch over (data, fsdp), heads over
  # tensor; the weights stay sharded.
  assert got['keys_spec'] == "P(('data', 'fsdp'), 'tensor')", got
  assert got['values_spec'] == "P(('data', 'fsdp'), 'tensor')", got
  assert got['weight_sharded']
  assert got['compiled'] == 2  # the prefill and the one-token step, once each


if __name__ == '__main__':
  print(json.dumps(run_sharded_checks()))
