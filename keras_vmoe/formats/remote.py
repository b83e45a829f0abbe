"""Public objects over HTTP(S): sizes, byte-range reads and resumable downloads.

Public Cloud Storage objects are served at
`https://storage.googleapis.com/<bucket>/<object>` with HTTP Range
requests, so `gs://` checkpoints of public buckets are read here with the
standard library only (no TensorFlow). `http://` and `https://` URLs (a
mirror, or a local server) are read the same way.

Timeouts: opening a connection (the name lookup and the attempts at every
address together) gives up after `CONNECT_TIMEOUT` seconds, tried once, so
an offline machine gets its answer quickly; a read that
receives nothing for `read_timeout()` seconds (`$KERAS_VMOE_HTTP_TIMEOUT`,
default 30) fails and is retried from the byte where it stopped, at most
`RETRIES` times in a row without new bytes. A transfer slower than
`min_rate()` bytes a second (`$KERAS_VMOE_HTTP_MIN_RATE`, default 1000) over
a `read_timeout()` window counts as stalled too, so a server that trickles
bytes cannot keep a download going for ever; a server that ignores `Range`
(every retry starts at byte 0) gets `RETRIES` tries in all, and its partial
file is not kept. Every download therefore ends, with an error naming the
URL (credentials removed) and what to do.
"""

from __future__ import annotations

import base64
import errno
import hashlib
import http.client
import io
import os
import re
import socket
import threading
import time
import urllib.parse
from collections.abc import Callable
from typing import NamedTuple

GCS_BASE = "https://storage.googleapis.com"
TIMEOUT_ENV = "KERAS_VMOE_HTTP_TIMEOUT"
CONNECT_TIMEOUT = 4.0
DEFAULT_READ_TIMEOUT = 30.0
MAX_TIMEOUT = 86400.0
MIN_RATE_ENV = "KERAS_VMOE_HTTP_MIN_RATE"
DEFAULT_MIN_RATE = 1000.0
RETRIES = 3
CHUNK_BYTES = 2**20
_MAX_REDIRECTS = 5
_DISK_ERRORS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES)

__all__ = [
    "GCS_BASE",
    "ObjectInfo",
    "RemoteError",
    "RemoteNotFoundError",
    "RemoteSizeChangedError",
    "RemoteUnreachableError",
    "RangeFile",
    "download",
    "is_http",
    "open_range",
    "public_url",
    "remote_info",
    "remote_size",
]


# `scheme://user:password@` and a bare `user:password@host`.
_CREDENTIALS = re.compile(r"(\b[a-zA-Z][a-zA-Z0-9+.-]*://)[^/\s@]+@")
_BARE_CREDENTIALS = re.compile(r"(^|[\s(\[{'\"])[^\s/@()]+:[^\s/@()]+@")


def redact(text: str) -> str:
    """`text` with the credentials of every URL in it replaced by `***`."""
    text = _CREDENTIALS.sub(r"\1***@", str(text))
    return _BARE_CREDENTIALS.sub(r"\1***@", text)


class RemoteError(OSError):
    """An HTTP(S) object cannot be read (bad status, size or a dropped connection).

    Its message never shows a URL's user name or password (`redact`)."""

    def __init__(self, *args):
        super().__init__(*(redact(a) if isinstance(a, str) else a for a in args))


class RemoteNotFoundError(RemoteError, FileNotFoundError):
    """The server answered 404 (or 403/410) for the object."""


class RemoteSizeChangedError(RemoteError):
    """The object's size differs from the size it had when the read started."""


class RemoteUnreachableError(RemoteError, ConnectionError):
    """No connection to the host could be opened (offline, DNS failure, refused)."""


def is_http(path) -> bool:
    """Whether `path` is an `http://` or `https://` URL."""
    return isinstance(path, str) and path.startswith(("http://", "https://"))


def public_url(url: str, base: str | None = None) -> str:
    """The HTTP(S) URL of a public object.

    Args:
        url: `gs://bucket/object` (or an `http(s)://` URL, returned as is).
        base: the server holding the buckets, `http(s)://host[/path]`
            (default `GCS_BASE`); the object is at `<base>/bucket/object`.

    Returns:
        The URL as a string.

    Example:

    >>> public_url("gs://vit_models/imagenet21k/ViT-B_16.npz", "https://mirror.example/m")
    'https://mirror.example/m/vit_models/imagenet21k/ViT-B_16.npz'
    """
    if is_http(url):
        return url
    if not (isinstance(url, str) and url.startswith("gs://")):
        raise ValueError(f"Expected a gs:// or http(s):// URL. Received: url={url!r}")
    base = base or GCS_BASE
    if not is_http(base):
        raise ValueError(
            f"The base of public objects must be an http:// or https:// URL. "
            f"Received: base={base!r}"
        )
    return base.rstrip("/") + "/" + urllib.parse.quote(url[len("gs://"):])


