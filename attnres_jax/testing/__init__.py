"""Checks for code written against the library's interfaces: `check_residual` runs a
residual through training, evaluation, decoding, its FLOPs and I/O declarations and a
2-stage pipeline (`conformance.py`; docs/extending.md)."""

from attnres_jax.testing.conformance import (
  MODEL,
  PARTS,
  ConformanceError,
  check_residual,
  residual_name,
)

__all__ = ['MODEL', 'PARTS', 'ConformanceError', 'check_residual', 'residual_name']
