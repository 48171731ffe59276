"""The notebooks run top to bottom with tiny settings, and are committed stripped.

Each notebook is executed with nbclient in a fresh kernel of this interpreter, in a
temporary directory, with overrides injected after its `parameters` cell (papermill's
convention). Any cell error fails the test.
"""

import json
import os
import pathlib
import sys

import nbformat
import pytest
from jupyter_client.kernelspec import KernelSpecManager
from nbclient import NotebookClient

REPO = pathlib.Path(__file__).resolve().parent.parent
NOTEBOOKS = REPO / 'notebooks'
CELL_TIMEOUT_S = 300

# Both with a small SentencePiece vocabulary (the byte tokenizer is the presets' own):
# trained once on the plays into the shared data dir, copied into each run; on 200 kB
# of them, as tests/data/test_tokenizer.py does (the presets' 10 MB take ~20 s more).
SUBWORD = dict(TOKENIZER='sentencepiece', VOCAB_SIZE=400, TOKENIZER_BYTES=200_000)
TINY = {
  'quickstart.ipynb': dict(CONFIG='tiny', NUM_STEPS=10, SAMPLE_LENGTH=20, **SUBWORD),
  'analysis.ipynb': dict(CONFIG='tiny', NUM_STEPS=10, EVAL_BATCHES=2, **SUBWORD),
}


def read(name):
  return nbformat.read(NOTEBOOKS / name, as_version=4)


def parameters_index(nb):
  indices = [
    i for i, cell in enumerate(nb.cells) if 'parameters' in cell.metadata.get('tags', [])
  ]
  assert len(indices) == 1, f'expected one cell tagged "parameters", got {indices}'
  return indices[0]


def inject(nb, overrides):
  """Adds a cell setting `overrides` after the parameters cell (as papermill does)."""
  index = parameters_index(nb)
  defined = nb.cells[index].source
  for name in overrides:
    assert f'{name} = ' in defined, f'{name} is not a parameter of the notebook'
  cell = nbformat.v4.new_code_cell(
    '\n'.join(f'{name} = {value!r}' for name, value in overrides.items())
  )
  cell.metadata['tags'] = ['injected-parameters']
  nb.cells.insert(index + 1, cell)
  return nb


@pytest.fixture(scope='module')
def kernel_env(tmp_path_factory):
  """Environment for a kernel of this interpreter with the repository importable.

  A kernelspec named 'python3' that runs `sys.executable` comes first on JUPYTER_PATH,
  so the notebooks' kernel is this venv's python whatever else is installed.
  """
  root = tmp_path_factory.mktemp('jupyter')
  spec_dir = root / 'kernels' / 'python3'
  spec_dir.mkdir(parents=True)
  (spec_dir / 'kernel.json').write_text(
    json.dumps(
      {
        'argv': [sys.executable, '-m', 'ipykernel_launcher', '-f', '{connection_file}'],
        'display_name': 'Python 3 (attnres_jax tests)',
        'language': 'python',
      }
    )
  )
  paths = [str(root)] + [
    p for p in os.environ.get('JUPYTER_PATH', '').split(os.pathsep) if p
  ]
  python_path = [str(REPO)] + [
    p for p in os.environ.get('PYTHONPATH', '').split(os.pathsep) if p
  ]
  env = {
    'JUPYTER_PATH': os.pathsep.join(paths),
    'PYTHONPATH': os.pathsep.join(python_path),
  }
  with pytest.MonkeyPatch.context() as patch:
    for key, value in env.items():
      patch.setenv(key, value)
    assert KernelSpecManager().get_kernel_spec('python3').argv[0] == sys.executable
  return env


def execute(name, overrides, directory, env):
  """Runs notebook `name` with `overrides` in `directory`; returns the executed notebook."""
  nb = inject(read(name), overrides)
  with pytest.MonkeyPatch.context() as patch:
    for key, value in env.items():
      patch.setenv(key, value)
    client = NotebookClient(
      nb,
      timeout=CELL_TIMEOUT_S,
      kernel_name='python3',
      resources={'metadata': {'path': str(directory)}},
    )
    client.execute()  # raises CellExecutionError on the first failing cell
  return nb