def _setting(name, default, low, high, unit):
    value = os.environ.get(name)
    if not value:
        return default
    try:
        number = float(value)
    except ValueError:
        number = float("nan")
    if not low < number <= high:  # also refuses nan and inf
        raise ValueError(
            f"{name} must be a number of {unit} in ({low:g}, {high:g}]. "
            f"Received: {name}={value!r}")
    return number


def read_timeout() -> float:
    """Seconds a read may receive nothing before it fails
    (`$KERAS_VMOE_HTTP_TIMEOUT`, at most a day)."""
    return _setting(TIMEOUT_ENV, DEFAULT_READ_TIMEOUT, 0, MAX_TIMEOUT, "seconds")


def min_rate() -> float:
    """Bytes a second below which a transfer counts as stalled
    (`$KERAS_VMOE_HTTP_MIN_RATE`)."""
    return _setting(MIN_RATE_ENV, DEFAULT_MIN_RATE, 0, 2.0**40, "bytes a second")


def _resolve(host: str, port: int, deadline: float) -> list:
    """`socket.getaddrinfo`, given up at `deadline` (a lookup can hang offline)."""
    found: dict = {}

    def lookup() -> None:
        try:
            found["addresses"] = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except OSError as error:
            found["error"] = error

    thread = threading.Thread(target=lookup, daemon=True)
    thread.start()
    thread.join(max(deadline - time.monotonic(), 0.0))
    if thread.is_alive():
        raise TimeoutError(f"the name lookup of {host} took more than "
                           f"{CONNECT_TIMEOUT:g} s")
    if "error" in found:
        raise found["error"]
    return found["addresses"]


def _create_connection(address, timeout=None, source_address=None, *args):
    """`socket.create_connection` within one `CONNECT_TIMEOUT` in all: the
    name lookup and the attempts at every address share it."""
    deadline = time.monotonic() + CONNECT_TIMEOUT
    host, port = address
    error: OSError = OSError(f"no address for {host}")
    for family, kind, proto, _, sockaddr in _resolve(host, port, deadline):
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"no connection to {host}:{port} within "
                               f"{CONNECT_TIMEOUT:g} s")
        sock = socket.socket(family, kind, proto)
        try:
            sock.settimeout(left)
            if source_address:
                sock.bind(source_address)
            sock.connect(sockaddr)
            return sock
        except OSError as caught:
            error = caught
            sock.close()
    raise error


def _connect(url: str) -> tuple[http.client.HTTPConnection, str]:
    parts = urllib.parse.urlsplit(url)
    cls = (http.client.HTTPSConnection if parts.scheme == "https"
           else http.client.HTTPConnection)
    if not parts.hostname:
        raise ValueError(f"Expected an http(s)://host/... URL. Received: {url!r}")
    connection = cls(parts.hostname, parts.port, timeout=CONNECT_TIMEOUT)
    connection._create_connection = _create_connection
    try:
        connection.connect()
    except OSError as error:
        connection.close()
        raise RemoteUnreachableError(
            f"Cannot connect to {parts.netloc} to read {url} "
            f"({type(error).__name__}: {error})."
        ) from error
    connection.sock.settimeout(read_timeout())
    path = parts.path or "/"
    return connection, path + (f"?{parts.query}" if parts.query else "")


def _request(url: str, method: str = "GET", start: int = 0):
    """Sends one request, following redirects; returns (connection, response)."""
    for _ in range(_MAX_REDIRECTS + 1):
        connection, path = _connect(url)
        headers = {"User-Agent": "keras-vmoe", "Accept-Encoding": "identity"}
        if start:
            headers["Range"] = f"bytes={start}-"
        try:
            connection.request(method, path, headers=headers)
            response = connection.getresponse()
        except (OSError, http.client.HTTPException) as error:
            connection.close()
            raise RemoteError(
                f"{url}: the request failed ({type(error).__name__}: {error})."
            ) from error
        if response.status in (301, 302, 303, 307, 308):
            location = response.getheader("Location")
            connection.close()
            if not location:
                raise RemoteError(f"{url}: redirect ({response.status}) without a Location.")
            url = urllib.parse.urljoin(url, location)
            continue
        if response.status in (403, 404, 410):
            connection.close()
            raise RemoteNotFoundError(
                f"{url}: not found (HTTP {response.status} {response.reason})."
            )
        if response.status not in (200, 206):
            connection.close()
            raise RemoteError(f"{url}: HTTP {response.status} {response.reason}.")
        return connection, response
    raise RemoteError(f"{url}: more than {_MAX_REDIRECTS} redirects.")


