"""Text generation with the KV cache: a prefill (in chunks when asked), then a jitted
one-token step.

Prompts of different lengths go in one batch, left-padded: each row's positions count
from its first token and its padding slots are masked (`kv_cache.cached_attention`). The
cache has a fixed length (prompt + new tokens, rounded up to CACHE_ROUNDING) and is
donated, so every step updates it in place; the layers' weights are passed one buffer
per layer (`Transformer.decoding_layers`). The position, temperature and top_k are
traced arguments, so the step compiles once per (model, batch, cache length) and is
reused for every position and setting. Sampling keys are
`fold_in(PRNGKey(seed), cache slot)`: a fixed seed gives a fixed output.

`weights_dtype='bfloat16'` serves from bfloat16 copies of the weight matrices (cast
once, before the prefill; `serving_weights`): a token step reads half the weight bytes.
The default serves the parameters as they are.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from attnres_jax.data import tokenizer as tokenizer_lib

SEPARATOR = 0  # the document-start byte of the data pipeline (data.SEPARATOR)
CACHE_ROUNDING = 64  # the KV cache length is a multiple of this
_BYTES = tokenizer_lib.ByteTokenizer()
# The weight matrices a token step reads (paths' first names): the layers' attention and
# MLP, the embedding and the output head. Norm gains and the residual's parameters stay
# as they are: a few vectors, read in float32 arithmetic anyway.
SERVING_LAYER_WEIGHTS = ('attention', 'mlp')
SERVING_MODEL_WEIGHTS = ('embedding', 'lm_head')


def encode_text(
  text: str,
  *,
  add_separator: bool = False,
  tokenizer: tokenizer_lib.Tokenizer | None = None,
) -> np.ndarray:
  """int32 tokens of `text` (default tokenizer: UTF-8 bytes); with `add_separator`,
  after a document start (the tokenizer's BOS id; 0 for bytes)."""
  tokenizer = tokenizer or _BYTES
  tokens = tokenizer.encode(text).astype(np.int32)
  if add_separator:
    tokens = np.concatenate([np.asarray([tokenizer.bos_id], np.int32), tokens])
  return tokens


def decode_tokens(tokens, tokenizer: tokenizer_lib.Tokenizer | None = None) -> str:
  """Tokens back to text (default: bytes, invalid UTF-8 replaced); document starts
  and ids outside the tokenizer's vocabulary (a padded model vocab) are dropped."""
  return (tokenizer or _BYTES).decode(tokens)


def _serving_dtype(weights_dtype):
  """The floating dtype named by `weights_dtype` (None: None); else a ValueError."""
  if weights_dtype is None:
    return None
  try:
    dtype = jnp.dtype(weights_dtype)
  except TypeError:
    dtype = None
  if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
    raise ValueError(
      f"weights_dtype must be a floating dtype (e.g. 'bfloat16'), got {weights_dtype!r}."
    )
  return dtype


def serving_weights(tree, names, weights_dtype):
  """`tree` (an nnx.State) with the floating arrays under the first names `names` cast
  to `weights_dtype` (None: `tree` itself)."""
  dtype = _serving_dtype(weights_dtype)
  if dtype is None:
    return tree

  def cast(path, x):
    first = getattr(path[0], 'key', None) if path else None
    if first in names and jnp.issubdtype(x.dtype, jnp.floating):
      return x.astype(dtype)
    return x

  return jax.tree_util.tree_map_with_path(cast, tree)


def serving_state(model: nnx.Module, weights_dtype=None):
  """(graphdef, state, layers) that the jitted prefill and step take: the model split,
  and its layers one state per layer (`Transformer.decoding_layers`), the weight
  matrices cast to `weights_dtype` when given (the stacked layers in `state` are not
  read by `decode` given `layers`, so they stay as they are)."""
  graphdef, state = nnx.split(model)  # the graph is hashable: a static argument
  state = serving_weights(state, SERVING_MODEL_WEIGHTS, weights_dtype)
  layers = tuple(
    serving_weights(layer, SERVING_LAYER_WEIGHTS, weights_dtype)
    for layer in model.decoding_layers()
  )
  return graphdef, state, layers


def _choose(logits_BV, key, temperature, top_k):
  """The next token: argmax when temperature == 0, else a tempered sample from the
  `top_k` most likely tokens. Both settings are traced (no recompilation)."""
  logits_BV = logits_BV.astype(jnp.float32)
  greedy_B = jnp.argmax(logits_BV, axis=-1)
  scaled_BV = logits_BV / jnp.maximum(temperature, 1e-6)
  kth_B1 = jnp.take(jnp.sort(scaled_BV, axis=-1), -top_k, axis=-1)[:, None]
  scaled_BV = jnp.where(scaled_BV < kth_B1, -jnp.inf, scaled_BV)
  sampled_B = jax.random.categorical(key, scaled_BV, axis=-1)
  return jnp.where(temperature > 0, sampled_B, greedy_B).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=('graphdef',), donate_argnames=('cache',))
