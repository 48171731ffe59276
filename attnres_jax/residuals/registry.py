"""Residual modes by name: `cfg.residual` -> the class that runs it.

`register(name, cls)` adds a mode (`residuals/__init__.py` registers the library's;
a notebook or test may register its own); `make(cfg)` builds the residual of a model
config, which the model keeps (`Transformer.residual`) and hands to everything else.
"""

from __future__ import annotations

from typing import Callable

from attnres_jax.residuals import base

# name -> factory(cfg) -> Residual (a Residual subclass taking the config).
_MODES: dict[str, Callable[..., base.Residual]] = {}


def register(name: str, factory: Callable[..., base.Residual]) -> None:
  """Makes `cfg.residual == name` build `factory(cfg)`."""
  if name in _MODES and _MODES[name] is not factory:
    raise ValueError(
      f'Residual mode {name!r} is already registered ({_MODES[name].__name__}).'
    )
  _MODES[name] = factory


def names() -> tuple[str, ...]:
  return tuple(_MODES)


def make(cfg) -> base.Residual:
  """The residual of a model config (not validated: `ModelConfig` validates)."""
  if cfg.residual not in _MODES:
    raise ValueError(
      f'Invalid model config: residual must be one of {names()}, got {cfg.residual!r}.'
    )
  return _MODES[cfg.residual](cfg)


def no_decay_names() -> frozenset[str]:
  """The residual parameter names that no registered residual decays."""
  return frozenset().union(
    *(getattr(f, 'no_decay', frozenset()) for f in _MODES.values())
  )
