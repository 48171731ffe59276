"""Residual modes as short strings: the one vocabulary of every command-line tool.

    standard | full | block:S | hc[:m] | mhc[:m]      then optionally @G and /options

`block:4` is Block AttnRes with blocks of S = 4 sublayers, `hc:4`/`mhc:4` the
(manifold-constrained) Hyper-Connections with m = 4 streams (the default), `@G`
runs the AttnRes block schedule in segments of G layers (`schedule_layers`; for
`standard`, the scan's body holds G layers: the same computation), and
AttnRes options follow, each after a '/': `one_shot` or `two_phase` picks the read
(`depth_read`), `bf16` or `f32` the depth state's storage (`depth_dtype`), e.g.
`block:4/bf16` or `full/one_shot`; `pallas` computes Phase 1 with the Pallas
kernel (`depth_kernel`), e.g. `block:4/bf16/pallas`; `barrier` finishes each layer's
gradients before the next in the backward (`backward_layer_barrier`);
`keep_phase1` or `recompute_phase1` has the linear-memory backward take Phase 1's
results from the forward pass or compute them again (`phase1_backward`; default
automatic, with `pallas`); `prefixes:N`
has the XLA Phase 1 read the shortest of N static buffer prefixes that holds a
segment's completed slots (`depth_read_prefixes`), e.g. `full/prefixes:4`; for `hc`/`mhc`
(its only option) the stream write's and mHC's Sinkhorn kernels, e.g. `mhc/pallas`. A tool
whose block size follows the depth (bench/decode.py: about 8 blocks at every depth)
accepts a bare `block` and supplies S. A mode string names model fields only; every other field
keeps its value.

Directory and run names cannot hold ':' everywhere, so runs are named by `run_name`
(`block:4` -> `block_s4`, `mhc:4` -> `mhc`), the names the study's configs use.
"""

from __future__ import annotations

SYNTAX = (
  'standard | full | block:S | hc[:m] | mhc[:m], then optionally @G (segment layers) '
  'and AttnRes options /one_shot or /two_phase (the read), /bf16 or /f32 (storage), '
  '/pallas (the Phase 1 kernel; for hc and mhc the write and Sinkhorn kernels), '
  '/barrier (the backward layer by layer), /keep_phase1 or /recompute_phase1 (the '
  "backward's Phase 1 results), /prefixes:N (XLA Phase 1 reads the "
  'shortest of N buffer prefixes)'
)
OPTIONS = {  # AttnRes option -> (model field, value)
  'one_shot': ('depth_read', 'one_shot'),
  'two_phase': ('depth_read', 'two_phase'),
  'bf16': ('depth_dtype', 'bfloat16'),
  'f32': ('depth_dtype', 'float32'),
  'pallas': ('depth_kernel', 'pallas'),
  'barrier': ('backward_layer_barrier', True),
  'keep_phase1': ('phase1_backward', 'keep'),
  'recompute_phase1': ('phase1_backward', 'recompute'),
}
COUNTED_OPTIONS = {  # AttnRes option name:N -> the model field that takes N
  'prefixes': 'depth_read_prefixes',
}
DEFAULT_STREAMS = 4


def _error(mode: str, why: str) -> ValueError:
  return ValueError(f'Invalid residual mode {mode!r}: {why}. Modes are {SYNTAX}.')


def _positive_int(mode: str, text: str, what: str) -> int:
  if not text.isdigit() or int(text) < 1:
    raise _error(mode, f'{what} must be a positive integer, got {text!r}')
  return int(text)


def fields(mode: str, *, block_size: int | None = None) -> dict[str, object]:
  """The model-config fields a mode string sets, e.g. 'block:4@2' ->
  dict(residual='block', block_size=4, schedule_layers=2). `block_size` is what a bare
  `block` gets (none: a bare `block` is an error)."""
  rest, *options = mode.split('/')
  body, has_segment, segment = rest.partition('@')
  residual, has_size, size = body.partition(':')
  out: dict[str, object] = dict(residual=residual)
  if residual in ('standard', 'full'):
    if has_size:
      raise _error(mode, f'{residual} takes no size')
  elif residual == 'block':
    if has_size:
      out['block_size'] = _positive_int(mode, size, 'the block size')
    elif block_size is not None:
      out['block_size'] = block_size
    else:
      raise _error(mode, 'block needs its block size, e.g. block:4')
  elif residual in ('hc', 'mhc'):
    out['hc_streams'] = (
      _positive_int(mode, size, 'the stream count') if has_size else DEFAULT_STREAMS
    )
  else:
    raise _error(mode, f'unknown residual {residual!r}')
  if has_segment:
    if residual not in ('standard', 'full', 'block'):
      raise _error(mode, '@G (segment layers) applies to standard, full and block only')
    out['schedule_layers'] = _positive_int(mode, segment, 'the segment length G')
  for option in options:
    if residual not in ('full', 'block') and option != 'pallas':
      raise _error(mode, '/options apply to full and block only (hc, mhc: /pallas)')
    name, has_count, count = option.partition(':')
    if has_count and name in COUNTED_OPTIONS:
      field, value = COUNTED_OPTIONS[name], _positive_int(mode, count, name)
    elif option in OPTIONS:
      field, value = OPTIONS[option]
    else:
      options_known = tuple(OPTIONS) + tuple(f'{n}:N' for n in COUNTED_OPTIONS)
      raise _error(mode, f'options are {options_known}, got {option!r}')
    if field in out:
      raise _error(mode, f'{field} given twice')
    out[field] = value
  return out


def parse_list(text: str, *, block_size: int | None = None) -> list[str]:
  """A comma-separated list of modes, each checked (a typo fails before any work)."""
  modes = [m.strip() for m in text.split(',') if m.strip()]
  for mode in modes:
    fields(mode, block_size=block_size)
  if not modes:
    raise ValueError(f'No residual mode given. Modes are {SYNTAX}.')
  return modes


def run_name(mode: str) -> str:
  """A file-system friendly name for a mode: 'block:4' -> 'block_s4', 'hc:4' -> 'hc',
  'hc:2' -> 'hc_m2', 'full@2' -> 'full_g2', 'full/one_shot/bf16' ->
  'full_one_shot_bf16'."""
  f = fields(mode)
  name = str(f['residual'])
  if 'block_size' in f:
    name += f'_s{f["block_size"]}'
  if f.get('hc_streams', DEFAULT_STREAMS) != DEFAULT_STREAMS:
    name += f'_m{f["hc_streams"]}'
  if 'schedule_layers' in f:
    name += f'_g{f["schedule_layers"]}'
  for option in mode.split('/')[1:]:
    name += f'_{option.replace(":", "")}'
  return name
