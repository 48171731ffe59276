"""Hyper-Connections and mHC (attnres_jax/residuals/hyper_connections.py) against the papers'
equations written out per token, plus the equivalences of the residual interface."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import attnres_jax as ar
from attnres_jax.residuals import hyper_connections as hcl

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


# -- the papers, literally (per token, streams as the rows of H [m, D]) --------------


def reference_sinkhorn(logits, iters):
  """Sinkhorn-Knopp as mHC states it: M = exp(logits), then columns and rows normalised in turn."""
  matrix = jnp.exp(logits)
  for _ in range(iters):
    matrix = matrix / jnp.sum(matrix, axis=-2, keepdims=True)
    matrix = matrix / jnp.sum(matrix, axis=-1, keepdims=True)
  return matrix


def rms_rows(x, eps):
  return x / jnp.sqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)


def hc_step(p, which, k, H, f, cfg):
  """Hyper-Connections (Zhu et al.): h0 = A_m^T H, H' = B^T f(h0) + A_r^T H, with the
  dynamic parts from norm(H). H: [B, T, m, D]."""
  m = cfg.hc_streams
  A_m = jax.nn.one_hot(k % m, m) + p.static_read[...][which]  # [m]
  A_r = p.static_mix[...][which]  # [m, m]
  B = p.static_write[...][which]  # [m]
  A_m, A_r, B = (jnp.broadcast_to(x, H.shape[:2] + x.shape) for x in (A_m, A_r, B))
  if cfg.hc_dynamic:
    Hn = rms_rows(H, cfg.norm_eps)
    A_m = A_m + p.read_scale[...][which] * jnp.tanh(Hn @ p.read_proj[...][which])
    A_r = A_r + p.read_scale[...][which] * jnp.tanh(Hn @ p.mix_proj[...][which])
    B = B + p.write_scale[...][which] * jnp.tanh(Hn @ p.write_proj[...][which])
  h0 = jnp.einsum('btm,btmd->btd', A_m, H)  # A_m^T H
  out = f(h0)
  return (
    jnp.einsum('btm,btd->btmd', B, out)  # B^T f(h0)
    + jnp.einsum('btij,btid->btjd', A_r, H)
  )  # A_r^T H


def mhc_step(p, which, k, H, f, cfg):
  """mHC (DeepSeek): x_{l+1} = H_res x_l + H_post^T f(H_pre x_l)."""
  m, d = cfg.hc_streams, cfg.d_model
  selected = jax.nn.one_hot(k % m, m)
  b_pre = hcl.MHC_LOGIT * (2 * selected - 1) + p.pre_bias[...][which]
  pre, post, res = (
    jnp.broadcast_to(v, H.shape[:2] + v.shape)
    for v in (b_pre, p.post_bias[...][which], p.res_bias[...][which])
  )  # per token
  if cfg.hc_dynamic:
    x = H.reshape(*H.shape[:2], m * d)  # vec(x_l)
    x = rms_rows(x, cfg.norm_eps)
    flat = lambda phi: phi[...][which].reshape(m * d, -1)
    pre = pre + p.pre_scale[...][which] * (x @ flat(p.pre_proj))
    post = post + p.post_scale[...][which] * (x @ flat(p.post_proj))
    res = res + p.res_scale[...][which] * (x @ flat(p.res_proj)).reshape(
      *H.shape[:2], m, m
    )
  H_pre = jax.nn.sigmoid(jnp.broadcast_to(pre, H.shape[:2] + (m,)))
  H_post = 2 * jax.nn.sigmoid(jnp.broadcast_to(post, H.shape[:2] + (m,)))
  H_res = reference_sinkhorn(
    jnp.broadcast_to(res, H.shape[:2] + (m, m)), cfg.sinkhorn_iters
  )
  out = f(jnp.einsum('btm,btmd->btd', H_pre, H))
  return jnp.einsum('btij,btjd->btid', H_res, H) + jnp.einsum(
    'btm,btd->btmd', H_post, out
  )


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


# -- Sinkhorn -----------------------------------------------------------------------


def test_sinkhorn_gives_doubly_stochastic_matrices():
  logits = jax.random.normal(jax.random.key(0), (4096, 4, 4))
  matrix = hcl.sinkhorn(logits, 20)
  assert bool(jnp.all(matrix >= 0))
  # Rows are normalised last: exact up to float32 rounding of a 4-term sum (~2 ulp).
  np.testing.assert_allclose(matrix.sum(-1), 1.0, atol=1e-6)
  # Columns: within Sinkhorn's convergence after the paper's 20 iterations; for unit
  # normal logits measured max 1.3e-3 over 10^4 matrices (median 6e-8), and the gap
  # shrinks geometrically with more iterations (below: 1e-6 after 2000).
  np.testing.assert_allclose(matrix.sum(-2), 1.0, atol=3e-3)
  assert float(jnp.median(jnp.abs(matrix.sum(-2) - 1))) < 1e-6
  converged = hcl.sinkhorn(logits, 2000)
  np.testing.assert_allclose(converged.sum(-2), 1.0, atol=1e-6)
  np.testing.assert_allclose(converged.sum(-1), 1.0, atol=1e-6)
  # The log-domain iteration is the printed one (exp, then alternate sums) exactly.
  np.testing.assert_allclose(matrix, reference_sinkhorn(logits, 20), atol=1e-6)


@pytest.mark.parametrize('scale', [30.0, 1e4, 1e30])
def test_sinkhorn_extreme_logits(scale):
  """Extreme logits overflow exp(); in the log domain the result stays finite and
  non-negative, rows still sum to one, and the column error only shrinks with more
  iterations. (It shrinks slowly: a finite Sinkhorn-Knopp is only approximately doubly
  stochastic, the limitation mHC-lite addresses; see docs/comparators.md.)"""
  logits = scale * jax.random.normal(jax.random.key(1), (512, 4, 4))
  errors = []
  for iters in (1, 20, 200):
    matrix = hcl.sinkhorn(logits, iters)
    assert bool(jnp.all(jnp.isfinite(matrix))) and bool(jnp.all(matrix >= 0))
    np.testing.assert_allclose(matrix.sum(-1), 1.0, atol=1e-6)
    errors.append(float(jnp.mean(jnp.abs(matrix.sum(-2) - 1))))
  # Sinkhorn's L1 marginal error is non-increasing (allow float32 rounding).
  assert errors[0] + 1e-6 >= errors[1] and errors[1] + 1e-6 >= errors[2], errors
  grads = jax.grad(
    lambda x: jnp.sum(hcl.sinkhorn(x, 20) * jnp.arange(16.0).reshape(1, 4, 4))
  )(logits)
  assert bool(jnp.all(jnp.isfinite(grads)))


def test_sinkhorn_over_leading_axes_equals_the_last_two():
  """The model's layout: matrices over axes (0, 1) of [m, m, B, T], tokens minor."""
  logits = 3 * jax.random.normal(jax.random.key(2), (4, 4, 3, 5))
  leading = hcl.sinkhorn(logits, 20, axes=(0, 1))
  last = hcl.sinkhorn(jnp.transpose(logits, (2, 3, 0, 1)), 20)
  # The same float32 operations per matrix, reduced along other axes: rounding only.
  np.testing.assert_allclose(jnp.transpose(leading, (2, 3, 0, 1)), last, atol=1e-6)


