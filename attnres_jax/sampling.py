"""Text generation with the KV cache: one prefill, then a jitted one-token step.

The cache has a fixed length (prompt + new tokens, rounded up to CACHE_ROUNDING); the
position, temperature and top_k are traced arguments, so the step compiles once per
(model, batch, cache length) and is reused for every position and setting. Sampling
keys are `fold_in(PRNGKey(seed), position)`: a fixed seed gives a fixed output.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from attnres_jax import evaluate as evaluate_lib
from attnres_jax import tokenizer as tokenizer_lib

SEPARATOR = 0  # the document-start byte of the data pipeline (data.SEPARATOR)
CACHE_ROUNDING = 64  # the KV cache length is a multiple of this
_BYTES = tokenizer_lib.ByteTokenizer()


def encode_text(text: str, *, add_separator: bool = False,
                tokenizer: tokenizer_lib.Tokenizer | None = None) -> np.ndarray:
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


@functools.partial(jax.jit, static_argnames=('graph',))
def _prefill(graph, state, prompt_BT, cache, key, temperature, top_k):
  model = nnx.merge(graph.graphdef, state)
  logits_BTV, cache = model.decode(prompt_BT, cache, 0)
  position = prompt_BT.shape[1]
  token_B = _choose(logits_BTV[:, -1], jax.random.fold_in(key, position), temperature,
                    top_k)
  return token_B, logits_BTV[:, -1], cache


@functools.partial(jax.jit, static_argnames=('graph',), donate_argnames=('cache',))
def _step(graph, state, token_B, cache, index, key, temperature, top_k):
  """Feeds the token at position `index` and chooses the token at `index + 1`."""
  model = nnx.merge(graph.graphdef, state)
  logits_B1V, cache = model.decode(token_B[:, None], cache, index)
  token_B = _choose(logits_B1V[:, 0], jax.random.fold_in(key, index + 1), temperature,
                    top_k)
  return token_B, logits_B1V[:, 0], cache


def decode_step_cache_size() -> int:
  """How many versions of the one-token step are compiled (for tests)."""
  return _step._cache_size()


def generate(model: nnx.Module, prompt_tokens, max_new_tokens: int, *,
             temperature: float = 1.0, top_k: int | None = None, seed: int = 0,
             return_logits: bool = False):
  """Continues `prompt_tokens` ([T] or [B, T] ints, T >= 1) by `max_new_tokens` tokens.

  temperature == 0 is greedy (argmax); otherwise tokens are drawn from
  softmax(logits / temperature), restricted to the `top_k` most likely when given.
  Returns the new tokens as int32 [max_new_tokens] (or [B, max_new_tokens]); with
  `return_logits`, also the float32 logits each token was chosen from,
  [max_new_tokens, V] (or [B, max_new_tokens, V]).
  """
  prompt = np.asarray(prompt_tokens, np.int32)
  single = prompt.ndim == 1
  prompt_BT = prompt[None] if single else prompt
  if prompt_BT.ndim != 2 or prompt_BT.shape[1] < 1:
    raise ValueError(f'prompt_tokens must be [T] or [B, T] with T >= 1, got '
                     f'shape {prompt.shape}.')
  if temperature < 0:
    raise ValueError(f'temperature must be >= 0, got {temperature}.')
  if top_k is not None and top_k < 1:
    raise ValueError(f'top_k must be >= 1 or None, got {top_k}.')
  if max_new_tokens < 1:
    raise ValueError(f'max_new_tokens must be >= 1, got {max_new_tokens}.')
  batch, prompt_len = prompt_BT.shape

  vocab = model.cfg.vocab_size
  options = (jnp.float32(temperature), jnp.int32(min(top_k or vocab, vocab)))
  key = jax.random.PRNGKey(seed)
  graph, state = evaluate_lib.split_model(model)
  # The last new token is never fed back, so the cache needs one slot less. Its length
  # is rounded up (unused slots are masked) so that nearby lengths share a compilation.
  needed = prompt_len + max_new_tokens - 1
  cache = model.init_cache(batch, -(-needed // CACHE_ROUNDING) * CACHE_ROUNDING)
  token_B, logits_BV, cache = _prefill(graph, state, jnp.asarray(prompt_BT), cache,
                                       key, *options)
  tokens, logits = [token_B], [logits_BV]
  for index in range(prompt_len, prompt_len + max_new_tokens - 1):
    token_B, logits_BV, cache = _step(graph, state, token_B, cache,
                                      jnp.int32(index), key, *options)
    tokens.append(token_B)
    if return_logits:
      logits.append(logits_BV)
  tokens_BN = np.asarray(jnp.stack(tokens, axis=1))
  if not return_logits:
    return _unbatch(tokens_BN, single)
  return _unbatch(tokens_BN, single), _unbatch(np.asarray(jnp.stack(logits, 1)), single)


def _unbatch(x, single):
  return x[0] if single else x


def generate_text(model: nnx.Module, prompt: str, max_new_tokens: int, *,
                  temperature: float = 1.0, top_k: int | None = None, seed: int = 0,
                  add_separator: bool = False,
                  tokenizer: tokenizer_lib.Tokenizer | None = None) -> str:
  """The prompt's continuation as text, `max_new_tokens` tokens long (default
  tokenizer: bytes; a run's own is `data.make_tokenizer(config.data, workdir=...)`).
  An empty prompt starts a document."""
  tokens = encode_text(prompt, add_separator=add_separator or not prompt,
                       tokenizer=tokenizer)
  new_tokens = generate(model, tokens, max_new_tokens, temperature=temperature,
                        top_k=top_k, seed=seed)
  return decode_tokens(new_tokens, tokenizer)
