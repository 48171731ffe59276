"""Residual connections behind one interface (`base.Residual`), one module each, and
the registry of the modes a config can name. Adding a residual: a module with a
`Residual` subclass, and one `register` line (here, or in the code that uses it)."""

from attnres_jax.residuals import attnres
from attnres_jax.residuals import base
from attnres_jax.residuals import hyper_connections
from attnres_jax.residuals import registry
from attnres_jax.residuals import standard
from attnres_jax.residuals.base import Applied, Residual
from attnres_jax.residuals.registry import make, names, no_decay_names, register

register('standard', standard.StandardResidual)
register('full', attnres.AttnResResidual)
register('block', attnres.AttnResResidual)
register('hc', hyper_connections.HyperConnectionResidual)
register('mhc', hyper_connections.HyperConnectionResidual)

__all__ = [
  'Applied',
  'Residual',
  'attnres',
  'base',
  'hyper_connections',
  'make',
  'names',
  'no_decay_names',
  'register',
  'registry',
  'standard',
]
