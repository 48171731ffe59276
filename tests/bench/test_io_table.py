"""bench/io_table.py: the itemised residual I/O adds up to the counted total, and the
papers' formulas are evaluated at the row's own N, S and m."""

import numpy as np
import pytest

from attnres_jax import flops
from bench import io_table


@pytest.mark.parametrize(
  'mode', ['standard', 'full', 'block:2', 'block:4', 'block:8', 'hc', 'mhc']
)
@pytest.mark.parametrize('num_layers', [1, 3, 4, 16])
def test_items_add_up_to_the_counted_total(mode, num_layers):
  cfg = io_table.model_config(mode, num_layers)
  items = io_table.itemised_io(cfg)
  assert set(items) <= set(io_table.ITEMS)
  # Two countings of the same model: sums of small dyadic fractions, exact in float64
  # up to the reassociation of a few additions.
  np.testing.assert_allclose(
    sum(items.values()), flops.residual_io_per_sublayer(cfg)['total'], rtol=1e-12
  )


def test_paper_formulas_at_the_rows_own_values():
  # Block: (N/S + 5)d with N = ceil(L / S); 16 layers = 32 sublayers.
  assert io_table.paper_formula(io_table.model_config('block:4', 16)) == [
    ('(N/S + 5)d, N = 8, S = 4', 7.0)
  ]
  assert io_table.paper_formula(io_table.model_config('block:8', 4))[0][1] == 5.125
  # mHC at m = 4: 34d unfused (the AttnRes paper's entry), 18d fused.
  assert [v for _, v in io_table.paper_formula(io_table.model_config('mhc', 4))] == [
    34.0,
    18.0,
  ]
  assert io_table.paper_formula(io_table.model_config('full', 4)) == []