def assert_no_errors(nb):
  errors = [
    output
    for cell in nb.cells
    if cell.cell_type == 'code'
    for output in cell.outputs
    if output.output_type == 'error'
  ]
  assert not errors


def images(nb):
  return sum(
    'image/png' in output.get('data', {})
    or 'data:image/png' in output.get('data', {}).get('text/html', '')
    for cell in nb.cells
    if cell.cell_type == 'code'
    for output in cell.outputs
  )


@pytest.fixture(scope='module')
def data_dir(tmp_path_factory):
  """One prepared copy of the plays for both notebooks."""
  return str(tmp_path_factory.mktemp('tfds'))


@pytest.fixture(scope='module')
def quickstart(kernel_env, data_dir, tmp_path_factory):
  """The executed quickstart and its workdir (a trained tiny Block run)."""
  directory = tmp_path_factory.mktemp('quickstart')
  workdir = directory / 'workdir'
  nb = execute(
    'quickstart.ipynb',
    dict(TINY['quickstart.ipynb'], WORKDIR=str(workdir), DATA_DIR=data_dir),
    directory,
    kernel_env,
  )
  return nb, workdir


def printed(nb) -> str:
  return ''.join(
    output.get('text', '')
    for cell in nb.cells
    if cell.cell_type == 'code'
    for output in cell.outputs
    if output.output_type == 'stream'
  )


def test_quickstart_runs(quickstart):
  nb, workdir = quickstart
  assert_no_errors(nb)
  assert images(nb) >= 2  # the loss curve and the depth-attention heatmap
  assert (workdir / 'checkpoints').is_dir()
  assert (workdir / 'tokenizer.model').is_file()  # the run's own SentencePiece model
  assert 'backend: cpu' in printed(nb)
  assert "'vocab_size': 400" in printed(nb)


def test_analysis_runs(quickstart, kernel_env, data_dir, tmp_path):
  # The standard run is trained; the Block run is the quickstart's, loaded (both
  # paths of the notebook, and one training less).
  _, block_workdir = quickstart
  overrides = dict(
    TINY['analysis.ipynb'],
    WORKDIR=str(tmp_path / 'workdir'),
    BLOCK_WORKDIR=str(block_workdir),
    DATA_DIR=data_dir,
  )
  assert overrides['NUM_STEPS'] == TINY['quickstart.ipynb']['NUM_STEPS']  # same runs
  nb = execute('analysis.ipynb', overrides, tmp_path, kernel_env)
  assert_no_errors(nb)
  assert images(nb) >= 5  # loss, heatmaps, magnitudes, gradient norms, overlay
  assert (tmp_path / 'workdir' / 'standard' / 'checkpoints').is_dir()
  assert not (tmp_path / 'workdir' / 'block').exists()


@pytest.mark.parametrize('name', sorted(TINY))
def test_notebook_is_committed_stripped_and_colab_ready(name):
  nb = read(name)
  nbformat.validate(nb)
  parameters_index(nb)
  for cell in nb.cells:
    if cell.cell_type == 'code':
      assert cell.outputs == [] and cell.execution_count is None, (
        f'{name}: outputs are not stripped: {cell.source[:60]!r}'
      )
      assert 'execution' not in cell.metadata, f'{name}: execution timings left in'
      if 'pip install' in cell.source:
        assert "if 'google.colab' in sys.modules:" in cell.source
  assert 'colab.research.google.com/github/' in nb.cells[0].source
  assert f'/notebooks/{name})' in nb.cells[0].source
  # Any Colab runtime: the package's loose dependencies keep the runtime's jax (the
  # pinned requirements are CPU wheels); the backend's batch size is a parameter.
  sources = '\n'.join(cell.source for cell in nb.cells)
  assert 'use a CPU runtime' not in sources and '!pip install -q -r' not in sources
  assert '!pip install -q -e /content/attnres_jax' in sources
  parameters = nb.cells[parameters_index(nb)].source
  for name in ('TOKENIZER = ', 'VOCAB_SIZE = ', 'TOKENIZER_BYTES = ', 'BATCH_SIZES = '):
    assert name in parameters
