"""Abstract operands of the small programs the compile-report tests compile for a
v5e:2x2 slice on this host (needs libtpu)."""

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from attnres_jax.compile_report import aot


def v5e_operands(dtype, weight_shape):
  """(x [512, 256] split by rows over the 4 chips, a weight of `weight_shape` whole on
  every chip), both of `dtype`."""
  topo = aot.get_topology('v5e:2x2')
  mesh = jax.sharding.Mesh(np.array(topo.devices), ('x',))
  x = jax.ShapeDtypeStruct((512, 256), dtype, sharding=NamedSharding(mesh, P('x')))
  w = jax.ShapeDtypeStruct(weight_shape, dtype, sharding=NamedSharding(mesh, P()))
  return x, w