class ObjectInfo(NamedTuple):
    """What a HEAD request tells of an object (see `remote_info`)."""

    size: int
    md5: str | None
    version: str | None


def remote_info(url: str) -> ObjectInfo:
    """The size in bytes of an HTTP(S) object, its MD5 if the server gives
    one (Cloud Storage's `x-goog-hash: md5=<base64>`) and its version (the
    `ETag`, else the `Last-Modified` date), from a HEAD request.

    Returns:
        `ObjectInfo(size, md5, version)`, `md5` a hex string or None,
        `version` a string or None.

    Raises:
        RemoteNotFoundError: the object does not exist.
        RemoteUnreachableError: the host cannot be reached.
        RemoteError: the server gives no size.
    """
    connection, response = _request(url, "HEAD")
    try:
        length = response.getheader("Content-Length")
        hashes = response.getheader("x-goog-hash") or ""
        version = response.getheader("ETag") or response.getheader("Last-Modified")
    finally:
        connection.close()
    if length is None or not length.isdigit():
        raise RemoteError(f"{url}: the server gives no size (Content-Length).")
    md5 = None
    for item in hashes.split(","):
        name, _, value = item.strip().partition("=")
        if name == "md5" and value:
            try:
                md5 = base64.b64decode(value, validate=True).hex()
            except ValueError:
                md5 = None
    return ObjectInfo(int(length), md5, version)


def remote_size(url: str) -> int:
    """The size in bytes of an HTTP(S) object (a HEAD request; see `remote_info`)."""
    return remote_info(url)[0]


def _md5(path: str) -> str:
    digest = hashlib.md5(usedforsecurity=False)
    with open(path, "rb") as file:
        for block in iter(lambda: file.read(2**20), b""):
            digest.update(block)
    return digest.hexdigest()


def _range_total(url: str, response, start: int) -> int | None:
    """The object's total size from a response to a request starting at `start`.

    Returns None when the server ignored the Range header (a 200 response
    to a request from a non-zero offset).
    """
    if response.status == 200:
        if start:
            return None
        length = response.getheader("Content-Length")
        if length is None or not length.isdigit():
            raise RemoteError(f"{url}: the server gives no size (Content-Length).")
        return int(length)
    match = re.fullmatch(r"bytes (\d+)-(\d+)/(\d+)",
                         (response.getheader("Content-Range") or "").strip())
    if not match or int(match.group(1)) != start:
        raise RemoteError(
            f"{url}: unexpected Content-Range {response.getheader('Content-Range')!r} "
            f"for a read from byte {start}."
        )
    return int(match.group(3))


class RangeFile(io.RawIOBase):
    """A read-only, seekable file over an HTTP(S) object, read with Range requests.

    Sequential reads share one response; a seek elsewhere starts a new
    request. A dropped or stalled connection is reopened at the current
    offset (`RETRIES` times in a row at most); a change of the object's
    size is an error. Wrap it in `io.BufferedReader` for small reads
    (`open_range` does).

    Args:
        url: the object's `http(s)://` URL.
        size: its size in bytes (`remote_size(url)` if None).
    """

    def __init__(self, url: str, size: int | None = None) -> None:
        super().__init__()
        self.url = url
        self.size = remote_size(url) if size is None else size
        self._position = 0
        self._connection = None
        self._response = None

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._position, io.SEEK_END: self.size}
        position = base[whence] + offset
        if position < 0:
            raise ValueError(f"Negative seek position {position} in {self.url}.")
        if position != self._position:
            self._drop()
            self._position = position
        return position

    def _drop(self) -> None:
        if self._connection is not None:
            self._connection.close()
        self._connection = self._response = None

    def close(self) -> None:
        self._drop()
        super().close()

    def _open(self) -> None:
        connection, response = _request(self.url, start=self._position)
        total = _range_total(self.url, response, self._position)
        if total is None:
            connection.close()
            raise RemoteError(f"{self.url}: the server does not support Range requests.")
        if total != self.size:
            connection.close()
            raise RemoteSizeChangedError(
                f"{self.url}: the sizes disagree: its HEAD said {self.size} bytes, "
                f"its data is {total} bytes (the object changed size while being "
                "read, or the server reports a wrong size): try again, or download "
                "the file and read it locally."
            )
        self._connection, self._response = connection, response

    def readinto(self, buffer) -> int:
        if self._position >= self.size:
            return 0
        view = memoryview(buffer).cast("B")[: self.size - self._position]
        failures = 0
        while True:
            try:
                if self._response is None:
                    self._open()
                count = self._response.readinto(view)
                if count == 0:
                    raise RemoteError("the connection closed before the end")
                self._position += count
                return count
            except (RemoteNotFoundError, RemoteSizeChangedError):
                raise
            except (OSError, http.client.HTTPException) as error:
                if isinstance(error, RemoteUnreachableError) or failures >= RETRIES:
                    self._drop()
                    raise RemoteError(
                        f"{self.url}: reading from byte {self._position} failed "
                        f"({type(error).__name__}: {error})."
                    ) from error
                failures += 1
                self._drop()


