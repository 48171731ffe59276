"""Residual modes as short strings: the one vocabulary of every command-line tool.

    standard | full | block:S | hc[:m] | mhc[:m]      then optionally @G and /options

`block:4` is Block AttnRes with blocks of S = 4 sublayers, `hc:4`/`mhc:4` the
(manifold-constrained) Hyper-Connections with m = 4 streams (the default), `@G`
runs the AttnRes block schedule in segments of G layers (`schedule_layers`; for
`standard`, the scan's body holds G layers: the same computation), and options
follow, each after a '/': `bf16` or `f32` the AttnRes depth state's storage
(`depth_dtype`), e.g. `block:4/bf16`; `pallas` or `xla` the kernels
(`depth_kernel`; by default chosen by the platform: `docs/design_choices.md`), e.g.
`block:4/bf16/pallas`; for `hc`/`mhc` `pallas` and `xla` only (the stream write's
and mHC's Sinkhorn kernels), e.g. `mhc/pallas`. A tool whose block size follows the
depth (bench/decode.py: about 8 blocks at every depth) accepts a bare `block` and
supplies S. A mode string names model fields only; every other field keeps its value.
Any other residual in the registry is a mode too, by its registered name, and so is a
plug-in (`package.module:Class` or `path/to/file.py:Class`, `residuals/registry.py`):
these take no size, segments or options.

Directory and run names cannot hold ':' everywhere, so runs are named by `run_name`
(`block:4` -> `block_s4`, `mhc:4` -> `mhc`), the names the study's configs use.
"""

from __future__ import annotations

import re

from attnres_jax import residuals

SYNTAX = (
  'standard | full | block:S | hc[:m] | mhc[:m], then optionally @G (segment layers) '
  'and options /bf16 or /f32 (AttnRes storage), /pallas or /xla (the kernels: '
  "AttnRes's Phase 1, HC's and mHC's write and Sinkhorn; default: by platform); or "
  'any registered residual by name, or a plug-in package.module:Class or '
  'path/to/file.py:Class'
)
STRUCTURED = ('standard', 'full', 'block', 'hc', 'mhc')  # the modes with a syntax
OPTIONS = {  # option -> (model field, value)
  'bf16': ('depth_dtype', 'bfloat16'),
  'f32': ('depth_dtype', 'float32'),
  'pallas': ('depth_kernel', 'pallas'),
  'xla': ('depth_kernel', 'xla'),
}
KERNEL_OPTIONS = ('pallas', 'xla')  # the options of hc and mhc
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
  if re.split('[:@/]', mode, maxsplit=1)[0] not in STRUCTURED:
    return _registered_fields(mode)
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
    if residual not in ('full', 'block') and option not in KERNEL_OPTIONS:
      raise _error(
        mode, '/options apply to full and block only (hc, mhc: /pallas or /xla)'
      )
    if option not in OPTIONS:
      raise _error(mode, f'options are {tuple(OPTIONS)}, got {option!r}')
    field, value = OPTIONS[option]
    if field in out:
      raise _error(mode, f'{field} given twice')
    out[field] = value
  return out


def _registered_fields(mode: str) -> dict[str, object]:
  """A registered residual or a plug-in, named whole (imported now, so that a typo or
  a broken plug-in fails before any work)."""
  try:
    residuals.registry.factory(mode)
  except ValueError as e:
    raise _error(
      mode, str(e).removeprefix('Invalid model config: ').rstrip('.')
    ) from None
  return dict(residual=mode)


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
  'hc:2' -> 'hc_m2', 'full@2' -> 'full_g2', 'full/bf16/pallas' ->
  'full_bf16_pallas'."""
  f = fields(mode)
  name = str(f['residual'])
  if residuals.registry.is_plugin(name):  # 'dir/my_residual.py:MyResidual' -> the class
    return re.sub(r'\W+', '_', name.rpartition(':')[2]).lower()
  if 'block_size' in f:
    name += f'_s{f["block_size"]}'
  if f.get('hc_streams', DEFAULT_STREAMS) != DEFAULT_STREAMS:
    name += f'_m{f["hc_streams"]}'
  if 'schedule_layers' in f:
    name += f'_g{f["schedule_layers"]}'
  for option in mode.split('/')[1:]:
    name += f'_{option}'
  return name
