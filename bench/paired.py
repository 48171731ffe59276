"""Paired comparisons over seeds: two residuals trained on the same seed see the same
data order and initial embedding, so their difference per seed is the measured
quantity, and its spread over seeds is the uncertainty."""

from __future__ import annotations

import numpy as np
from scipy import stats


def t_interval(differences, confidence: float = 0.95) -> tuple[float, float]:
  """The Student-t interval of the mean of paired differences (n - 1 degrees of
  freedom); (nan, nan) with fewer than 2 pairs, where no spread is measured."""
  d = np.asarray(differences, float)
  if d.size < 2:
    return float('nan'), float('nan')
  half = stats.t.ppf(0.5 + confidence / 2, d.size - 1) * d.std(ddof=1) / np.sqrt(d.size)
  return float(d.mean() - half), float(d.mean() + half)


def compare(values: dict, reference: dict, confidence: float = 0.95) -> dict:
  """`values` against `reference` ({seed: metric}) over the seeds both have: the mean
  paired difference, its t interval, and both relative to the reference's mean."""
  seeds = sorted(set(values) & set(reference))
  d = np.array([values[s] - reference[s] for s in seeds])
  base = float(np.mean([reference[s] for s in seeds]))
  low, high = t_interval(d, confidence)
  return dict(
    seeds=seeds,
    difference=float(d.mean()),
    t_interval=[low, high],
    relative=float(d.mean() / base),
    relative_t_interval=[low / base, high / base],
    standard_error=float(d.std(ddof=1) / np.sqrt(d.size)) if d.size > 1 else None,
  )
