"""The conformance check (`attnres_jax.testing.check_residual`, docs/extending.md) for
every residual registered when this module is collected: the library's (and any that a
test module collected before it registers). The parts that run in this process for all;
the pipeline, a 2-device child process each, for one AttnRes mode here and for the toy
residual and ReZero in test_residual.py, which checks those two whole."""

import pytest

from attnres_jax import residuals
from attnres_jax import testing

PIPELINED = ('block',)
CHECKED_WHOLE_ELSEWHERE = ('gated', 'rezero')  # test_residual.py


@pytest.mark.parametrize(
  'name', [n for n in residuals.names() if n not in CHECKED_WHOLE_ELSEWHERE]
)
def test_every_registered_residual_passes_the_conformance_check(name):
  parts = [p for p in testing.PARTS if p != 'pipeline' or name in PIPELINED]
  report = testing.check_residual(name, parts=parts)
  assert set(report) == {'residual', *parts}
  if name in PIPELINED:
    assert 'refused' not in report['pipeline']
