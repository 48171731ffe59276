"""The library's packages depend one way: each imports only packages below it in
LAYERS (function-local imports included), so the layout can be read bottom-up."""

import ast
import pathlib

import pytest

LIBRARY = pathlib.Path(__file__).resolve().parent.parent / 'attnres_jax'

# Bottom to top. A top-level module is its own layer; '__init__' (the public surface)
# may import anything.
LAYERS = (
  'nn',
  'kernels',
  'residuals',
  'modes',
  'parallel',
  'config',
  'flops',
  'models',
  'data',
  'inference',
  'runs',
  'evaluation',
  'training',
  'compile_report',
  'testing',
  '__init__',
)


def _unit(module: str) -> str:
  """'attnres_jax.residuals.attnres.depth' -> 'residuals'; the package itself ->
  '__init__'."""
  parts = module.split('.')
  return parts[1] if len(parts) > 1 else '__init__'


def _imports(path: pathlib.Path):
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
      if node.module == 'attnres_jax':
        yield from (f'attnres_jax.{alias.name}' for alias in node.names)
      elif node.module.startswith('attnres_jax.'):
        yield node.module
    elif isinstance(node, ast.Import):
      yield from (a.name for a in node.names if a.name.startswith('attnres_jax'))


def _modules():
  for path in sorted(LIBRARY.rglob('*.py')):
    relative = path.relative_to(LIBRARY.parent).with_suffix('')
    yield '.'.join(relative.parts).removesuffix('.__init__'), path


def test_every_unit_has_a_layer():
  units = {_unit(module) for module, _ in _modules()}
  assert units <= set(LAYERS), sorted(units - set(LAYERS))


@pytest.mark.parametrize('module,path', list(_modules()), ids=lambda v: str(v))
def test_imports_point_down(module, path):
  rank = LAYERS.index(_unit(module))
  upward = [target for target in _imports(path) if LAYERS.index(_unit(target)) > rank]
  assert not upward, f'{module} imports packages above it: {upward}'
