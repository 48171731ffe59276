"""Residual connections behind one interface (`base.Residual`), one module each, and
the registry of the modes a config can name. Adding a residual: a module with a
`Residual` subclass, and one `register` line (here, or in the code that uses it), or
none: a config may name it as a plug-in, 'package.module:Class' or 'file.py:Class'
(`registry`; docs/extending.md)."""

from attnres_jax.residuals import base
from attnres_jax.residuals import registry
from attnres_jax.residuals import rezero
from attnres_jax.residuals import standard
from attnres_jax.residuals.attnres.residual import AttnResResidual
from attnres_jax.residuals.base import Applied, Residual
from attnres_jax.residuals.hyper.connections import HyperConnectionResidual
from attnres_jax.residuals.registry import make, names, no_decay_names, register

register('standard', standard.StandardResidual)
register('full', AttnResResidual)
register('block', AttnResResidual)
register('hc', HyperConnectionResidual)
register('mhc', HyperConnectionResidual)
register('rezero', rezero.ReZeroResidual)

__all__ = [
  'Applied',
  'AttnResResidual',
  'HyperConnectionResidual',
  'Residual',
  'base',
  'make',
  'names',
  'no_decay_names',
  'register',
  'registry',
  'rezero',
  'standard',
]