def test_sinkhorn_of_the_initial_logits_is_near_identity():
  m = 4
  logits = hcl.MHC_LOGIT * (jnp.eye(m) - 1)
  matrix = hcl.sinkhorn(logits, 20)
  # Symmetric with equal row sums: doubly stochastic after one step, to rounding.
  np.testing.assert_allclose(matrix.sum(-1), 1.0, atol=1e-6)
  np.testing.assert_allclose(matrix.sum(-2), 1.0, atol=1e-6)
  off = np.exp(-hcl.MHC_LOGIT) / (1 + (m - 1) * np.exp(-hcl.MHC_LOGIT))
  np.testing.assert_allclose(
    matrix, np.where(np.eye(m), 1 - (m - 1) * off, off), rtol=1e-5
  )


# -- the model ----------------------------------------------------------------------


@pytest.mark.parametrize('residual,dynamic', VARIANTS)
def test_matches_the_papers_equations(residual, dynamic):
  model = randomize(make_model(residual, dynamic))
  x = tokens()
  got = jitted(lambda m, x: m(x), model, x)
  want = jitted(reference_logits, model, x)
  scale = float(jnp.abs(want).max())
  # float32, the same arithmetic in another order (einsum layouts, log-domain
  # Sinkhorn): measured <= 2e-6 of the logit scale.
  np.testing.assert_allclose(got, want, atol=2e-5 * scale)


@pytest.mark.parametrize('residual,dynamic', VARIANTS)
def test_gradients_match_the_papers_equations(residual, dynamic):
  """The hand-written VJPs of the read, the write and the normalised projections
  (`hyper_streams`) against autodiff of the papers' equations: every parameter's
  gradient, with every parameter moved far from its initial value."""
  model = randomize(make_model(residual, dynamic))
  graphdef, params = nnx.split(model, nnx.Param)
  x = tokens()
  loss = lambda logits: jnp.mean(jnp.sin(logits))  # no symmetric cancellation
  got = jax.jit(jax.grad(lambda p: loss(nnx.merge(graphdef, p)(x))))(params)
  want = jax.jit(jax.grad(lambda p: loss(reference_logits(nnx.merge(graphdef, p), x))))(
    params
  )
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


