"""Cached decoding: per-token latency and prefill throughput of Standard, Full and
Block AttnRes (one-shot and two-phase reads).

For every (size, batch) it builds the residual modes (`--modes`, as every benchmark
spells them: attnres_jax/modes.py) with the same shared weights
(random non-zero AttnRes queries and gains, so the depth reads are not uniform),
jits a prefill and a one-token step per variant (the step is compiled ONCE: a fixed
max-length KV cache and a traced position; the benchmark asserts that neither
function compiled twice), then measures round-robin at the finest grain, so that
background load (the machine is shared) hits every variant alike: each repetition
prefills the prompt with every variant in turn, then runs `new_tokens - 1` greedy
one-token steps, every step of one variant followed by the same step of the next
(the order rotates every round). Every prefill and step is timed with
`block_until_ready`.

Reported per row: the per-token step time (median over all steps; also the minimum
and the 90th percentile), the prefill throughput (batch * prompt tokens / the median
prefill time), and the ratios to the standard model: per round, variant time /
standard time, then the median over rounds (> 1 means slower than standard);
`per_token_ratio_min` is the ratio of the fastest steps, the estimate with the least
background load in it.

A bare `block` uses the paper's setting of about `--num_blocks` (8) blocks at every
depth: S = round(L / 8) sublayers (L = 2 * layers), so S = 2 at 8 layers and S = 4
at 16 layers; `block:S` fixes S.

  python bench/decode.py                 # the full grid, about 5-10 min on 2 cores
  python bench/decode.py --quick         # a smoke run (seconds)
  python bench/decode.py --sizes=512x16 --batches=1 --repeats=9
"""

from __future__ import annotations

import datetime
import json
import os
import statistics
import subprocess
import time

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import attnres_jax as ar
from attnres_jax import modes as modes_lib
from attnres_jax.runs import metrics as metrics_lib

# Flag names differ from bench/memory.py's, so both modules can load in one process.
FLAGS = flags.FLAGS
flags.DEFINE_list('sizes', ['256x8', '512x16'], 'Model sizes as d_model x layers.')
flags.DEFINE_list('batches', ['1', '8'], 'Batch sizes.')
flags.DEFINE_list(
  'modes',
  ['standard', 'full', 'block'],
  f'Residual modes ({modes_lib.SYNTAX}); a bare block has about --num_blocks blocks.',
)
flags.DEFINE_enum('dtype', 'float32', ['float32', 'bfloat16'], 'Compute and cache dtype.')
flags.DEFINE_integer('num_blocks', 8, 'A bare block: S = round(L / num_blocks).')
flags.DEFINE_integer('prompt_len', 128, 'Prompt tokens (prefill).')
flags.DEFINE_integer('new_tokens', 64, 'Generated tokens (new_tokens - 1 timed steps).')
flags.DEFINE_integer('repeats', 3, 'Round-robin repetitions over the variants.')
flags.DEFINE_bool(
  'prefill_memory',
  False,
  'Instead: the compiled memory of chunked vs one-shot prefill across '
  'prompt lengths (compiles only; --memory_prompt_lens, --prefill_chunk).',
)
flags.DEFINE_list(
  'memory_prompt_lens',
  ['256', '512', '1024', '2048'],
  '--prefill_memory: prompt lengths.',
)
flags.DEFINE_integer('prefill_chunk', 256, '--prefill_memory: tokens per chunk.')
flags.DEFINE_string(
  'memory_jsonl_out',
  'bench/results/prefill_memory.jsonl',
  '--prefill_memory: JSON records (overwritten).',
)
flags.DEFINE_bool(
  'quick',
  False,
  'Smoke run: d=64x2, batch 1, prompt 16, 8 tokens, '
  '2 repetitions (overrides the grid flags).',
)
flags.DEFINE_string(
  'jsonl_out', 'bench/results/decode.jsonl', 'JSON records, one per row (overwritten).'
)
flags.DEFINE_string(
  'table_out',
  'bench/results/decode.md',
  'The printed table as Markdown (overwritten; empty: none).',
)

