"""Where a run's files live: a local directory, or a Google Cloud Storage prefix.

A workdir is a local path or `gs://bucket/dir`. Every file a run reads or writes there
(checkpoints through orbax and TensorStore, `config.json`, `config_history.jsonl`,
`metrics.jsonl`, the TensorBoard events, the lock or lease, evaluation outputs) goes
through the functions here, which use the file system directly for local paths (as
before: atomic renames, fsync'd appends) and `etils.epath` (gcsfs) for `gs://`. Other
schemes are refused (`check_supported`), before a run starts.

Object storage has no appends and no renames: a remote append rewrites the object
(the records are small), and a remote atomic write is one object upload (GCS replaces
an object whole). Listings are not cached, as orbax, TensorStore and TensorBoard's
writer change the bucket behind gcsfs's back.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import tempfile

import fsspec
from etils import epath

# The schemes a workdir may have: orbax and TensorStore write checkpoints there, epath
# (gcsfs) everything else, and the lock is a lease object with generation
# preconditions (`lock.GcsLease`), which needs GCS's conditional writes.
SUPPORTED_SCHEMES = ('gs',)

# A listing must show what another client (TensorStore, orbax) wrote a moment ago.
fsspec.config.conf.setdefault('gs', {})['use_listings_cache'] = False


def scheme(path: str) -> str | None:
  """'gs' of 'gs://bucket/run'; None of a local path."""
  match = re.match(r'^([A-Za-z][A-Za-z0-9+.-]*)://', os.fspath(path))
  return match.group(1).lower() if match else None


def is_remote(path: str) -> bool:
  return scheme(path) is not None


def check_supported(path: str, what: str = 'Workdir') -> None:
  """Raises ValueError (one line) if `path` has a scheme other than gs://."""
  name = scheme(path)
  if name is not None and name not in SUPPORTED_SCHEMES:
    raise ValueError(
      f'{what} {path!r}: {name}:// is not supported (only local paths and gs://, '
      f'where the lock is a lease object written with generation preconditions). '
      f'Use a local path, gs://BUCKET/DIR, or a mounted bucket.'
    )


def absolute(path: str) -> str:
  """A local path made absolute (`~` expanded); a gs:// path without a trailing '/'."""
  path = os.fspath(path)
  if is_remote(path):
    return path.rstrip('/')
  return os.path.abspath(os.path.expanduser(path))


def join(path: str, *names: str) -> str:
  return os.path.join(path, *names)  # also right for gs://bucket/dir


def exists(path: str) -> bool:
  return epath.Path(path).exists() if is_remote(path) else os.path.exists(path)


def isdir(path: str) -> bool:
  return epath.Path(path).is_dir() if is_remote(path) else os.path.isdir(path)


def listdir(path: str) -> list[str]:
  """The names in directory `path`; [] if there is none."""
  if is_remote(path):
    p = epath.Path(path)
    return [c.name for c in p.iterdir()] if p.is_dir() else []
  return os.listdir(path) if os.path.isdir(path) else []


def makedirs(path: str) -> None:
  """Creates `path` and its parents (nothing to do on GCS, which has no directories)."""
  if not is_remote(path):
    os.makedirs(path, exist_ok=True)


def read_text(path: str) -> str:
  if is_remote(path):
    return epath.Path(path).read_text()
  with open(path, encoding='utf-8') as f:
    return f.read()


def read_bytes(path: str) -> bytes:
  if is_remote(path):
    return epath.Path(path).read_bytes()
  with open(path, 'rb') as f:
    return f.read()


def write_text(path: str, text: str) -> None:
  """Writes `path` atomically: locally a temporary file, then a rename; on GCS one
  upload, which replaces the object whole."""
  if is_remote(path):
    _upload(path, text.encode())
    return
  tmp = f'{path}.tmp.{os.getpid()}'
  with open(tmp, 'w', encoding='utf-8') as f:
    f.write(text)
  os.replace(tmp, path)


def write_bytes(path: str, data: bytes) -> None:
  """Writes `path` atomically, as `write_text`."""
  if is_remote(path):
    _upload(path, data)
    return
  tmp = f'{path}.tmp.{os.getpid()}'
  with open(tmp, 'wb') as f:
    f.write(data)
  os.replace(tmp, path)


def _upload(path: str, data: bytes) -> None:
  """One object upload; any failure (gcsfs raises its own HttpError) is an OSError, as
  a failed local write is, so a run stops on it with one line."""
  try:
    epath.Path(path).write_bytes(data)
  except OSError:
    raise
  except Exception as e:  # pylint: disable=broad-except
    raise OSError(f'Writing {path} failed: {type(e).__name__}: {e}') from e


def append_text(path: str, text: str) -> None:
  """Appends `text` to `path` (fsync'd locally; on GCS the object is rewritten whole,
  as objects cannot be appended to)."""
  if is_remote(path):
    old = read_text(path) if exists(path) else ''
    _upload(path, (old + text).encode())
    return
  with open(path, 'a', encoding='utf-8') as f:
    f.write(text)
    f.flush()
    os.fsync(f.fileno())


def remove(path: str) -> None:
  if is_remote(path):
    epath.Path(path).unlink()
  else:
    os.remove(path)


def rename(src: str, dst: str) -> None:
  """Moves a file or directory (on GCS: copies each object, then deletes it)."""
  if is_remote(src):
    fs, _ = fsspec.core.url_to_fs(src)
    fs.mv(src, dst, recursive=True)  # epath's rename wants dst's folder to exist
  else:
    os.rename(src, dst)


def rmtree(path: str) -> None:
  """Removes `path` and all under it; no error if it is not there."""
  if is_remote(path):
    p = epath.Path(path)
    if p.exists():
      p.rmtree(missing_ok=True)
  else:
    shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def staged(out_dir: str):
  """A local directory to write the files of `out_dir` into (for writers that need a
  local file: numpy, matplotlib): `out_dir` itself, created; for gs:// a temporary
  directory whose files are uploaded to `out_dir` when the block ends without error."""
  if not is_remote(out_dir):
    os.makedirs(out_dir, exist_ok=True)
    yield out_dir
    return
  with tempfile.TemporaryDirectory() as tmp:
    yield tmp
    for name in sorted(os.listdir(tmp)):
      with open(os.path.join(tmp, name), 'rb') as f:
        write_bytes(join(out_dir, name), f.read())
