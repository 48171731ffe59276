"""Hyper-Connections and mHC (attnres_jax/residuals/hyper/connections.py) against the papers'
equations written out per token, plus the equivalences of the residual interface."""

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import attnres_jax as ar
from attnres_jax.residuals.hyper import connections as hcl
from conftest import DEFAULT_EMITTERS
from tests.residuals.hc_reference import hc_step
from tests.residuals.hc_reference import mhc_step

# Two layers: four sublayers, so that the initial reads select each of 4 streams once.
TINY = dict(vocab_size=256, d_model=32, num_heads=2, mlp_dim=64, num_layers=2)
NUM_SUBLAYERS = 2 * TINY['num_layers']
# (residual, dynamic): static and dynamic HC and mHC.
VARIANTS = [('hc', True), ('hc', False), ('mhc', True), ('mhc', False)]


def make_model(residual, dynamic=True, seed=0, **overrides):
  cfg = ar.model_config(
    **{**TINY, 'residual': residual, 'hc_dynamic': dynamic, **overrides}
  )
  return ar.Transformer(cfg, rngs=nnx.Rngs(seed))


def randomize(model, seed=1):
  """Every HC/mHC parameter moved far from its initial value (and the gates opened),
  so that the streams differ and every term of the equations matters."""
  params = nnx.state(model.layers.residual, nnx.Param)
  leaves, treedef = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  d = model.cfg.d_model
  new = []
  for key, leaf in zip(keys, leaves):
    noise = jax.random.normal(key, leaf.shape, leaf.dtype)
    if leaf.ndim >= 3 and leaf.shape[-2] == d or leaf.shape[-1] == d:  # projections
      noise = noise * 2.0 / np.sqrt(d)
    new.append(leaf + 0.5 * noise)
  nnx.update(model.layers.residual, jax.tree.unflatten(treedef, new))
  for name in ('read_scale', 'write_scale', 'pre_scale', 'post_scale', 'res_scale'):
    param = getattr(model.layers.residual, name, None)
    if param is not None:
      param[...] = param[...] + 0.5
  return model


def jitted(fn, model, *args):
  """fn(model, *args) compiled (eager scans over layers are slow)."""
  graphdef, state = nnx.split(model)
  return jax.jit(lambda state, *args: fn(nnx.merge(graphdef, state), *args))(state, *args)


def tokens(batch=2, length=12, seed=0):
  return jax.random.randint(jax.random.key(seed), (batch, length), 0, 256)


def layer(model, k):
  graphdef, state = nnx.split(model.layers)
  return nnx.merge(graphdef, jax.tree.map(lambda x: x[k], state))


# -- the papers' model, literally (tests/residuals/hc_reference.py per sublayer) --------------