QUICK = dict(sizes=['64x2'], batches=['1'], prompt_len=16, new_tokens=8, repeats=2)
QUERY_SCALE = 0.1  # std of the random AttnRes pseudo-queries (see `build`)


def block_size_for(num_layers: int, num_blocks: int) -> int:
  return max(1, round(2 * num_layers / num_blocks))


def build(mode: str, d_model: int, num_layers: int, block_size: int):
  """The model of a residual mode; a bare `block` gets `block_size`."""
  cfg = ar.model_config(
    d_model=d_model,
    num_heads=max(1, d_model // 64),
    mlp_dim=4 * d_model,
    num_layers=num_layers,
    dtype=FLAGS.dtype,
    **modes_lib.fields(mode, block_size=block_size),
  )
  model = ar.Transformer(cfg, rngs=nnx.Rngs(0))  # same shared weights in every variant
  # Non-zero queries, but small: with unit-normal queries (|w| ~ sqrt(d)) the depth
  # softmax is nearly hard and a random Block model is ill-conditioned (an ulp-level
  # change of the embedding moves its logits by ~0.2 at d=512/16 layers), so the
  # two-phase and one-shot greedy tokens could part ways on float rounding alone.
  keys = jax.random.split(jax.random.key(1), 4)
  reads = model.layers.residual
  if reads is not None:
    reads.query[...] = QUERY_SCALE * jax.random.normal(keys[0], reads.query.shape)
    reads.gain[...] = 1 + 0.3 * jax.random.normal(keys[1], reads.gain.shape)
    final = model.final_residual
    final.query[...] = QUERY_SCALE * jax.random.normal(keys[2], final.query.shape)
  return model


class Runner:
  """One variant's jitted prefill and one-token step (greedy), compiled once each."""

  def __init__(self, variant, model, batch, cache_len):
    self.variant = variant
    self.model = model
    self.batch, self.cache_len = batch, cache_len
    graphdef, self.state = nnx.split(model)
    self.layers = model.decoding_layers()  # one buffer per weight (sampling does too)

    def prefill(state, layers, prompt_BT, cache):
      logits_BTV, cache = nnx.merge(graphdef, state).decode(
        prompt_BT, cache, 0, layers=layers
      )
      return jnp.argmax(logits_BTV[:, -1], axis=-1).astype(jnp.int32), cache

    def step(state, layers, token_B, cache, index):
      logits_B1V, cache = nnx.merge(graphdef, state).decode(
        token_B[:, None], cache, index, layers=layers
      )
      return jnp.argmax(logits_B1V[:, 0], axis=-1).astype(jnp.int32), cache

    self.prefill_fn = jax.jit(prefill, donate_argnums=3)
    self.step_fn = jax.jit(step, donate_argnums=3)

  def start(self, prompt_BT):
    """A fresh cache, then the timed prefill. Returns its seconds."""
    self.cache = self.model.init_cache(self.batch, self.cache_len)
    jax.block_until_ready(self.cache)
    start = time.perf_counter()
    self.token_B, self.cache = self.prefill_fn(
      self.state, self.layers, prompt_BT, self.cache
    )
    self.token_B.block_until_ready()
    self.index = prompt_BT.shape[1]
    self.tokens = [self.token_B]
    return time.perf_counter() - start

  def step(self):
    """One timed one-token step. Returns its seconds."""
    index = jnp.int32(self.index)
    start = time.perf_counter()
    self.token_B, self.cache = self.step_fn(
      self.state, self.layers, self.token_B, self.cache, index
    )
    self.token_B.block_until_ready()
    elapsed = time.perf_counter() - start
    self.index += 1
    self.tokens.append(self.token_B)
    return elapsed

  def generated(self):
    return np.asarray(jnp.stack(self.tokens, axis=1))

  def compilations(self):
    return self.prefill_fn._cache_size(), self.step_fn._cache_size()


BANDWIDTH_BYTES = 256 * 2**20  # the array the bandwidth probe reads (>> caches)


def make_bandwidth_probe():
  """A function measuring the memory read bandwidth (bytes/s): one jitted sum over a
  256 MiB float32 array, timed like a step."""
  array = jnp.ones((BANDWIDTH_BYTES // 4,), jnp.float32)
  total = jax.jit(jnp.sum)
  total(array).block_until_ready()

  def probe():
    start = time.perf_counter()
    total(array).block_until_ready()
    return BANDWIDTH_BYTES / (time.perf_counter() - start)

  return probe


def step_bytes(model, batch, filled_slots):
  """Bytes one decoding step must read at least: every parameter once (the tied
  embedding is the output layer) and the keys and values of the filled cache slots."""
  cfg = model.cfg
  weights = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
  cache = (
    2
    * cfg.num_layers
    * batch
    * cfg.d_model
    * filled_slots
    * jnp.dtype(cfg.dtype).itemsize
  )
  return weights + cache


def rotate(names, offset):
  offset %= len(names)
  return names[offset:] + names[:offset]


def git_commit() -> str:
  try:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    commit = subprocess.run(
      ['git', 'rev-parse', 'HEAD'], cwd=root, capture_output=True, text=True, check=True
    ).stdout.strip()
    dirty = subprocess.run(
      ['git', 'status', '--porcelain', '--untracked-files=no'],
      cwd=root,
      capture_output=True,
      text=True,
    ).stdout.strip()
    return commit + ('-dirty' if dirty else '')
  except (OSError, subprocess.CalledProcessError):
    return 'unknown'


def measure(d_model, num_layers, batch, settings, meta):
  """The rows of one (size, batch): every variant, round-robin over repetitions."""
  block_size = block_size_for(num_layers, FLAGS.num_blocks)
  prompt_len, new_tokens = settings['prompt_len'], settings['new_tokens']
  cache_len = prompt_len + new_tokens - 1
  prompt_BT = jax.random.randint(
    jax.random.key(2), (batch, prompt_len), 1, 256, jnp.int32
  )
  runners = {}
  compile_s = {}
  for variant in FLAGS.modes:
    start = time.perf_counter()
    runner = Runner(
      variant, build(variant, d_model, num_layers, block_size), batch, cache_len
    )
    runner.start(prompt_BT)  # compiles both functions (and warms up)
    for _ in range(2):
      runner.step()
    compile_s[variant] = time.perf_counter() - start
    runners[variant] = runner
  # Round-robin at the finest grain: every prefill, and every step, of one variant is
  # followed by the same one of the next variant (the order rotates every round), so
  # the ratios compare times taken within a fraction of a second of each other.
  names = list(runners)
  prefill_s = {v: [] for v in names}
  step_s = {v: [] for v in names}
  probe = make_bandwidth_probe()
  bandwidth = []  # sampled between the steps, in the same run as the steps
  rounds = 0
  for _ in range(settings['repeats']):
    for variant in rotate(names, rounds):
      prefill_s[variant].append(runners[variant].start(prompt_BT))
    for _ in range(new_tokens - 1):
      rounds += 1
      for variant in rotate(names, rounds):
        step_s[variant].append(runners[variant].step())
      if rounds % 4 == 0:
        bandwidth.append(probe())
  bytes_per_s = statistics.median(bandwidth or [probe()])
  # The timed steps feed slots prompt_len .. cache_len - 1, reading slots 0 .. index.
  mean_filled = prompt_len + 1 + (new_tokens - 2) / 2
  tokens = {v: runners[v].generated() for v in names}
  rows = []
  for variant, runner in runners.items():
    compiled = runner.compilations()
    assert compiled == (1, 1), (
      f'{variant}: prefill/step compiled {compiled} times, expected once each'
    )
    cfg = runner.model.cfg
    row = dict(
      mode=variant,
      residual=cfg.residual,
      depth_read='two_phase' if cfg.residual in ('full', 'block') else None,
      size=f'{d_model}x{num_layers}',
      d_model=d_model,
      num_layers=num_layers,
      num_sublayers=2 * num_layers,
      block_size=(
        cfg.block_size
        if cfg.residual == 'block'
        else 1
        if cfg.residual == 'full'
        else None
      ),
      batch=batch,
      prefill_len=prompt_len,
      new_tokens=new_tokens,
      cache_len=cache_len,
      repeats=settings['repeats'],
      per_token_ms=1e3 * statistics.median(step_s[variant]),
      per_token_ms_min=1e3 * min(step_s[variant]),
      per_token_ms_p90=1e3 * float(np.percentile(step_s[variant], 90)),
      prefill_ms=1e3 * statistics.median(prefill_s[variant]),
      prefill_tokens_per_s=batch * prompt_len / statistics.median(prefill_s[variant]),
      compile_and_warmup_s=compile_s[variant],
      step_compilations=compiled[1],
      read_bandwidth_gb_s=bytes_per_s / 1e9,
      roofline_ms=1e3 * step_bytes(runner.model, batch, mean_filled) / bytes_per_s,
      **meta,
    )
    row['per_token_over_roofline'] = row['per_token_ms'] / row['roofline_ms']
    if 'standard' in runners:
      row['per_token_ratio'] = statistics.median(
        a / b for a, b in zip(step_s[variant], step_s['standard'])
      )
      # Ratio of the fastest steps: an estimate with less background load in it.
      row['per_token_ratio_min'] = min(step_s[variant]) / min(step_s['standard'])
      row['prefill_time_ratio'] = statistics.median(
        a / b for a, b in zip(prefill_s[variant], prefill_s['standard'])
      )
    if variant == 'block' and 'block/one_shot' in tokens:
      # Same weights, same math: greedy tokens must agree (a sanity check).
      row['tokens_match_one_shot'] = bool(
        np.array_equal(tokens[variant], tokens['block/one_shot'])
      )
    rows.append(row)
  return rows


HEADER = (
  '| size | batch | mode | S | per-token ms | roofline ms | per-token / roofline '
  '| per-token / std | prefill tok/s | prefill time / std |'
)


def table_line(row):
  size = f'd{row["d_model"]}/{row["num_layers"]}L'
  s = '-' if row['block_size'] is None else str(row['block_size'])
  nan = float('nan')
  return (
    f'| {size} | {row["batch"]} | {row["mode"]} | {s} '
    f'| {row["per_token_ms"]:.2f} | {row["roofline_ms"]:.2f} '
    f'| {row["per_token_over_roofline"]:.2f} | {row.get("per_token_ratio", nan):.3f} '
    f'| {row["prefill_tokens_per_s"]:.0f} '
    f'| {row.get("prefill_time_ratio", nan):.3f} |'
  )


def run() -> list[dict]:
  """Measures the grid given by the flags; prints the table, writes the files and
  returns the records."""
  settings = dict(
    sizes=FLAGS.sizes,
    batches=FLAGS.batches,
    prompt_len=FLAGS.prompt_len,
    new_tokens=FLAGS.new_tokens,
    repeats=FLAGS.repeats,
  )
  if FLAGS.quick:
    settings.update(QUICK)
  if settings['new_tokens'] < 2:
    raise app.UsageError('--new_tokens must be >= 2 (one timed step at least).')
  meta = dict(
    jax_version=jax.__version__,
    backend=jax.default_backend(),
    device=str(jax.devices()[0].device_kind),
    git_commit=git_commit(),
    timestamp=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds'),
  )
  lines = [
    f'Cached decoding, {meta["backend"]} ({meta["device"]}), jax {meta["jax_version"]}, '
    f'commit {meta["git_commit"][:12]}: prompt {settings["prompt_len"]} tokens, '
    f'{settings["new_tokens"] - 1} timed one-token steps, {settings["repeats"]} '
    'repetitions, variants interleaved step by step (medians). Block: S = round(L / '
    f'{FLAGS.num_blocks}) sublayers. Ratios: variant / standard in the same '
    'repetition (> 1 = slower). Roofline: every parameter and the filled cache slots '
    'read once at the read bandwidth measured between the steps (a jitted sum over '
    f'{BANDWIDTH_BYTES >> 20} MiB).',
    '',
    HEADER,
    '|' + '---|' * 10,
  ]
  print('\n'.join(lines), flush=True)
  rows = []
  for size in settings['sizes']:
    d_model, num_layers = map(int, size.lower().split('x'))
    for batch in map(int, settings['batches']):
      for row in measure(d_model, num_layers, batch, settings, meta):
        rows.append(row)
        lines.append(table_line(row))
        print(lines[-1], flush=True)
  mismatched = [r for r in rows if r.get('tokens_match_one_shot') is False]
  if mismatched:
    note = (
      'note: two-phase and one-shot greedy tokens differ in '
      f'{len(mismatched)} row(s) (float ties?)'
    )
    lines += ['', note]
    print(note)
  for path in (FLAGS.jsonl_out, FLAGS.table_out):
    if path:
      os.makedirs(os.path.dirname(path) or '.', exist_ok=True)
  with open(FLAGS.jsonl_out, 'w') as f:
    for row in rows:
      f.write(json.dumps(row) + '\n')
  if FLAGS.table_out:
    with open(FLAGS.table_out, 'w') as f:
      f.write('\n'.join(lines) + '\n')
  print(f'wrote {len(rows)} records to {FLAGS.jsonl_out}')
  return rows


def prefill_memory() -> list[dict]:
  """XLA's temporary memory of one prefill call (chunk of C tokens at the end of the
  prompt, cache = prompt length) against the whole prompt in one call."""
  quick = FLAGS.quick
  sizes = QUICK['sizes'] if quick else FLAGS.sizes[-1:]
  lengths = [32, 64] if quick else [int(n) for n in FLAGS.memory_prompt_lens]
  chunk = 16 if quick else FLAGS.prefill_chunk
  rows = []
  header = (
    '| size | mode | prompt | chunk | temp MiB, chunked | temp MiB, one shot '
    '| over std MiB, chunked | over std MiB, one shot |'
  )
  print(
    f'Prefill memory (XLA temp of one compiled call, batch 1, chunk {chunk}):\n\n'
    + header
    + '\n'
    + '|---' * 8
    + '|',
    flush=True,
  )
  for size in sizes:
    d_model, num_layers = map(int, size.lower().split('x'))
    block_size = block_size_for(num_layers, FLAGS.num_blocks)
    for length in lengths:
      temps = {}
      for variant in ('standard', 'block'):
        model = build(variant, d_model, num_layers, block_size)
        graphdef, state = nnx.split(model)
        layers = model.decoding_layers()

        def prefill(state, layers, tokens_BT, cache, index):
          return nnx.merge(graphdef, state).decode(tokens_BT, cache, index, layers=layers)

        fn = jax.jit(prefill, donate_argnums=3)
        cache = jax.eval_shape(lambda: model.init_cache(1, length))
        for name, tokens in (('chunked', chunk), ('one_shot', length)):
          tokens_BT = jax.ShapeDtypeStruct((1, tokens), jnp.int32)
          analysis = (
            fn.lower(state, layers, tokens_BT, cache, jnp.int32(length - tokens))
            .compile()
            .memory_analysis()
          )
          temps[variant, name] = analysis.temp_size_in_bytes
      for variant in ('standard', 'block'):
        row = dict(
          size=size,
          mode=variant,
          prompt_len=length,
          chunk=chunk,
          temp_mib_chunked=temps[variant, 'chunked'] / 2**20,
          temp_mib_one_shot=temps[variant, 'one_shot'] / 2**20,
          # What the depth state adds to the standard model's temp.
          over_std_mib_chunked=(temps[variant, 'chunked'] - temps['standard', 'chunked'])
          / 2**20,
          over_std_mib_one_shot=(
            temps[variant, 'one_shot'] - temps['standard', 'one_shot']
          )
          / 2**20,
        )
        rows.append(row)
        print(
          f'| d{d_model}/{num_layers}L | {variant} | {length} | {chunk} '
          f'| {row["temp_mib_chunked"]:.1f} | {row["temp_mib_one_shot"]:.1f} '
          f'| {row["over_std_mib_chunked"]:.1f} | {row["over_std_mib_one_shot"]:.1f} |',
          flush=True,
        )
  metrics_lib.write_jsonl(FLAGS.memory_jsonl_out, rows)
  return rows


def main(argv):
  del argv
  if FLAGS.prefill_memory:
    prefill_memory()
  else:
    run()


if __name__ == '__main__':
  app.run(main)