def open_range(url: str, size: int | None = None) -> io.BufferedReader:
    """Opens an HTTP(S) object as a buffered, seekable binary file (see `RangeFile`)."""
    return io.BufferedReader(RangeFile(url, size), buffer_size=4 * 2**20)


def _partial_name(path: str, size: int, version: str | None = None) -> str:
    """`.<name>.<size>[-<version hash>].part`: a partial file resumes only an
    object of the same size and version."""
    directory, name = os.path.split(path)
    tag = f"-{hashlib.sha256(version.encode()).hexdigest()[:12]}" if version else ""
    return os.path.join(directory, f".{name}.{size}{tag}.part")


def _stale_partials(path: str, keep: str) -> list[str]:
    directory, name = os.path.split(path)
    pattern = re.compile(re.escape(f".{name}.") + r"\d+(-[0-9a-f]{12})?\.part")
    try:
        entries = os.listdir(directory or ".")
    except FileNotFoundError:
        return []
    return [os.path.join(directory, e) for e in entries
            if pattern.fullmatch(e) and os.path.join(directory, e) != keep]


def _lock(file) -> None:
    """An exclusive lock on `file` (POSIX `flock`; none elsewhere)."""
    try:
        import fcntl
    except ImportError:
        return
    fcntl.flock(file.fileno(), fcntl.LOCK_EX)


def _receive(url, connection, response, file, have, size, progress):
    """Appends the bytes of one ranged response to the partial `file`.

    Args:
        url: the object's URL (for the error messages).
        connection: the open connection (closed here).
        response: its response to a request from byte `have`.
        file: the partial file, holding `have` bytes.
        have: bytes already in `file`.
        size: the object's size.
        progress: the `download` progress callback, or None.

    Returns:
        `(have, error, ranged)`: the bytes now in `file`, the error that
        stopped the transfer (None if none; to retry) and whether the
        server honoured the Range header (None when none was sent).

    Raises:
        RemoteSizeChangedError: the object changed size.
        OSError: a full or read-only disk.
    """
    ranged = None
    error = None
    try:
        total = _range_total(url, response, have)
        if have:
            ranged = total is not None
        if total is None:  # Range ignored: start again.
            file.truncate(0)
            file.seek(0)
            if progress:
                progress(-have)
            have = 0
            total = _range_total(url, response, 0)
        if total != size:
            raise RemoteSizeChangedError(
                f"{url}: the object changed size during the download "
                f"({size} bytes, now {total}); run again to restart it."
            )
        started, start_bytes = time.monotonic(), have
        window, rate = read_timeout(), min_rate()
        while have < size:
            chunk = response.read1(min(CHUNK_BYTES, size - have))
            if not chunk:
                break
            written = file.write(chunk)
            have += written
            if progress:
                progress(written)
            elapsed = time.monotonic() - started
            if elapsed > window and (have - start_bytes) / elapsed < rate:
                error = RemoteError(
                    f"{url}: the transfer ran at {(have - start_bytes) / elapsed:.0f} "
                    f"bytes/s, below {rate:g} ({MIN_RATE_ENV})")
                break
    except (OSError, http.client.HTTPException) as caught:
        # A changed object, or a full or read-only disk: no retry.
        if isinstance(caught, RemoteSizeChangedError) or getattr(
                caught, "errno", None) in _DISK_ERRORS:
            raise
        error = caught
    finally:
        connection.close()
        file.flush()
    return have, error, ranged


