"""File systems of the checkpoint readers and writers, and atomic writes.

Local paths; read-only `http(s)://` URLs; gs:// through `tf.io.gfile` when
TensorFlow is installed, else read over HTTPS as public objects.
"""

from __future__ import annotations

import contextlib
import os
import posixpath
import uuid
from collections.abc import Iterator
from typing import Any
from typing import BinaryIO


def _remote():
    from keras_vmoe.formats import remote  # lazy: http.client and ssl only for URLs

    return remote


class _LocalFS:
    join = staticmethod(os.path.join)
    split = staticmethod(os.path.split)
    exists = staticmethod(os.path.exists)
    isdir = staticmethod(os.path.isdir)
    size = staticmethod(os.path.getsize)
    replace = staticmethod(os.replace)
    open = staticmethod(open)
    remove = staticmethod(os.remove)

    @staticmethod
    def makedirs(path: str) -> None:
        os.makedirs(path, exist_ok=True)


class _GFileFS:
    """gs:// (and any other tf.io.gfile scheme)."""

    join = staticmethod(posixpath.join)
    split = staticmethod(posixpath.split)

    def __init__(self, gfile: Any) -> None:
        self._gfile = gfile

    def exists(self, path: str) -> bool:
        return bool(self._gfile.exists(path))

    def isdir(self, path: str) -> bool:
        return bool(self._gfile.isdir(path))

    def size(self, path: str) -> int:
        return int(self._gfile.stat(path).length)

    def open(self, path: str, mode: str) -> BinaryIO:
        return self._gfile.GFile(path, mode)

    def replace(self, src: str, dst: str) -> None:
        self._gfile.rename(src, dst, overwrite=True)

    def remove(self, path: str) -> None:
        self._gfile.remove(path)

    def makedirs(self, path: str) -> None:
        self._gfile.makedirs(path)


class _HTTPFS:
    """Read-only HTTP(S) objects (gs:// ones at their public URL)."""

    join = staticmethod(posixpath.join)
    split = staticmethod(posixpath.split)

    def __init__(self) -> None:
        self._stats: dict[str, Any] = {}

    @staticmethod
    def url(path: str) -> str:
        return _remote().public_url(path)

    def stat(self, path: str) -> Any:
        """The object's `remote.RemoteStat` (one HEAD request per URL)."""
        url = self.url(path)
        if url not in self._stats:
            self._stats[url] = _remote().remote_stat(url)
        return self._stats[url]

    def size(self, path: str) -> int:
        return self.stat(path).size

    def exists(self, path: str) -> bool:
        try:
            self.size(path)
        except _remote().RemoteNotFoundError:
            return False
        return True

    def isdir(self, path: str) -> bool:
        return False

    def open(self, path: str, mode: str) -> BinaryIO:
        if mode != "rb":
            raise OSError(f"Cannot write {path!r}: HTTP(S) objects are read-only.")
        stat = self.stat(path)
        return _remote().open_range(self.url(path), stat.size, stat.version)

    @staticmethod
    def _read_only(path: str, *_: str) -> None:
        raise OSError(f"Cannot write {path!r}: HTTP(S) objects are read-only.")

    replace = remove = makedirs = _read_only


def _tensorflow_installed() -> bool:
    import importlib.util
    import sys

    if "tensorflow" in sys.modules:
        return sys.modules["tensorflow"] is not None
    try:
        return importlib.util.find_spec("tensorflow") is not None
    except (ImportError, ValueError):
        return False


def _fs(path: str, write: bool = False) -> _LocalFS | _GFileFS | _HTTPFS:
    """Returns the file system handling `path` (`write`: to write it)."""
    if path.startswith(("http://", "https://")):
        return _HTTPFS()
    if not path.startswith("gs://"):
        return _LocalFS()
    if not write and not _tensorflow_installed():
        return _HTTPFS()
    try:
        import tensorflow as tf
    except ImportError as error:
        raise ImportError(
            f"Reading or writing {path!r} needs tensorflow.io.gfile, but "
            "TensorFlow is not installed. Install it with "
            "`pip install 'keras-vmoe[tensorflow]'`, or copy the checkpoint to a local "
            "directory first (e.g. with `gsutil -m cp`)."
        ) from error
    return _GFileFS(tf.io.gfile)


@contextlib.contextmanager
def _atomic_write(path: str) -> Iterator[BinaryIO]:
    """Opens a temporary file next to `path`; renames it to `path` on success."""
    fs = _fs(path, write=True)
    directory, name = fs.split(path)
    if directory:
        fs.makedirs(directory)
    tmp_path = fs.join(directory, f".tmp-{uuid.uuid4().hex[:12]}.{name}")
    try:
        with fs.open(tmp_path, "wb") as file:
            yield file
        fs.replace(tmp_path, path)
    except BaseException:
        with contextlib.suppress(Exception):
            if fs.exists(tmp_path):
                fs.remove(tmp_path)
        raise
