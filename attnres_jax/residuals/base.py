"""The residual interface: the only contact between the layer stack and the way
sublayer inputs are read from depth and outputs written to it.

The stack (`nn/stack.py`) runs the layers in schedule segments of `segment_layers`
consecutive layers and calls, in this order:

    carry = residual.init(x_BTD)                          # once, from the embedding
    for each segment:                                     # a scan over segments
      inner, per_layer = residual.begin_segment(carry, params_GL, segment)
      for each layer j of the segment, sublayer which:    # unrolled (G is small)
        inner, applied = residual.sublayer(inner, params, per_layer_j, j, which, f)
      carry = residual.end_segment(carry, inner, segment)
    h, final_weights = residual.final(carry, final_params)  # the final norm's input

`sublayer` wraps the branch `f(h) -> (out, saved)`: it reads the branch's input from
the inner carry, runs the branch once and writes its output back (a residual whose
read and write share work, as HC/mHC's coefficients, computes it once there); the
default calls `read` and `write`, so a residual implements either that pair or
`sublayer`. The carries are the residual's own types (arrays or NamedTuples): only the
residual reads their fields.

`params` are the residual's own parameters: `layer_params()` builds one layer's (the
layer keeps them as `layer.residual`, stacked over layers like every layer parameter;
`params_GL` holds a whole segment's), `final_params()` the final read's
(`model.final_residual`). A layer's parameters hold one row per sublayer along their
first axis ([n, ...] for n = `sublayers_per_layer`; stacked [num_layers, n, ...]): the analysis splits gradient norms
by it.

Besides computing, a residual declares what the rest of the library needs to know of
it, so that nothing else branches on the mode: its config checks (`validate`), its
parameters' weight decay (`no_decay`), its arithmetic and memory traffic per token
(`forward_flops`, `io_per_sublayer`) and the least traffic it must add to the standard
residual's (`min_extra_per_sublayer`), its names and statistics for the analysis
(`label`, `describe`, `sublayer_statistics`, `final_statistics`, `figures`) and how it
runs under the pipeline (`carry_axes`, `pipeline_chunk`, `pipeline_refusal`).
Adding a residual is one module and one `registry.register` line, or a config naming
it as a plug-in ('package.module:Class', 'file.py:Class'); docs/extending.md has a
template, and `attnres_jax.testing.check_residual` runs a residual through the
library.
"""

from __future__ import annotations

from typing import Any, Callable, ClassVar, NamedTuple

import jax
from flax import nnx

# branch(h_BTD) -> (out_BTD, saved): one sublayer, as the stack runs it.
Branch = Callable[[jax.Array], tuple[jax.Array, Any]]
# mean(x_...BT) -> x_...: a token-weighted mean over the trailing [B, T] axes.
TokenMean = Callable[[jax.Array], jax.Array]


def param(init, shape, axes, dtype) -> nnx.Param:
  """A parameter without random numbers, with logical axis names."""
  return nnx.Param(init(shape, dtype), out_sharding=axes, eager_sharding=False)


class Applied(NamedTuple):
  """What one sublayer did: its input, its raw output, the residual's per-token
  weights of the read (for `sublayer_statistics`; None when it has none) and what the
  branch saved."""

  h_BTD: jax.Array
  out_BTD: jax.Array
  weights: Any
  saved: Any