def reference_logits(model, tokens_BT):
  cfg = model.cfg
  positions = jnp.broadcast_to(jnp.arange(tokens_BT.shape[1]), tokens_BT.shape)
  x = model.embed(tokens_BT)
  H = jnp.repeat(x[:, :, None, :], cfg.hc_streams, axis=2)  # every stream: x
  step = mhc_step if cfg.residual == 'mhc' else hc_step
  for k in range(NUM_SUBLAYERS):
    lay = layer(model, k // 2)
    f = lambda h, lay=lay, k=k: lay.sublayer(k % 2, h, positions)
    H = step(lay.residual, k % 2, k, H, f, cfg)
  return model.head(jnp.sum(H, axis=2))  # the streams summed


# -- the model ----------------------------------------------------------------------


def loss_logits_and_grads(model, logits_fn=lambda model, x: model(x), **jit_options):
  """A loss of the logits (mean of sin: no symmetric cancellation), the logits and
  every parameter's gradient, in one compiled program (`jit_options` to jax.jit)."""
  graphdef, params = nnx.split(model, nnx.Param)
  x = tokens()

  def loss(params):
    logits = logits_fn(nnx.merge(graphdef, params), x)
    return jnp.mean(jnp.sin(logits)), logits

  grad_fn = jax.jit(jax.value_and_grad(loss, has_aux=True), **jit_options)
  (value, logits), grads = grad_fn(params)
  return value, logits, grads


@functools.cache
def model_and_papers_equations(residual, dynamic):
  """(loss, logits, gradients) of the model with every parameter moved far from its
  initial value, and of the papers' equations with the same parameters: computed once
  for the tests below (the forward pass is the gradient's)."""
  model = randomize(make_model(residual, dynamic))
  return loss_logits_and_grads(model), loss_logits_and_grads(model, reference_logits)


@pytest.mark.parametrize('residual,dynamic', VARIANTS)
def test_matches_the_papers_equations(residual, dynamic):
  (_, got, _), (_, want, _) = model_and_papers_equations(residual, dynamic)
  scale = float(jnp.abs(want).max())
  # float32, the same arithmetic in another order (einsum layouts, log-domain
  # Sinkhorn): measured <= 2e-6 of the logit scale.
  np.testing.assert_allclose(got, want, atol=2e-5 * scale)


@pytest.mark.parametrize('residual,dynamic', VARIANTS)
def test_gradients_match_the_papers_equations(residual, dynamic):
  """The hand-written VJPs of the read, the write and the normalised projections
  (`hyper_streams`) against autodiff of the papers' equations: every parameter's
  gradient, with every parameter moved far from its initial value."""
  (_, _, got), (_, _, want) = model_and_papers_equations(residual, dynamic)
  for (path, g), w in zip(
    jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)
  ):
    # float32 rounding, amplified through four sublayers with the gates opened: the
    # same equations in another order move some gradients by up to 4e-4 of their
    # scale (measured for HC's read_proj: autodiff of this model with the three HC
    # projections as one dot, 1.7e-4 to 3.6e-4 whichever step is hand-written or
    # autodiff; main's separate dots 3e-6); a wrong or missing term shows at O(1).
    scale = float(jnp.abs(w).max()) + 1e-30
    np.testing.assert_allclose(
      g, w, atol=1e-3 * scale, err_msg=jax.tree_util.keystr(path)
    )


@pytest.mark.parametrize('residual', ['hc', 'mhc'])
def test_coefficients_are_computed_once_per_sublayer(residual, monkeypatch):
  """The read and the write of a sublayer share one computation of its coefficients
  (`sublayer`): tracing a forward pass and a decoding step (layers unrolled) calls
  `coefficients` once per sublayer, and the training gradient adds no call."""
  calls = []
  original = hcl.HyperConnectionResidual.coefficients

  def counted(self, *args):
    calls.append(args[-1])
    return original(self, *args)

  monkeypatch.setattr(hcl.HyperConnectionResidual, 'coefficients', counted)
  model = make_model(residual, scan_layers=False)
  graphdef, params = nnx.split(model)
  x = tokens(length=4)
  loss = lambda p: jnp.mean(nnx.merge(graphdef, p)(x) ** 2)
  jax.eval_shape(loss, params)
  assert calls == [0, 1] * TINY['num_layers']
  calls.clear()
  jax.eval_shape(jax.grad(loss), params)
  assert len(calls) == NUM_SUBLAYERS
  calls.clear()
  jax.eval_shape(
    lambda p, cache: nnx.merge(graphdef, p).decode(x[:, :1], cache, 0),
    params,
    model.init_cache(2, 4),
  )
  assert len(calls) == NUM_SUBLAYERS


@pytest.mark.parametrize('residual', ['hc', 'mhc'])
def test_identity_init_matches_the_standard_model(residual):
  """E2 for HC/mHC: at initialisation (and with the standard model's weights) every
  stream is the standard residual stream, so the logits are the standard model's."""
  standard = make_model('standard')
  converted = ar.convert_standard_to_attnres(
    standard, ar.model_config(**{**TINY, 'residual': residual})
  )
  x = tokens()
  want = jitted(lambda m, x: m(x), standard, x)
  scale = float(jnp.abs(want).max())
  # The final norm reads m times the standard stream (RMSNorm eps 1e-6 against an RMS
  # of ~1: 1e-6 relative), and mHC's first read weighs the other streams by
  # sigmoid(-8) each, which its PreNorm removes up to the same eps; plus float32
  # rounding of the stream sums: measured <= 1e-6 of the logit scale.
  np.testing.assert_allclose(
    jitted(lambda m, x: m(x), converted, x), want, atol=1e-5 * scale
  )


