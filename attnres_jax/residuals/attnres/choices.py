"""How AttnRes is computed where the config leaves it to the library: the automatic
rules, each with the measurement behind it (docs/design_choices.md gathers them).
They change how the same function is computed, never what it computes (the
equivalence tests of tests/residuals/ hold for every choice). `residual` is an
`AttnResResidual`, whose test-only fields may force a choice (`residual.py`).
"""

from __future__ import annotations

from attnres_jax.kernels import pallas_mesh
from attnres_jax.residuals.attnres import schedule as attnres_schedule

# Phase 1 prefixes of Full AttnRes on the XLA path.
FULL_PREFIXES = 4


def phase1_kernel(residual) -> str:
  """'pallas' or 'xla': how Phase 1 (and the final read) is computed, at trace time.
  `model.depth_kernel='auto'`: the Pallas kernel where the step is compiled for TPU
  devices and the kernel fits on chip (`pallas_mesh.choose_kernel`), else XLA. The
  kernel computes the two-phase read only: the one-shot read (the ablations, the
  statistics, a test reference) is XLA's whatever the setting."""
  if not residual.two_phase:
    return 'xla'
  cfg = residual.cfg
  return pallas_mesh.choose_kernel(
    cfg.depth_kernel, lambda: attnres_schedule.kernel_refusal(cfg)
  )


def phase1_prefixes(residual) -> tuple[int, ...] | None:
  """The buffer prefixes the XLA Phase 1 picks from for a traced segment start (None:
  the whole buffer, masked). A segment starting at slot `first` reads `first` slots.
  The segment starts are split in order into groups of equal count, each read with
  the longest start of its group; the last group reads the whole buffer, which holds
  any start.

  4 for Full, whose buffer grows with every sublayer (65 slots at 32 layers), the
  whole buffer for Block, whose buffer is short (2 L / S + 1 slots). On the TPU
  compiler's estimate (bench/aot.py d1024 v5p:2x2x1, bf16, 32 layers) 4 prefixes
  take Full from 2.29x to 2.23x the standard step and Block S=4 from 1.38x to 1.41x;
  on CPU (16 layers) Full from 1.59x to 1.24x. `residual.prefix_count` (> 0) overrides
  the count: 1 for pipeline chunks (`AttnResResidual.pipeline_chunk`), others in
  tests."""
  count = residual.prefix_count or (FULL_PREFIXES if residual.block_size == 1 else 1)
  num_segments = -(-residual.cfg.num_layers // residual.segment_layers)
  starts = [residual.first_local_slot(s) for s in range(num_segments)]
  if count <= 1 or len(starts) <= 1:
    return None
  count = min(count, len(starts))
  group_ends = [len(starts) * (g + 1) // count for g in range(count - 1)]
  return tuple(starts[end - 1] for end in group_ends) + (residual.num_slots,)


def keeps_phase1(mean_first: float, num_queries: int) -> bool:
  """Whether the linear-memory backward with the Phase 1 kernel takes each segment's
  Phase 1 results from the forward pass rather than running the forward kernel again.
  Computed again, a segment's Phase 1 reads its `first` completed slots and writes
  its `num_queries` outputs; kept, the forward pass copies the outputs into the stack
  it keeps for the backward pass and holds one [B, T, D] per sublayer until then.
  Kept where the average read (`mean_first`) is more than three times the outputs.
  Measured on v5p:2x2x1 (bench/aot.py, bf16): Full at 32 layers (31 slots, 4
  queries) -1.6% step and 7.2 GB a step less, and at 16 layers of width 2048 (15
  slots) -0.5%, peak memory +2-3 points (target 1.20x); Block S=4 at 32 layers (8.5
  slots) -0.6%, but its peak and temp then pass its 1.05x target on FSDP (1.020x ->
  1.051x); at 8 layers the step did not move."""
  return mean_first > 3 * num_queries
