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
import logging as std_logging
import os
import re
import shutil
import tempfile
import threading
import warnings

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


# How long the check of a gs:// workdir waits for credentials and its bucket's answer:
# a run without network fails in seconds, not after gcsfs's minute of retries.
REACH_TIMEOUT_SECONDS = 10.0
_READ_WRITE_SCOPE = 'https://www.googleapis.com/auth/devstorage.read_write'


def check_reachable(
  path: str, what: str = 'Workdir', *, timeout: float = REACH_TIMEOUT_SECONDS
) -> None:
  """For a gs:// `path`: raises OSError, one line naming `path` and the cause (no
  credentials, no network, no such bucket, no permission), unless credentials are
  found and its bucket answers a listing within `timeout` seconds. Local paths pass."""
  if scheme(path) != 'gs':
    return
  bucket = path[len('gs://') :].split('/', 1)[0]
  stage, outcome = ['looking for credentials'], []
  probe = threading.Thread(
    target=lambda: outcome.append(_probe_bucket(bucket, timeout, stage)),
    daemon=True,
    name='gcs-probe',
  )
  probe.start()
  probe.join(timeout)
  if outcome and outcome[0] is None:
    return
  cause = outcome[0] if outcome else f'no answer within {timeout:g} s {stage[0]}'
  raise OSError(f'{what} {path!r} cannot be used: {cause}.')


def _gcs_endpoint() -> tuple[str, bool]:
  """(endpoint, is_emulator): STORAGE_EMULATOR_HOST where set, as gcsfs reads it."""
  host = os.environ.get('STORAGE_EMULATOR_HOST', '')
  if host in ('', 'default'):
    return 'https://storage.googleapis.com', False
  return (host if re.match(r'^https?://', host) else f'http://{host}'), True


def _probe_bucket(bucket: str, timeout: float, stage: list[str]) -> str | None:
  """None if `bucket` answers a one-object listing; else why not. `stage[0]` says what
  it is doing (for a caller that stops waiting)."""
  # Imported for gs:// workdirs only (slow imports); google-auth logs and warns at
  # each failed metadata-server probe: kept out of the run's one line.
  import google.auth  # pylint: disable=g-import-not-at-top
  import requests  # pylint: disable=g-import-not-at-top
  from google.auth import exceptions  # pylint: disable=g-import-not-at-top
  from google.auth.transport import requests as auth_requests  # pylint: disable=g-import-not-at-top

  endpoint, emulator = _gcs_endpoint()
  std_logging.getLogger('google.auth').setLevel(std_logging.ERROR)
  session = requests.Session()
  if not emulator and fsspec.config.conf.get('gs', {}).get('token') != 'anon':
    try:
      with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        credentials, _ = google.auth.default(scopes=[_READ_WRITE_SCOPE])
    except exceptions.DefaultCredentialsError as e:
      return (
        f'no credentials ({_first_line(e)}); on a Cloud VM give it a service '
        'account, elsewhere run `gcloud auth application-default login`'
      )
    except exceptions.GoogleAuthError as e:
      return f'no credentials ({_first_line(e)})'
    session = auth_requests.AuthorizedSession(credentials)
  stage[0] = f'from {endpoint}'
  url = f'{endpoint}/storage/v1/b/{bucket}/o'
  try:
    response = session.get(url, params={'maxResults': 1}, timeout=timeout)
  except requests.Timeout:
    return f'no answer from {endpoint} within {timeout:g} s (no network?)'
  except (requests.ConnectionError, exceptions.TransportError) as e:
    errno_text = re.search(r'\[Errno -?\d+\] [^\'")]+', str(e))
    cause = errno_text.group(0) if errno_text else _first_line(e)
    return f'cannot reach {endpoint} (no network?): {cause}'
  except exceptions.RefreshError as e:
    return f'the credentials were refused: {_first_line(e)}'
  if response.ok:
    return None
  causes = {
    401: 'the credentials were refused',
    403: f'no permission to list the objects of bucket {bucket!r}',
    404: f'no such bucket: {bucket!r}',
  }
  try:
    message = response.json()['error']['message']
  except (ValueError, KeyError, TypeError):
    message = response.text
  cause = causes.get(response.status_code, f'{endpoint} answered')
  return f'{cause} (HTTP {response.status_code}: {_first_line(message)})'


def _first_line(error) -> str:
  lines = str(error).strip().splitlines()
  return lines[0][:300] if lines else type(error).__name__


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
  _write_local(path, text.encode())


def write_bytes(path: str, data: bytes) -> None:
  """Writes `path` atomically, as `write_text`."""
  if is_remote(path):
    _upload(path, data)
    return
  _write_local(path, data)


def _write_local(path: str, data: bytes) -> None:
  """A temporary file beside `path`, renamed over it; removed if the write fails (a
  full disk leaves no empty temporary files behind)."""
  tmp = f'{path}.tmp.{os.getpid()}'
  try:
    with open(tmp, 'wb') as f:
      f.write(data)
    os.replace(tmp, path)
  except BaseException:
    with contextlib.suppress(OSError):
      os.remove(tmp)
    raise


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