class Residual:
  """The interface (see the module docstring); subclasses are frozen dataclasses with
  a `cfg` field (the `ModelConfig`), so that they hash into the model's graph.

  Methods that raise NotImplementedError are what each residual must provide; they are
  not abstract because `read` and `write` are needed only where `sublayer` is not
  overridden (HC/mHC override it)."""

  cfg: Any
  segment_layers: int = 1
  # The residual parameters' own names (the last key of their path) that weight decay
  # spares (`optim.decay_mask`): this residual's parameters only, not another's of the
  # same name.
  no_decay: ClassVar[frozenset[str]] = frozenset()
  # The analysis figures its statistics feed (`plots.FIGURES` keys), beyond the
  # magnitudes and gradient norms that every residual gets.
  figures: ClassVar[tuple[str, ...]] = ()
  # Whether the pipeline may send only the new part of the carry ('cached' transfer).
  cached_transfer: ClassVar[bool] = False
  # Optional, its own backward pass over the layers: fn(graphdef, layer_state, start,
  # positions, segment_offset=None) -> carry; `start` the embedding, or with a segment
  # offset the carry a pipeline chunk received (then the carry's cotangent flows back).
  custom_stack = None

  # -- configuration and names ------------------------------------------------------

  def validate(self) -> None:
    """Raises ValueError for an invalid value of a config field the residual reads."""

  @property
  def label(self) -> str:
    """A human name, for plot titles."""
    return self.cfg.residual

  def describe(self) -> dict[str, Any]:
    """Fields for an evaluation record (e.g. the block size)."""
    return {}

  @property
  def sublayers_per_layer(self) -> int:
    """n: the sublayers of each layer (the rows of a layer's parameters): the
    config's `sublayers_per_layer`, else the Transformer's 2."""
    return getattr(self.cfg, 'sublayers_per_layer', 2)

  @property
  def num_sublayers(self) -> int:
    return self.sublayers_per_layer * self.cfg.num_layers

  # -- parameters and computation ---------------------------------------------------

  def layer_params(self) -> nnx.Module | None:
    return None

  def final_params(self) -> nnx.Module | None:
    return None

  def for_statistics(self) -> Residual:
    """The residual that the analysis runs (e.g. AttnRes with one-shot reads, which
    give every read's depth weights)."""
    return self

  def init(self, x_BTD):
    """The carry before the first layer, from the token embedding."""
    raise NotImplementedError

  def begin_segment(self, carry, params, segment):
    """(the inner carry of a segment, per-layer values handed to its layers: a list
    with one entry per layer, or arrays stacked over the segment's layers; layer j
    gets `stack.layer_entry(per_layer, j)`)."""
    del params, segment
    return carry, None

  def sublayer(
    self, inner, params, per_layer, layer_in_segment, which, branch: Branch
  ) -> tuple[Any, Applied]:
    """Reads the branch's input, runs `branch` once, writes its output."""
    h_BTD, weights = self.read(inner, params, per_layer, layer_in_segment, which)
    out_BTD, saved = branch(h_BTD)
    inner = self.write(inner, params, per_layer, layer_in_segment, which, out_BTD)
    return inner, Applied(h_BTD, out_BTD, weights, saved)

  def read(self, inner, params, per_layer, layer_in_segment, which):
    """(the input of sublayer `which` of the layer, its per-token weights or None)."""
    raise NotImplementedError

  def write(self, inner, params, per_layer, layer_in_segment, which, out_BTD):
    """The inner carry after the sublayer's output `out_BTD` is written."""
    raise NotImplementedError

  def end_segment(self, carry, inner, segment):
    del carry, segment
    return inner

  def final(self, carry, params):
    """(the input of the final norm, the final read's per-token weights or None)."""
    raise NotImplementedError

  # -- analysis ---------------------------------------------------------------------

  def sublayer_statistics(self, weights, mean: TokenMean) -> dict[str, jax.Array]:
    """Statistics of one sublayer from its `Applied.weights` (token means)."""
    del weights, mean
    return {}

  def final_statistics(self, weights, mean: TokenMean) -> dict[str, jax.Array]:
    """Statistics of the final read from `final`'s weights (token means)."""
    del weights, mean
    return {}

  # -- cost -------------------------------------------------------------------------

  def forward_flops(self) -> float:
    """Forward FLOPs per token of the residual's own arithmetic (all sublayers and
    the final read; not the sublayers themselves)."""
    return 0.0

  def io_per_sublayer(self) -> tuple[float, float]:
    """(elements read, written) per token and sublayer, in units of d, averaged over
    the sublayers with the final read included (`flops.residual_io_per_sublayer`)."""
    raise NotImplementedError

  def min_extra_per_sublayer(self) -> float | None:
    """The least HBM traffic the residual must add to the standard residual's, per
    token and sublayer of a training step (forward and backward), in units of d
    elements of the storage dtype (`docs/method.md`, "The least HBM traffic AttnRes
    must add"); None where no floor is derived. The compile-only report divides the
    step's extra bytes by it (`aot.residual_floor`)."""
    return None

  # -- the pipeline (`parallel/pipeline.py`) ------------------------------------------

  def carry_axes(self):
    """The logical axis names of the carry's leaves (a tree like the carry)."""
    raise NotImplementedError

  def pipeline_refusal(self, layers_per_chunk: int) -> str | None:
    """Why chunks of `layers_per_chunk` layers cannot be pipelined (None: they can)."""
    if layers_per_chunk % self.segment_layers:
      return (
        f'a chunk of {layers_per_chunk} layers is not a whole number of the '
        f"residual's segments of {self.segment_layers} layers."
      )
    return None

  def pipeline_chunk(self, layers_per_chunk: int) -> tuple[Residual, int]:
    """(the residual that runs one chunk of layers, its segments per chunk). Segment
    k of chunk c is segment c * segments_per_chunk + k of the model."""
    return self, layers_per_chunk // self.segment_layers


def is_int(value) -> bool:
  return isinstance(value, int) and not isinstance(value, bool)


def invalid(message: str):
  """Raises the ValueError of an invalid model config (for `Residual.validate`)."""
  raise ValueError(f'Invalid model config: {message}')