def _prefill_chunk(graphdef, state, layers, chunk_BT, cache, index, start_B):
  """Feeds the prompt tokens in slots index .. index + C - 1; returns the logits of the
  last one and the cache. The depth state of the chunk alone is alive (chunked
  prefill, `docs/inference.md`)."""
  model = nnx.merge(graphdef, state)
  logits_BCV, cache = model.decode(chunk_BT, cache, index, start_B, layers=layers)
  return logits_BCV[:, -1], cache


@jax.jit
def _first_token(logits_BV, key, position, temperature, top_k):
  return _choose(logits_BV, jax.random.fold_in(key, position), temperature, top_k)


@functools.partial(jax.jit, static_argnames=('graphdef',), donate_argnames=('cache',))
def _step(
  graphdef,
  state,
  layers,
  token_B,
  cache,
  index,
  start_B,
  key,
  temperature,
  top_k,
  stop_S,
  done_B,
):
  """Feeds the token in slot `index` and chooses the one of slot `index + 1`. A row
  that is done (it produced one of `stop_S`) repeats its last token."""
  model = nnx.merge(graphdef, state)
  logits_B1V, cache = model.decode(token_B[:, None], cache, index, start_B, layers=layers)
  chosen_B = _choose(
    logits_B1V[:, 0], jax.random.fold_in(key, index + 1), temperature, top_k
  )
  chosen_B = jnp.where(done_B, token_B, chosen_B)
  done_B = done_B | jnp.any(chosen_B[:, None] == stop_S[None, :], axis=-1)
  return chosen_B, logits_B1V[:, 0], cache, done_B


def left_pad(prompts, pad_id: int = SEPARATOR) -> tuple[np.ndarray, np.ndarray]:
  """Prompts of different lengths as one [B, T_max] batch, each right-aligned after
  `pad_id` padding, and the first slot of each row's prompt (its start) [B]."""
  prompts = [np.asarray(p, np.int32).reshape(-1) for p in prompts]
  if not prompts or min(len(p) for p in prompts) < 1:
    raise ValueError(
      'Every prompt needs at least one token (an empty text prompt '
      'starts a document: add_separator).'
    )
  longest = max(len(p) for p in prompts)
  batch_BT = np.full((len(prompts), longest), pad_id, np.int32)
  for row, p in enumerate(prompts):
    batch_BT[row, longest - len(p) :] = p
  return batch_BT, np.asarray([longest - len(p) for p in prompts], np.int32)


