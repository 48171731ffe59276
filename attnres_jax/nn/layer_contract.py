"""The layer contract: what the layer stack (`stack.py`) calls on a layer.

A layer is an `nnx.Module` of `n` sublayers (`sublayers_per_layer`; the Transformer's
two are attention and the MLP), built as `layer_type(*args, rngs=rngs, **kwargs)`,
whose type has the methods `LAYER_METHODS`:

  sublayer_norm(which, h_BTD) -> normed_BTD
      the first part of sublayer `which` (0 .. n - 1) on its input h [B, T, D]: its
      PreNorm, or the identity for a sublayer without one;
  sublayer_body(which, normed_BTD, positions_BT) -> out_BTD
      the rest: f(h) = sublayer_body(which, sublayer_norm(which, h), positions), the
      raw output [B, T, D] that the residual writes back. `positions_BT`: the
      tokens' positions (int32 [B, T]), for a layer that needs them.

Both are pure functions of their inputs and the layer's parameters (no random
numbers, no updated state): the stack reruns them where it rematerialises. The split
at the norm is the linear-memory AttnRes backward's (`residuals/attnres/backward.py`):
it keeps the body's VJP and reruns the norm from the read it recomputes anyway.

The stack gives each layer one more attribute, `residual`: the residual's parameters
of the layer (`Residual.layer_params()`, one row per sublayer; None for the standard
residual). A layer must not set it itself. The residual alone decides how h is read
from its depth state and how f(h) is written back; the layer never sees which runs.

Decoding with a KV cache (the Transformer's `decode`) also calls
`sublayer(which, h_BTD, positions_BT, cache=..., cache_index=..., start_B=...)`.

`check_layer` refuses a type without the methods, before anything is built or traced;
`make_layers` builds L layers at once with `nnx.vmap` over `rngs.split(L)`: every
parameter gains a leading axis named 'layers' (split over the pipeline's `stage` mesh
axis by the sharding rules), the stacked form that `jax.lax.scan` runs.
"""

from __future__ import annotations

from flax import nnx

LAYER_METHODS = ('sublayer_norm', 'sublayer_body')
WHERE = 'the layer contract: attnres_jax/nn/layer_contract.py, docs/extending.md'


def check_layer(layer_type) -> None:
  """Raises one TypeError naming the first method of `LAYER_METHODS` that
  `layer_type` lacks, before any layer is built or traced."""
  if not isinstance(layer_type, type):
    raise TypeError(
      f'A layer stack needs a layer class (an nnx.Module subclass), got '
      f'{layer_type!r} ({WHERE}).'
    )
  for name in LAYER_METHODS:
    if not callable(getattr(layer_type, name, None)):
      raise TypeError(
        f'{layer_type.__name__} cannot run in the layer stack: it has no method '
        f'{name!r}; a layer needs {" and ".join(LAYER_METHODS)} ({WHERE}).'
      )


def make_layers(layer_type, num_layers: int, rngs: nnx.Rngs, *args, residual, **kwargs):
  """`num_layers` layers `layer_type(*args, rngs=..., **kwargs)` stacked by `nnx.vmap`
  on a leading 'layers' axis, each from its own split of `rngs`, each given the
  attribute `residual = residual.layer_params()`; the contract checked first."""
  check_layer(layer_type)

  @nnx.vmap(in_axes=0, out_axes=0, transform_metadata={nnx.PARTITION_NAME: 'layers'})
  def make(layer_rngs):
    layer = layer_type(*args, rngs=layer_rngs, **kwargs)
    if 'residual' in vars(layer):
      raise TypeError(
        f'{layer_type.__name__} sets an attribute named residual: the layer stack '
        f"keeps the residual's parameters there ({WHERE})."
      )
    layer.residual = residual.layer_params()
    return layer

  return make(rngs.split(num_layers))
