"""Residual modes as short strings: the one vocabulary of every command-line tool.

    standard | full | block:S | hc[:m] | mhc[:m]      optionally followed by @G

`block:4` is Block AttnRes with blocks of S = 4 sublayers, `hc:4`/`mhc:4` the
(manifold-constrained) Hyper-Connections with m = 4 streams (the default), and `@G`
runs the AttnRes block schedule in segments of G layers (`schedule_layers`). A mode
string names model fields only; every other field keeps its value.

Directory and run names cannot hold ':' everywhere, so runs are named by `run_name`
(`block:4` -> `block_s4`, `mhc:4` -> `mhc`), the names the study's configs use.
"""

from __future__ import annotations

SYNTAX = 'standard | full | block:S | hc[:m] | mhc[:m], optionally @G (segment layers)'
DEFAULT_STREAMS = 4


def _error(mode: str, why: str) -> ValueError:
  return ValueError(f'Invalid residual mode {mode!r}: {why}. Modes are {SYNTAX}.')


def _positive_int(mode: str, text: str, what: str) -> int:
  if not text.isdigit() or int(text) < 1:
    raise _error(mode, f'{what} must be a positive integer, got {text!r}')
  return int(text)


def fields(mode: str) -> dict[str, object]:
  """The model-config fields a mode string sets, e.g. 'block:4@2' ->
  dict(residual='block', block_size=4, schedule_layers=2)."""
  body, has_segment, segment = mode.partition('@')
  residual, has_size, size = body.partition(':')
  out: dict[str, object] = dict(residual=residual)
  if residual in ('standard', 'full'):
    if has_size:
      raise _error(mode, f'{residual} takes no size')
  elif residual == 'block':
    if not has_size:
      raise _error(mode, 'block needs its block size, e.g. block:4')
    out['block_size'] = _positive_int(mode, size, 'the block size')
  elif residual in ('hc', 'mhc'):
    out['hc_streams'] = (
      _positive_int(mode, size, 'the stream count') if has_size else DEFAULT_STREAMS
    )
  else:
    raise _error(mode, f'unknown residual {residual!r}')
  if has_segment:
    if residual not in ('full', 'block'):
      raise _error(mode, '@G (segment layers) applies to full and block only')
    out['schedule_layers'] = _positive_int(mode, segment, 'the segment length G')
  return out


def parse_list(text: str) -> list[str]:
  """A comma-separated list of modes, each checked (a typo fails before any work)."""
  modes = [m.strip() for m in text.split(',') if m.strip()]
  for mode in modes:
    fields(mode)
  if not modes:
    raise ValueError(f'No residual mode given. Modes are {SYNTAX}.')
  return modes


def run_name(mode: str) -> str:
  """A file-system friendly name for a mode: 'block:4' -> 'block_s4', 'hc:4' -> 'hc',
  'hc:2' -> 'hc_m2', 'full@2' -> 'full_g2'."""
  f = fields(mode)
  name = str(f['residual'])
  if 'block_size' in f:
    name += f'_s{f["block_size"]}'
  if f.get('hc_streams', DEFAULT_STREAMS) != DEFAULT_STREAMS:
    name += f'_m{f["hc_streams"]}'
  if 'schedule_layers' in f:
    name += f'_g{f["schedule_layers"]}'
  return name