def generate(
  model: nnx.Module,
  prompt_tokens,
  max_new_tokens: int,
  *,
  temperature: float = 1.0,
  top_k: int | None = None,
  seed: int = 0,
  return_logits: bool = False,
  stop_tokens=(),
  prefill_chunk: int | None = None,
  weights_dtype=None,
):
  """Continues `prompt_tokens` by `max_new_tokens` tokens.

  `prompt_tokens`: an array [T] or [B, T] (T >= 1), or a list of 1-D prompts of any
  lengths (ragged: left-padded into one batch, each row positioned from its own
  first token). temperature == 0 is greedy (argmax); otherwise tokens are drawn from
  softmax(logits / temperature), restricted to the `top_k` most likely when given.
  A row stops after it produces one of `stop_tokens` (generation ends when every row
  has); its later tokens repeat that stop token. `prefill_chunk`: prefill the prompt
  C tokens at a time (exact; only one chunk's depth state is alive at once).
  `weights_dtype`: serve from weight matrices cast to this dtype (e.g. 'bfloat16';
  `serving_state`); default: the parameters as they are.

  Returns the new tokens as int32 [max_new_tokens] (or [B, max_new_tokens]); for a
  list of prompts, a list of 1-D arrays, each cut after its stop token. With
  `return_logits`, also the float32 logits each token was chosen from,
  [max_new_tokens, V] (or [B, max_new_tokens, V], or a list of [N_b, V]).
  """
  prompt_BT, start_B, single, ragged = _prompt_batch(prompt_tokens)
  _check_options(temperature, top_k, max_new_tokens, prefill_chunk, weights_dtype)
  batch, prompt_len = prompt_BT.shape

  vocab = model.cfg.vocab_size
  options = (jnp.float32(temperature), jnp.int32(min(top_k or vocab, vocab)))
  key = jax.random.PRNGKey(seed)
  served = serving_state(model, weights_dtype)
  # The last new token is never fed back, so the cache needs one slot less. Its length
  # is rounded up (unused slots are masked) so that nearby lengths share a compilation.
  needed = prompt_len + max_new_tokens - 1
  cache = model.init_cache(batch, -(-needed // CACHE_ROUNDING) * CACHE_ROUNDING)
  start = jnp.asarray(start_B)
  logits_BV, cache = _prefill(served, prompt_BT, cache, start, prefill_chunk)
  token_B = _first_token(logits_BV, key, jnp.int32(prompt_len), *options)
  tokens, logits = _continue(
    served,
    token_B,
    logits_BV,
    cache,
    start,
    key,
    options,
    range(prompt_len, prompt_len + max_new_tokens - 1),
    stop_tokens=stop_tokens,
    return_logits=return_logits,
  )
  tokens_BN = np.asarray(jnp.stack(tokens, axis=1))
  logits_BNV = np.asarray(jnp.stack(logits, 1)) if return_logits else None
  if tokens_BN.shape[1] < max_new_tokens:  # every row stopped: repeat the stop tokens
    rest = max_new_tokens - tokens_BN.shape[1]
    tokens_BN = np.concatenate([tokens_BN, np.repeat(tokens_BN[:, -1:], rest, 1)], 1)
    if return_logits:
      logits_BNV = np.concatenate([logits_BNV, np.repeat(logits_BNV[:, -1:], rest, 1)], 1)
  if ragged:
    return _ragged_results(tokens_BN, logits_BNV, stop_tokens)
  if not return_logits:
    return _unbatch(tokens_BN, single)
  return _unbatch(tokens_BN, single), _unbatch(logits_BNV, single)


def _prompt_batch(prompt_tokens):
  """(the prompts as one [B, T] batch, each row's first slot [B], whether one 1-D
  prompt was given, whether a list of prompts (ragged) was)."""
  ragged = isinstance(prompt_tokens, (list, tuple)) and any(
    np.ndim(p) >= 1 for p in prompt_tokens
  )
  if ragged:
    if any(np.ndim(p) != 1 for p in prompt_tokens):
      raise ValueError('A list of prompts must hold 1-D token sequences.')
    prompt_BT, start_B = left_pad(prompt_tokens)
    return prompt_BT, start_B, False, True
  prompt = np.asarray(prompt_tokens, np.int32)
  single = prompt.ndim == 1
  prompt_BT = prompt[None] if single else prompt
  if prompt_BT.ndim != 2 or prompt_BT.shape[1] < 1:
    raise ValueError(
      f'prompt_tokens must be [T] or [B, T] with T >= 1, got shape {prompt.shape}.'
    )
  return prompt_BT, np.zeros((prompt_BT.shape[0],), np.int32), single, False


def _check_options(temperature, top_k, max_new_tokens, prefill_chunk, weights_dtype):
  """ValueError for a setting `generate` cannot use, before any compilation."""
  if temperature < 0:
    raise ValueError(f'temperature must be >= 0, got {temperature}.')
  if top_k is not None and top_k < 1:
    raise ValueError(f'top_k must be >= 1 or None, got {top_k}.')
  if max_new_tokens < 1:
    raise ValueError(f'max_new_tokens must be >= 1, got {max_new_tokens}.')
  if prefill_chunk is not None and prefill_chunk < 1:
    raise ValueError(f'prefill_chunk must be >= 1 or None, got {prefill_chunk}.')
  _serving_dtype(weights_dtype)  # a bad dtype fails here


def _prefill(served, prompt_BT, cache, start_B, prefill_chunk):
  """The prompt fed `prefill_chunk` tokens at a time (default all at once): (the
  logits after its last token [B, V], the cache). `served`: `serving_state`'s."""
  graphdef, state, layers = served
  prompt_len = prompt_BT.shape[1]
  chunk = prefill_chunk or prompt_len
  for index in range(0, prompt_len, chunk):
    logits_BV, cache = _prefill_chunk(
      graphdef,
      state,
      layers,
      jnp.asarray(prompt_BT[:, index : index + chunk]),
      cache,
      jnp.int32(index),
      start_B,
    )
  return logits_BV, cache


def _continue(
  served,
  token_B,
  logits_BV,
  cache,
  start_B,
  key,
  options,
  indices,
  *,
  stop_tokens,
  return_logits,
):
  """(the chosen tokens [B] per step, from `token_B` on; the logits [B, V] each was
  chosen from, when `return_logits`, else the first only): one `_step` per cache slot
  of `indices`, stopping early once every row produced one of `stop_tokens`."""
  graphdef, state, layers = served
  stop_S = jnp.asarray(np.asarray(stop_tokens, np.int32).reshape(-1))
  done_B = jnp.any(token_B[:, None] == stop_S[None, :], axis=-1)
  tokens, logits = [token_B], [logits_BV]
  for index in indices:
    # Asking whether every row is done waits for the step: only every 8 steps.
    if len(stop_tokens) and (index - indices.start) % 8 == 0 and bool(done_B.all()):
      break
    token_B, logits_BV, cache, done_B = _step(
      graphdef,
      state,
      layers,
      token_B,
      cache,
      jnp.int32(index),
      start_B,
      key,
      *options,
      stop_S,
      done_B,
    )
    tokens.append(token_B)
    if return_logits:
      logits.append(logits_BV)
  return tokens, logits


def _ragged_results(tokens_BN, logits_BNV, stop_tokens):
  """A list of prompts' results: each row cut after its stop token (and its logits
  when given)."""
  lengths = [_length_to_stop(row, stop_tokens) for row in tokens_BN]
  tokens_out = [row[:n] for row, n in zip(tokens_BN, lengths)]
  if logits_BNV is None:
    return tokens_out
  return tokens_out, [row[:n] for row, n in zip(logits_BNV, lengths)]


def _length_to_stop(tokens_N, stop_tokens) -> int:
  """The tokens up to and including the first stop token (all when none)."""
  stops = np.flatnonzero(np.isin(tokens_N, np.asarray(stop_tokens, np.int32)))
  return int(stops[0]) + 1 if stops.size else len(tokens_N)


def _unbatch(x, single):
  return x[0] if single else x


def generate_text(
  model: nnx.Module,
  prompt,
  max_new_tokens: int,
  *,
  add_separator: bool = False,
  tokenizer: tokenizer_lib.Tokenizer | None = None,
  **sampling_options,
):
  """The prompt's continuation as text, `max_new_tokens` tokens long (default
  tokenizer: bytes; a run's own is `data.make_tokenizer(config.data, workdir=...)`).
  An empty prompt starts a document. A list of prompts is generated as one batch and
  gives a list of texts. `sampling_options`: `generate`'s keyword arguments
  (temperature, top_k, seed, stop_tokens, prefill_chunk, weights_dtype)."""
  if 'return_logits' in sampling_options:
    raise TypeError('generate_text returns text only; use generate for the logits.')
  many = isinstance(prompt, (list, tuple))
  prompts = list(prompt) if many else [prompt]
  tokens = [
    encode_text(p, add_separator=add_separator or not p, tokenizer=tokenizer)
    for p in prompts
  ]
  new_tokens = generate(
    model, tokens if many else tokens[0], max_new_tokens, **sampling_options
  )
  if not many:
    return decode_tokens(new_tokens, tokenizer)
  return [decode_tokens(t, tokenizer) for t in new_tokens]
