"""bench/results/MANIFEST.md lists every file in bench/results/ (its first column), and
every file it lists is there: a result the docs cite keeps its command and commit."""

import os
import re

from conftest import ROOT

RESULTS = os.path.join(ROOT, 'bench', 'results')


def listed_files():
  """The file names in the first column of the manifest's table."""
  names = set()
  with open(os.path.join(RESULTS, 'MANIFEST.md')) as f:
    for line in f:
      if line.startswith('| `'):
        first_column = line.split('|')[1]
        names.update(re.findall(r'`([^`]+)`', first_column))
  return names


def test_the_manifest_lists_exactly_the_files_in_bench_results():
  present = {
    os.path.relpath(os.path.join(folder, name), RESULTS)
    for folder, _, files in os.walk(RESULTS)
    for name in files
    if name != 'MANIFEST.md'
  }
  listed = listed_files()
  assert present - listed == set(), 'files the manifest does not list'
  assert listed - present == set(), 'files the manifest lists that are not there'