def _stream_step_references():
  """The stream-sized steps as plain formulas (float32, autodiff): read, write (mix
  [i, j]: from i to j) and the normalised projections, HC's per stream [K, m, B, T],
  mHC's of the concatenation [K, B, T]."""
  norm = lambda x, axes: x / jnp.sqrt(jnp.mean(x * x, axis=axes, keepdims=True) + 1e-6)
  return dict(
    read=lambda a, H: jnp.einsum('mbt,mbtd->btd', a, H),
    write=lambda R, b, H, f: jnp.einsum('ijbt,ibtd->jbtd', R, H) + b[..., None] * f[None],
    hc=lambda phi, H: jnp.einsum('mbtd,dk->kmbt', norm(H, -1), phi),
    mhc=lambda phi, H: jnp.einsum('mbtd,mdk->kbt', norm(H, (0, 3)), phi),
  )


@pytest.mark.parametrize('step', ['read', 'write', 'hc', 'mhc'])
def test_stream_steps_match_autodiff(step):
  """Each hand-written VJP of `hyper_streams` (the barriers, the m-output write, the
  projections with their outputs minor) against autodiff of its formula, values and
  every input's cotangent, on random float32 inputs; D = 256 splits into lane rows."""
  from attnres_jax.residuals import hyper_streams as hs

  m, b, t, d = 3, 2, 5, 256
  keys = iter(jax.random.split(jax.random.key(0), 8))
  normal = lambda *shape: jax.random.normal(next(keys), shape)
  streams = normal(m, b, t, d)
  got_fn = dict(
    read=hs.read,
    write=hs.write,
    hc=lambda phi, H: hs.normed_projection(phi, H, 1e-6, per_stream=True),
    mhc=lambda phi, H: hs.normed_projection(phi, H, 1e-6, per_stream=False),
  )[step]
  args = dict(
    read=(normal(m, b, t), streams),
    write=(normal(m, m, b, t), normal(m, b, t), streams, normal(b, t, d)),
    hc=(normal(d, 5) / 16, streams),
    mhc=(normal(m, d, 7) / 16, streams),
  )[step]
  want, want_vjp = jax.vjp(_stream_step_references()[step], *args)
  got, got_vjp = jax.vjp(got_fn, *args)
  cotangent = normal(*want.shape)
  # float32 rounding of sums over at most m d = 768 terms of unit scale, in another
  # order than the reference's: ~1e-6 of the scale; a wrong term shows at O(1).
  for g, w in zip((got, *got_vjp(cotangent)), (want, *want_vjp(cotangent))):
    np.testing.assert_allclose(g, w, atol=1e-5 * float(jnp.abs(w).max()))


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
  """E4: scan = unrolled loop, remat = no remat, forward and gradients."""
  x = tokens()

  def loss_and_grads(**overrides):
    model = randomize(make_model(residual, **overrides))
    graphdef, params = nnx.split(model, nnx.Param)
    loss = lambda p: jnp.mean(nnx.merge(graphdef, p)(x) ** 2)
    return jax.jit(jax.value_and_grad(loss))(params)

  loss, grads = loss_and_grads()
  for execution in (dict(scan_layers=False), dict(remat='sublayer')):
    loss_other, grads_other = loss_and_grads(**execution)
    # Same float32 operations, fused or ordered differently by XLA: a few ulps.
    np.testing.assert_allclose(loss_other, loss, rtol=1e-5, err_msg=str(execution))
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


@pytest.mark.parametrize('residual', ['hc', 'mhc'])
def test_cached_decoding_equals_recomputation(residual):
  model = randomize(make_model(residual))
  x = tokens(length=10)
  full = jitted(lambda m, x: m(x), model, x)
  scale = float(jnp.abs(full).max())
  decode = nnx.jit(lambda m, t, cache, index: m.decode(t, cache, index))
  prompt = 4
  logits, cache = decode(model, x[:, :prompt], model.init_cache(2, 10), 0)
  # float32, the same sublayers on fewer positions: ~1e-6 relative.
  np.testing.assert_allclose(logits, full[:, :prompt], atol=1e-5 * scale)
  for t in range(prompt, 10):
    logits, cache = decode(model, x[:, t : t + 1], cache, jnp.int32(t))
    np.testing.assert_allclose(logits[:, 0], full[:, t], atol=1e-5 * scale)


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
    (dict(residual='hc', depth_window=2, depth_read='one_shot'), 'AttnRes'),
  ],
)
def test_config_errors_are_readable(overrides, message):
  with pytest.raises(ValueError, match=message):
    ar.model_config(**{**TINY, **overrides})  # validated when made


@pytest.mark.parametrize('residual', ['hc', 'mhc'])
def test_weight_decay_spares_static_weights_and_gates(residual):
  from attnres_jax import optim  # pylint: disable=g-import-not-at-top

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
  from attnres_jax import analysis  # pylint: disable=g-import-not-at-top

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