@pytest.mark.parametrize('residual', ['hc', 'mhc'])
def test_execution_variants_equal_the_scan(residual):
  """E4: scan = unrolled loop, remat = no remat, forward and gradients (the Pallas
  kernels under remat equal XLA's model in test_hyper_pallas). The forward is
  compared by the mean square of the logits (a sum without cancellation; the
  gradients' loss, a mean of sines, nearly cancels). Compiled with XLA's default CPU
  emitters (`DEFAULT_EMITTERS`): with the test session's faster older emitter, HC's
  unrolled gradients differ from the scan's by 5e-5 of their norm (4.5e-7 with the
  default emitters), more than the float32 reordering this test bounds."""
  options = dict(compiler_options=DEFAULT_EMITTERS)
  _, logits, grads = loss_logits_and_grads(randomize(make_model(residual)), **options)
  mean_square = lambda logits: np.mean(np.square(np.asarray(logits, np.float64)))
  for execution in (
    dict(scan_layers=False),
    dict(remat='sublayer'),
  ):
    model = randomize(make_model(residual, **execution))
    _, logits_other, grads_other = loss_logits_and_grads(model, **options)
    # Same float32 operations, fused or ordered differently by XLA: a few ulps.
    np.testing.assert_allclose(
      mean_square(logits_other), mean_square(logits), rtol=1e-5, err_msg=str(execution)
    )
    for got, want in zip(jax.tree.leaves(grads_other), jax.tree.leaves(grads)):
      np.testing.assert_allclose(
        got,
        want,
        rtol=1e-4,
        err_msg=str(execution),
        atol=1e-5 * float(jnp.abs(want).max()) + 1e-12,
      )


@pytest.mark.parametrize('residual', ['hc', 'mhc'])
def test_gradients_are_finite_and_reach_every_parameter(residual):
  model = make_model(residual)  # the initial parameters: dynamic projections at zero
  graphdef, params = nnx.split(model, nnx.Param)
  x = tokens()
  grads = jax.jit(jax.grad(lambda p: jnp.mean(nnx.merge(graphdef, p)(x) ** 2)))(params)
  for path, g in jax.tree_util.tree_leaves_with_path(grads):
    assert bool(jnp.all(jnp.isfinite(g))), path
  residual_grads = nnx.state(nnx.merge(graphdef, grads).layers.residual)
  for path, g in jax.tree_util.tree_leaves_with_path(residual_grads):
    name = jax.tree_util.keystr(path)
    # Exceptions, by construction at initialisation: the gates multiply projections
    # that start at zero; and all streams are equal, while mHC's mixing rows always
    # sum to one, so its mixing logits do not change the output yet.
    if 'scale' in name or (residual == 'mhc' and 'res_' in name):
      continue
    # The rest learns from the first step (projections through their 0.01 gates).
    assert float(jnp.abs(g).max()) > 0, name


def assert_decoding_equals_recomputation(
  residual, kernel, length, prompt, steps, chunk=0
):
  """A `prompt`-token prefill, then a `chunk` of tokens (if any), then `steps` single
  tokens, against the full forward over `length` tokens. float32, the same sublayers
  on fewer positions: ~1e-6 relative."""
  model = randomize(make_model(residual, depth_kernel=kernel))
  x = tokens(length=length)
  full = jitted(lambda m, x: m(x), model, x)
  scale = float(jnp.abs(full).max())
  decode = nnx.jit(lambda m, t, cache, index: m.decode(t, cache, index))
  logits, cache = decode(model, x[:, :prompt], model.init_cache(2, length), 0)
  np.testing.assert_allclose(logits, full[:, :prompt], atol=1e-5 * scale)
  if chunk:
    chunk_tokens = slice(prompt, prompt + chunk)
    logits, cache = decode(model, x[:, chunk_tokens], cache, jnp.int32(prompt))
    np.testing.assert_allclose(logits, full[:, chunk_tokens], atol=1e-5 * scale)
  for t in range(prompt + chunk, prompt + chunk + steps):
    logits, cache = decode(model, x[:, t : t + 1], cache, jnp.int32(t))
    np.testing.assert_allclose(logits[:, 0], full[:, t], atol=1e-5 * scale)


@pytest.mark.parametrize('residual', ['hc', 'mhc'])
def test_cached_decoding_equals_recomputation(residual):
  """XLA's read and write, one token a step (the Pallas kernels: below)."""
  assert_decoding_equals_recomputation(residual, 'xla', length=10, prompt=4, steps=6)