def _give_up(url, file, partial, have, size, error, ranged):
    """Raises the error that ends a download; keeps the partial file only
    when the server honours Range (a later call resumes from it)."""
    cause = f" ({type(error).__name__}: {error})" if error else ""
    if ranged is False:
        os.remove(partial)
        raise RemoteError(
            f"{url}: the download stopped at byte {have} of {size} after {RETRIES} "
            f"retries{cause}. The server ignores Range requests, so every retry "
            "started again from byte 0 and nothing is kept: download the file on a "
            "steadier link (or from a mirror) and try again.")
    raise RemoteError(
        f"{url}: the download stopped at byte {have} of {size} after {RETRIES} "
        f"retries{cause}; run again to resume from {partial} (set {TIMEOUT_ENV} "
        f"or {MIN_RATE_ENV} for a slow link).")


def _check_complete(url, file, partial, size, md5) -> None:
    """Checks the size and MD5 of a finished partial file (deleted if its MD5 differs)."""
    if os.fstat(file.fileno()).st_size != size:
        raise RemoteError(
            f"{url}: downloaded {os.fstat(file.fileno()).st_size} bytes, "
            f"expected {size}."
        )
    if md5 is not None and _md5(partial) != md5:
        os.remove(partial)
        raise RemoteError(
            f"{url}: the downloaded file's MD5 differs from the server's ({md5}); "
            "it was deleted, run again to download it again."
        )


def download(url: str, path: str, *, size: int | None = None,
             md5: str | None = None, version: str | None = None,
             progress: Callable[[int], None] | None = None) -> str:
    """Downloads an HTTP(S) object to `path`, resuming a partial download.

    The bytes go to `.<name>.<size>.part` next to `path`, renamed to
    `path` once complete, so `path` is never half-written; a `path` that
    already has the object's size is kept as it is. A partial file
    of an earlier, interrupted call continues from where it stopped if the
    object still has the size and version (ETag or Last-Modified, where the
    server gives one) it was started with; otherwise (the object changed,
    or the partial file is longer) it starts again. A dropped or
    stalled connection resumes from the last byte written, `RETRIES` times
    in a row at most. Two processes downloading the same object take turns
    (a lock on the partial file): the second finds the file complete.

    Args:
        url: the object's `http(s)://` URL.
        path: the file to write (its directory is created).
        size: the object's size if already known (else a HEAD request,
            which also gives the server's MD5 if it has one).
        md5: the object's MD5 (hex) if known: the complete file is checked
            against it (a file that differs is deleted, and the error says
            to run again).
        version: the object's ETag or Last-Modified if known (with `size`).
        progress: called with the number of new bytes after each write
            (including the bytes a resumed partial file already holds).

    Returns:
        `path`.

    Raises:
        RemoteNotFoundError, RemoteUnreachableError, RemoteError.
    """
    if size is None:
        size, md5, version = remote_info(url)
    directory = os.path.dirname(path)
    if directory:
        os.makedirs(directory, exist_ok=True)
    if os.path.isfile(path) and os.path.getsize(path) == size and (
            md5 is None or _md5(path) == md5):
        if progress:
            progress(size)
        return path  # complete from an earlier call
    partial = _partial_name(path, size, version)
    for stale in _stale_partials(path, partial):
        os.remove(stale)
    failures = 0
    ranged = None
    with open(partial, "ab", buffering=0) as file:
        _lock(file)  # waits while another process downloads the same object
        if os.path.isfile(path) and not os.path.exists(partial):
            if progress:
                progress(size)
            return path  # that process finished it meanwhile
        have = os.fstat(file.fileno()).st_size
        if have > size:
            file.truncate(0)
            have = 0
        if progress and have:
            progress(have)
        best = have  # a retry is a failure unless it gets past this byte
        while have < size:
            try:
                connection, response = _request(url, start=have)
            except RemoteNotFoundError:
                raise
            except (OSError, http.client.HTTPException) as caught:
                # No connection at all on the first try: offline, answer now.
                if isinstance(caught, RemoteUnreachableError) and not (
                        have or failures):
                    raise
                error = caught
                connection = None
            if connection is not None:
                have, error, answer = _receive(
                    url, connection, response, file, have, size, progress)
                ranged = answer if answer is not None else ranged
                if have > best and not isinstance(error, RemoteError):
                    failures, best = 0, have
            if have >= size:
                break
            failures += 1
            if failures > RETRIES:
                _give_up(url, file, partial, have, size, error, ranged)
            time.sleep(min(0.2 * failures, 1.0))
        # Still under the lock: checked and renamed before another process
        # waiting on it looks.
        _check_complete(url, file, partial, size, md5)
        os.replace(partial, path)
    return path
