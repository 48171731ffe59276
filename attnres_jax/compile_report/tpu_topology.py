"""TPU topologies without a TPU: libtpu's compile-only devices for a topology name, and
the public per-chip figures (peak FLOP/s, HBM, bandwidth) the compile-only report
divides by.

libtpu's compile-only client is loaded by `get_topology` alone (with the environment
that keeps it quiet off Cloud TPU); the host's own backend stays what it was.
"""

from __future__ import annotations

import dataclasses
import glob
import importlib.util
import logging
import math
import os
import re
from typing import Any

import jax

TOPOLOGY_FORM = (
  "'<generation>:<chips along each axis>', generation one of v4, v5e, "
  'v5p, v6e: e.g. v5e:2x2, v5e:4x4, v5p:2x2x1, v5p:4x4x4, v6e:8x8'
)
_TOPOLOGY_NAME = re.compile(r'^(v4|v5e|v5p|v6e|v5litepod)[:=_]([0-9]+(x[0-9]+){1,2})$')
GIB = 2**30


class AotError(ValueError):
  """A compile-only request that cannot be served; the message says the fix."""


@dataclasses.dataclass(frozen=True)
class Chip:
  """Public per-chip figures: dense bf16 peak FLOP/s, HBM and its bandwidth."""

  generation: str
  peak_flops: float
  hbm_bytes: int
  hbm_bandwidth: float  # bytes/s


CHIPS = {  # by the compile-only devices' device_kind
  'TPU v4': Chip('v4', 275e12, 32 * GIB, 1.2e12),
  'TPU v5 lite': Chip('v5e', 197e12, 16 * GIB, 8.19e11),
  'TPU v5': Chip('v5p', 459e12, 95 * GIB, 2.765e12),
  'TPU v6 lite': Chip('v6e', 918e12, 32 * GIB, 1.64e12),
}


@dataclasses.dataclass(frozen=True)
class Topology:
  name: str
  num_slices: int
  devices: list[Any]
  chip: Chip
  num_chips: int

  @property
  def devices_per_chip(self) -> int:
    return len(self.devices) // self.num_chips

  @property
  def device_hbm_bytes(self) -> int:
    return self.chip.hbm_bytes // self.devices_per_chip

  @property
  def device_peak_flops(self) -> float:
    return self.chip.peak_flops / self.devices_per_chip


def _describe_no_tpu_host() -> None:
  # libtpu otherwise asks a metadata server (absent off Cloud) and warns at start-up
  # about the local host it will never run on; these describe no hardware.
  os.environ.setdefault('TPU_SKIP_MDS_QUERY', '1')
  os.environ.setdefault('TPU_WORKER_HOSTNAMES', 'localhost')
  os.environ.setdefault('TPU_ACCELERATOR_TYPE', 'v5litepod-1')


def host_has_tpu() -> bool:
  """Whether this host has TPU chips: the device files libtpu opens (/dev/accel* on
  v2-v4 and v6e VMs, /dev/vfio/<n> on v5e and v5p)."""
  return bool(glob.glob('/dev/accel[0-9]*') or glob.glob('/dev/vfio/[0-9]*'))


def quiet_backend_probe() -> None:
  """On a host without TPU chips, JAX's backend start-up still probes the installed
  libtpu, which prints five lines of warnings about metadata it cannot find before
  JAX falls back to the CPU or GPU. Describing the absent TPU host silences them; a
  TPU VM and a run that chose its platforms (JAX_PLATFORMS) are left alone. Must run
  before JAX's first device query (`import attnres_jax` does it)."""
  if not os.environ.get('JAX_PLATFORMS') and not host_has_tpu():
    _describe_no_tpu_host()
    # JAX then logs the failed TPU start-up at INFO, which absl's app (train.py,
    # eval.py, bench/) prints; on a host with no chips it says nothing.
    logging.getLogger('jax._src.xla_bridge').addFilter(_not_the_tpu_probe)


def _not_the_tpu_probe(record: logging.LogRecord) -> bool:
  return not (
    record.levelno <= logging.INFO
    and record.getMessage().startswith("Unable to initialize backend 'tpu'")
  )


def require_libtpu() -> None:
  if importlib.util.find_spec('libtpu') is None:
    raise AotError(
      '--compile_only needs the TPU compiler, which the libtpu wheel holds, '
      'and it is not installed: pip install -r requirements.txt (it pins '
      "libtpu), or pip install -e '.[tpu]'."
    )


def get_topology(name: str, num_slices: int = 1) -> Topology:
  """The compile-only devices of a TPU topology name (see TOPOLOGY_FORM)."""
  match = _TOPOLOGY_NAME.match(name or '')
  if match is None:
    raise AotError(f'Unknown TPU topology {name!r}: the form is {TOPOLOGY_FORM}.')
  if not isinstance(num_slices, int) or num_slices < 1:
    raise AotError(f'--num_slices must be a positive integer, got {num_slices!r}.')
  require_libtpu()
  _describe_no_tpu_host()
  # Compile-only: no chip is opened, so several processes (tests, a benchmark) may
  # load libtpu at once; its lockfile would refuse all but the first.
  os.environ.setdefault('ALLOW_MULTIPLE_LIBTPU_LOAD', '1')
  # Imported here: it loads libtpu's plugin, which a CPU run never needs.
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top

  try:
    desc = topologies.get_topology_desc(
      platform='tpu', topology_name=name, num_slices=num_slices
    )
  except jax.errors.JaxRuntimeError as e:
    reason = str(e).split('\n')[0]
    raise AotError(
      f'libtpu refused the TPU topology {name!r} ({reason}); the form is {TOPOLOGY_FORM}.'
    ) from None
  devices = list(desc.devices)
  kind = devices[0].device_kind
  if kind not in CHIPS:
    raise AotError(
      f'No chip figures for {kind!r} (topology {name!r}); known: {sorted(CHIPS)}.'
    )
  chips = math.prod(int(x) for x in match.group(2).split('x')) * num_slices
  return Topology(name, num_slices, devices, CHIPS[kind], chips)
