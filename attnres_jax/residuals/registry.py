"""Residual modes by name: `cfg.residual` -> the class that runs it.

`register(name, cls)` adds a mode (`residuals/__init__.py` registers the library's;
a notebook or test may register its own); `make(cfg)` builds the residual of a model
config, which the model keeps (`Transformer.residual`) and hands to everything else.

A residual outside the package needs no `register` line: `cfg.residual` may name it as
a plug-in, `'package.module:Class'` (an importable module) or `'path/to/file.py:Class'`
(a file anywhere; a relative path is from the working directory). The first `make` of
such a name imports the class and registers it under that exact string, so every entry
point that builds a model from a config (train.py, eval.py, notebooks, bench scripts)
runs it, and a run's stored config finds it again.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
from typing import Callable

from attnres_jax.residuals import base

# name -> factory(cfg) -> Residual (a Residual subclass taking the config).
_MODES: dict[str, Callable[..., base.Residual]] = {}

HOW_TO_ADD = (
  'add one with residuals.register(name, cls), or name a Residual subclass as '
  "'package.module:Class' or 'path/to/file.py:Class' "
  '(e.g. --config.model.residual=my_package.my_residual:MyResidual)'
)


def register(name: str, factory: Callable[..., base.Residual]) -> None:
  """Makes `cfg.residual == name` build `factory(cfg)`."""
  if name in _MODES and _MODES[name] is not factory:
    raise ValueError(
      f'Residual mode {name!r} is already registered ({_MODES[name].__name__}).'
    )
  _MODES[name] = factory


def names() -> tuple[str, ...]:
  return tuple(_MODES)


def is_plugin(name) -> bool:
  """Whether `name` has the plug-in form 'module:Class' or 'file.py:Class'."""
  return isinstance(name, str) and ':' in name


def factory(name: str) -> Callable[..., base.Residual]:
  """The factory registered under `name`, importing a plug-in on first use."""
  if name not in _MODES:
    if not is_plugin(name):
      raise ValueError(
        f'Invalid model config: residual must be one of {names()} or a plug-in, '
        f'got {name!r}; {HOW_TO_ADD}.'
      )
    register(name, _import_plugin(name))
  return _MODES[name]


def make(cfg) -> base.Residual:
  """The residual of a model config (not validated: `ModelConfig` validates)."""
  return factory(cfg.residual)(cfg)


def no_decay_names() -> frozenset[str]:
  """The residual parameter names that some registered residual spares weight decay
  (`optim.decay_mask` without a model config; with one, that residual's alone)."""
  return frozenset().union(*(getattr(f, 'no_decay', ()) for f in _MODES.values()))


def _import_plugin(name: str) -> type[base.Residual]:
  module_name, _, attribute = name.rpartition(':')
  where = f'Invalid model config: residual plug-in {name!r}'
  if not module_name or not attribute:
    raise ValueError(f"{where}: expected 'package.module:Class' or 'file.py:Class'.")
  try:
    if module_name.endswith('.py') or os.sep in module_name or '/' in module_name:
      module = _import_file(module_name)
    else:
      module = importlib.import_module(module_name)
  except Exception as e:  # any error of the user's module: its cause, in one line
    raise ValueError(
      f'{where}: importing {module_name!r} failed: {type(e).__name__}: {e}'
    ) from e
  cls = module
  for part in attribute.split('.'):
    cls = getattr(cls, part, None)
    if cls is None:
      raise ValueError(f'{where}: module {module_name!r} has no {attribute!r}.')
  if not (isinstance(cls, type) and issubclass(cls, base.Residual)):
    raise ValueError(
      f'{where}: {attribute!r} is not a subclass of attnres_jax.residuals.Residual.'
    )
  return cls


def _import_file(path: str):
  """The module of a Python file, imported once per absolute path under a name of its
  own (in sys.modules, as dataclasses and pickling need)."""
  path = os.path.abspath(path)
  if not os.path.isfile(path):
    raise FileNotFoundError(f'no such file {path!r}')
  stem = os.path.splitext(os.path.basename(path))[0]
  digest = hashlib.sha1(path.encode()).hexdigest()[:8]
  module_name = f'attnres_plugin_{stem}_{digest}'
  if module_name in sys.modules:
    return sys.modules[module_name]
  spec = importlib.util.spec_from_file_location(module_name, path)
  module = importlib.util.module_from_spec(spec)
  sys.modules[module_name] = module
  try:
    spec.loader.exec_module(module)
  except BaseException:
    del sys.modules[module_name]
    raise
  return module