@pytest.mark.parametrize('residual', ['hc', 'mhc'])
def test_decoding_after_a_prompt_through_the_fused_kernels(residual):
  """A 128-token prompt (a whole lane tile) runs the fused Pallas read and write
  (`hyper_pallas.boundary`, each write pending in the carry), then a 4-token chunk
  and single tokens the Pallas write and Sinkhorn alone (shorter than a lane tile)
  before XLA's read: the logits equal the full forward's (256 tokens, through the
  kernels too). float32, the same sublayers on fewer positions: ~1e-6 relative
  (measured <= 1.1e-6)."""
  assert_decoding_equals_recomputation(
    residual, 'pallas', length=256, prompt=128, steps=3, chunk=4
  )


def test_stream_statistics():
  model = randomize(make_model('mhc'))
  x = tokens()
  weights = np.ones(x.shape, np.float32)
  weights[0, 5:] = 0  # padding: left out of the means
  stats = hcl.stream_statistics(model, x, weights)
  m, layers = model.cfg.hc_streams, TINY['num_layers']
  assert stats['stream_rms'].shape == (layers, 2, m)
  assert stats['read_weights'].shape == (layers, 2, m)
  assert stats['mix_weights'].shape == (layers, 2, m, m)
  # mHC's mixing matrices are doubly stochastic (rows to rounding, columns to Sinkhorn).
  np.testing.assert_allclose(stats['mix_weights'].sum(-1), 1.0, atol=1e-5)
  # Columns: Sinkhorn's 20 iterations on these logits (off-diagonal -8 +- the random
  # parts) leave a gap, measured 5.5e-3; see test_sinkhorn_extreme_logits.
  np.testing.assert_allclose(stats['mix_weights'].sum(-2), 1.0, atol=2e-2)
  # The weighted means are those of the unpadded tokens alone.
  kept = hcl.stream_statistics(model, x[1:], None)
  both = hcl.stream_statistics(
    model, x, np.concatenate([np.zeros((1, 12)), np.ones((1, 12))])
  )
  np.testing.assert_allclose(both['stream_rms'], kept['stream_rms'], rtol=1e-5)
  # At initialisation the streams are all equal to the standard residual stream.
  fresh = hcl.stream_statistics(make_model('hc'), x)
  np.testing.assert_allclose(
    fresh['stream_rms'],
    np.broadcast_to(fresh['stream_rms'][..., :1], (layers, 2, m)),
    rtol=1e-5,
  )


@pytest.mark.parametrize(
  'overrides,message',
  [
    (dict(residual='hc', hc_streams=0), 'hc_streams'),
    (dict(residual='mhc', sinkhorn_iters=0), 'sinkhorn_iters'),
    (dict(residual='hc', depth_window=2), 'AttnRes'),
  ],
)
def test_config_errors_are_readable(overrides, message):
  with pytest.raises(ValueError, match=message):
    ar.model_config(**{**TINY, **overrides})  # validated when made


@pytest.mark.parametrize('residual', ['hc', 'mhc'])
def test_weight_decay_spares_static_weights_and_gates(residual):
  from attnres_jax.training import optim  # pylint: disable=g-import-not-at-top

  params = nnx.state(make_model(residual), nnx.Param)
  mask = {
    jax.tree_util.keystr(p): m
    for p, m in jax.tree_util.tree_leaves_with_path(optim.decay_mask(params))
  }
  residual_mask = {k: v for k, v in mask.items() if "'residual'" in k}
  # Decayed: exactly the input-dependent projections (matrices, as in AttnRes).
  assert {k for k, v in residual_mask.items() if v} == {
    k for k in residual_mask if "_proj'" in k
  }


def test_analysis_figures(tmp_path):
  from attnres_jax.evaluation import analysis  # pylint: disable=g-import-not-at-top

  model = randomize(make_model('mhc'))
  x = np.asarray(tokens(length=9))
  batch = {
    'inputs': x[:, :-1],
    'targets': x[:, 1:],
    'weights': np.ones(x[:, 1:].shape, np.float32),
  }
  result = analysis.analyze(model, [batch], str(tmp_path), grad_batches=1)
  names = {os.path.basename(f) for f in result['files']}
  assert {'streams.png', 'magnitudes.png', 'grad_norms.png'} <= names
  for key in ('stream_rms', 'read_weights', 'write_weights'):
    assert result['arrays'][key].shape == (TINY['num_layers'], 2, 4)
  assert result['arrays']['mix_weights'].shape == (TINY['num_layers'], 2, 4, 4)
