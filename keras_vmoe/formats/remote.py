"""Public objects over HTTP(S): sizes, byte-range reads and resumable downloads.

`gs://` objects of public buckets are read at their `GCS_BASE` URL and
`http(s)://` URLs the same way, with the standard library only. Every transfer
is bounded: connect timeout, read timeout, minimum rate, deadline and retries
(see `read_timeout`, `minimum_rate`, `deadline_seconds` and `download`).
"""

from __future__ import annotations

import base64
import errno
import hashlib
import http.client
import io
import math
import os
import re
import socket
import threading
import time
import urllib.parse
from collections.abc import Callable
from typing import NamedTuple

from keras_vmoe.formats.urls import redact

GCS_BASE = "https://storage.googleapis.com"
TIMEOUT_ENV = "KERAS_VMOE_HTTP_TIMEOUT"
MIN_RATE_ENV = "KERAS_VMOE_HTTP_MIN_RATE"
DEADLINE_ENV = "KERAS_VMOE_HTTP_DEADLINE"
CONNECT_TIMEOUT = 4.0
DEFAULT_READ_TIMEOUT = 30.0
MAX_READ_TIMEOUT = 3600.0
DEFAULT_MIN_RATE = 10_000.0
MAX_MIN_RATE = 1e12
DEFAULT_DEADLINE = 86_400.0
MAX_DEADLINE = 30 * 86_400.0
RETRIES = 3
CHUNK_BYTES = 2**20
_MAX_REDIRECTS = 5
_DISK_ERRORS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES)

__all__ = [
    "DEADLINE_ENV",
    "GCS_BASE",
    "MIN_RATE_ENV",
    "TIMEOUT_ENV",
    "RangeFile",
    "RemoteChangedError",
    "RemoteError",
    "RemoteNotFoundError",
    "RemoteSizeChangedError",
    "RemoteStat",
    "RemoteTimeoutError",
    "RemoteUnreachableError",
    "deadline_seconds",
    "download",
    "is_http",
    "minimum_rate",
    "open_range",
    "public_url",
    "read_timeout",
    "redact",
    "remote_info",
    "remote_size",
    "remote_stat",
]


class RemoteError(OSError):
    """An HTTP(S) object cannot be read (URL credentials shown as `***`)."""

    def __init__(self, *args) -> None:
        super().__init__(*(redact(arg) for arg in args))


class RemoteNotFoundError(RemoteError, FileNotFoundError):
    """The server answered 404 (or 403/410) for the object."""


class RemoteChangedError(RemoteError):
    """The object changed while being read, or the server's answers disagree."""


class RemoteSizeChangedError(RemoteChangedError):
    """The object's size differs from the size it had when the read started."""


class RemoteUnreachableError(RemoteError, ConnectionError):
    """No connection to the host could be opened (offline, DNS failure, refused)."""


class RemoteTimeoutError(RemoteError, TimeoutError):
    """A transfer was slower than the minimum rate or passed its deadline."""


class RemoteStat(NamedTuple):
    """What a HEAD request says about an object.

    Attributes:
        size: bytes.
        md5: hex MD5 from Cloud Storage's `x-goog-hash`, else None.
        version: `'ETag: <value>'`, else `'Last-Modified: <value>'`, else None.
    """

    size: int
    md5: str | None
    version: str | None


def is_http(path) -> bool:
    """Whether `path` is an `http://` or `https://` URL."""
    return isinstance(path, str) and path.startswith(("http://", "https://"))


def public_url(url: str, base: str | None = None) -> str:
    """The HTTP(S) URL of a public object.

    Args:
        url: `gs://bucket/object` (or an `http(s)://` URL, returned as is).
        base: the server holding the buckets (default `GCS_BASE`); the
            object is at `<base>/bucket/object`.

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
            f"Received: base={redact(base)!r}"
        )
    return base.rstrip("/") + "/" + urllib.parse.quote(url[len("gs://"):])


def _setting(value, argument: str, env: str, default: float, unit: str,
             high: float, allow_zero: bool = False) -> float:
    """`value`, else `$env`, else `default`; in (0, high], or [0, high]."""
    name = f"`{argument}`"
    if value is None:
        value, name = os.environ.get(env), env
        if not value:
            return default
    try:
        if isinstance(value, bool):
            raise TypeError
        number = float(value)
    except (TypeError, ValueError):
        number = math.nan
    low_ok = number >= 0 if allow_zero else number > 0
    if not (math.isfinite(number) and low_ok and number <= high):
        interval = f"{'[' if allow_zero else '('}0, {high:,.0f}]"
        raise ValueError(
            f"{name} must be a finite number of {unit} in {interval}"
            + (" (0 turns the check off)" if allow_zero else "")
            + f". Received: {value!r}"
        )
    return number


def read_timeout() -> float:
    """Seconds a read may receive nothing before it fails (`$KERAS_VMOE_HTTP_TIMEOUT`).

    Also the time an answer's headers may take, and the span of `minimum_rate()`.

    Raises:
        ValueError: the variable is not a number of seconds in (0, 3600].
    """
    return _setting(None, "timeout", TIMEOUT_ENV, DEFAULT_READ_TIMEOUT, "seconds",
                    MAX_READ_TIMEOUT)


def minimum_rate(value: float | None = None) -> float:
    """The bytes per second a transfer must keep (`value`, else
    `$KERAS_VMOE_HTTP_MIN_RATE`, else 10,000; 0: no minimum).

    Raises:
        ValueError: not a number of bytes per second in [0, 1e12].
    """
    return _setting(value, "min_rate", MIN_RATE_ENV, DEFAULT_MIN_RATE,
                    "bytes per second", MAX_MIN_RATE, allow_zero=True)


def deadline_seconds(value: float | None = None) -> float:
    """Seconds a download may take in all (`value`, else
    `$KERAS_VMOE_HTTP_DEADLINE`, else 86,400).

    Raises:
        ValueError: not a number of seconds in (0, 2,592,000] (30 days).
    """
    return _setting(value, "deadline", DEADLINE_ENV, DEFAULT_DEADLINE, "seconds",
                    MAX_DEADLINE)


class _OutOfTime(Exception):
    """Deadline passed or rate too low (not an OSError: no retry catches it)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class _Pace:
    """The deadline and minimum rate of one transfer.

    Only time spent receiving counts (`resume` starts a span, `count` ends it).
    """

    def __init__(self, seconds: float, rate: float, window: float) -> None:
        now = time.monotonic()
        self.seconds = seconds
        self.end = now + seconds
        self.rate = rate
        self.window = window
        self.mark = now
        self.spent = 0.0
        self.received = 0

    def resume(self) -> None:
        self.mark = time.monotonic()

    def timeout(self, read: float) -> float:
        """The socket timeout for the next wait: `read`, or the time left."""
        left = self.end - time.monotonic()
        if left <= 0:
            raise _OutOfTime(f"it did not finish within {self.seconds:g} s "
                             f"({DEADLINE_ENV})")
        return min(read, left)

    def count(self, received: int) -> None:
        now = time.monotonic()
        self.spent += now - self.mark
        self.mark = now
        self.received += received
        if now >= self.end:
            self.timeout(0.0)
        if self.spent >= self.window:
            if self.rate and self.received < self.rate * self.spent:
                raise _OutOfTime(
                    f"it is too slow: {self.received:,} bytes in {self.spent:.1f} s, "
                    f"under the minimum of {self.rate:,g} bytes/s ({MIN_RATE_ENV})")
            self.spent, self.received = 0.0, 0


def _resolve(host: str, port: int, deadline_at: float) -> list:
    """`socket.getaddrinfo`, given up at `deadline_at` (a lookup can hang offline)."""
    found: dict = {}

    def lookup() -> None:
        try:
            found["addresses"] = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except OSError as error:
            found["error"] = error

    thread = threading.Thread(target=lookup, daemon=True)
    thread.start()
    thread.join(max(deadline_at - time.monotonic(), 0.0))
    if thread.is_alive():
        raise TimeoutError(f"the name lookup of {host} took more than "
                           f"{CONNECT_TIMEOUT:g} s")
    if "error" in found:
        raise found["error"]
    return found["addresses"]


def _create_connection(address, timeout=None, source_address=None, *args):
    """`socket.create_connection`, lookup and every address within `CONNECT_TIMEOUT`."""
    deadline_at = time.monotonic() + CONNECT_TIMEOUT
    host, port = address
    error: OSError = OSError(f"no address for {host}")
    for family, kind, proto, _, sockaddr in _resolve(host, port, deadline_at):
        left = deadline_at - time.monotonic()
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


def _connect(url: str, timeout: float) -> tuple[http.client.HTTPConnection, str, dict]:
    """`(connection, request path, headers)` for `url` (with its Basic auth)."""
    parts = urllib.parse.urlsplit(url)
    cls = (http.client.HTTPSConnection if parts.scheme == "https"
           else http.client.HTTPConnection)
    try:
        host, port = parts.hostname, parts.port
    except ValueError:
        host = port = None
    if not host:
        raise ValueError(f"Expected an http(s)://host/... URL. Received: {redact(url)!r}")
    where = f"{host}:{port}" if port else host
    connection = cls(host, port, timeout=CONNECT_TIMEOUT)
    connection._create_connection = _create_connection
    try:
        connection.connect()
    except OSError as error:
        connection.close()
        raise RemoteUnreachableError(
            f"Cannot connect to {where} to read {redact(url)} "
            f"({type(error).__name__}: {error})."
        ) from error
    connection.sock.settimeout(timeout)
    headers = {"User-Agent": "keras-vmoe", "Accept-Encoding": "identity"}
    if parts.username is not None:
        user = urllib.parse.unquote(parts.username)
        password = urllib.parse.unquote(parts.password or "")
        token = base64.b64encode(f"{user}:{password}".encode()).decode("ascii")
        headers["Authorization"] = f"Basic {token}"
    path = parts.path or "/"
    return connection, path + (f"?{parts.query}" if parts.query else ""), headers


def _answer(connection, seconds: float):
    """`connection.getresponse()`, cut off if the headers take over `seconds`."""
    lock = threading.Lock()
    state = {"done": False, "fired": False}

    def cut() -> None:
        with lock:
            if state["done"] or connection.sock is None:
                return
            state["fired"] = True
            try:
                connection.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    timer = threading.Timer(seconds, cut)
    timer.daemon = True
    timer.start()
    try:
        response = connection.getresponse()
    except (OSError, http.client.HTTPException) as error:
        if state["fired"]:
            raise TimeoutError(f"no complete answer within {seconds:g} s") from error
        raise
    finally:
        with lock:
            state["done"] = True
        timer.cancel()
    if state["fired"]:  # the headers cut short may still parse
        response.close()
        raise TimeoutError(f"no complete answer within {seconds:g} s")
    return response


def _if_range(version: str | None) -> str | None:
    """The `If-Range` value of a version (None for a weak ETag, not allowed there)."""
    if version is None:
        return None
    kind, _, value = version.partition(": ")
    return None if kind == "ETag" and value.startswith("W/") else value


def _request(url: str, method: str = "GET", start: int | None = None, *,
             version: str | None = None, timeout: float | None = None):
    """Sends one request, following redirects; returns (connection, response).

    `start` adds `Range: bytes=<start>-` (and `version` an `If-Range`); the
    response is 200, 206, or 416 (only with `start`).
    """
    timeout = read_timeout() if timeout is None else timeout
    shown = redact(url)
    for _ in range(_MAX_REDIRECTS + 1):
        connection, path, headers = _connect(url, timeout)
        if start is not None:
            headers["Range"] = f"bytes={start}-"
            if _if_range(version):
                headers["If-Range"] = _if_range(version)
        try:
            connection.request(method, path, headers=headers)
            response = _answer(connection, timeout)
        except (OSError, http.client.HTTPException) as error:
            connection.close()
            raise RemoteError(
                f"{shown}: the request failed ({type(error).__name__}: {error})."
            ) from error
        if response.status in (301, 302, 303, 307, 308):
            location = response.getheader("Location")
            connection.close()
            if not location:
                raise RemoteError(f"{shown}: redirect ({response.status}) without a Location.")
            url = urllib.parse.urljoin(url, location)
            shown = redact(url)
            continue
        if response.status in (403, 404, 410):
            connection.close()
            raise RemoteNotFoundError(
                f"{shown}: not found (HTTP {response.status} {response.reason})."
            )
        if response.status == 416 and start is not None:
            return connection, response
        if response.status not in (200, 206):
            connection.close()
            raise RemoteError(f"{shown}: HTTP {response.status} {response.reason}.")
        return connection, response
    raise RemoteError(f"{shown}: more than {_MAX_REDIRECTS} redirects.")


def _version(response, like: str | None = None) -> str | None:
    """`'ETag: <value>'` (else Last-Modified); with `like`, that header only."""
    kinds = ("ETag", "Last-Modified") if like is None else (like.partition(": ")[0],)
    for kind in kinds:
        value = response.getheader(kind)
        if value and value.strip():
            return f"{kind}: {value.strip()}"
    return None


def _check_version(url: str, response, version: str | None, start: int) -> None:
    """Raises RemoteChangedError if the response names another version of the object."""
    if version is None:
        return
    now = _version(response, like=version)
    # A weak ETag matches its strong form.
    if now is not None and now.replace(": W/", ": ", 1) != version.replace(
            ": W/", ": ", 1):
        raise RemoteChangedError(
            f"{redact(url)}: the object changed while being read ({version}, now "
            f"{now.partition(': ')[2]} in the answer to a read from byte {start})."
        )


def remote_stat(url: str) -> RemoteStat:
    """What a HEAD request says about an HTTP(S) object: its size, MD5 and version.

    Raises:
        RemoteNotFoundError: the object does not exist.
        RemoteUnreachableError: the host cannot be reached.
        RemoteError: the server gives no size.
    """
    connection, response = _request(url, "HEAD")
    try:
        length = response.getheader("Content-Length")
        hashes = response.getheader("x-goog-hash") or ""
        version = _version(response)
    finally:
        connection.close()
    if length is None or not length.isdigit():
        raise RemoteError(f"{redact(url)}: the server gives no size (Content-Length).")
    md5 = None
    for item in hashes.split(","):
        name, _, value = item.strip().partition("=")
        if name == "md5" and value:
            try:
                md5 = base64.b64decode(value, validate=True).hex()
            except ValueError:
                md5 = None
    return RemoteStat(int(length), md5, version)


def remote_info(url: str) -> tuple[int, str | None]:
    """`(size, hex md5 or None)` of an HTTP(S) object (see `remote_stat`)."""
    stat = remote_stat(url)
    return stat.size, stat.md5


def remote_size(url: str) -> int:
    """The size in bytes of an HTTP(S) object (a HEAD request; see `remote_stat`)."""
    return remote_stat(url).size


def _md5(path: str) -> str:
    digest = hashlib.md5(usedforsecurity=False)
    with open(path, "rb") as file:
        for block in iter(lambda: file.read(2**20), b""):
            digest.update(block)
    return digest.hexdigest()


def _sizes_disagree(url: str, size: int, total: int, start: int) -> RemoteSizeChangedError:
    return RemoteSizeChangedError(
        f"{redact(url)}: the sizes disagree: the object had {size:,} bytes when the "
        f"read started (its HEAD answer), and the answer to a read from byte "
        f"{start:,} gives {total:,} bytes. It changed, or the server answers "
        "inconsistently; run again later, or download the file by hand."
    )


def _body_start(url: str, response, start: int, size: int) -> int:
    """`start` for a consistent 206 answer to a read from `start`, 0 for a 200.

    Raises RemoteSizeChangedError for another size than `size`, RemoteError
    for no size or an inconsistent Content-Range.
    """
    shown = redact(url)
    content_range = (response.getheader("Content-Range") or "").strip()
    if response.status == 416:
        match = re.fullmatch(r"bytes \*/(\d+)", content_range)
        if match and int(match.group(1)) != size:
            raise _sizes_disagree(url, size, int(match.group(1)), start)
        raise RemoteError(
            f"{shown}: the server refuses a read from byte {start:,} of a {size:,}-byte "
            f"object (HTTP 416, Content-Range {content_range!r})."
        )
    length = response.getheader("Content-Length")
    if response.status == 200:
        if length is None or not length.strip().isdigit():
            raise RemoteError(f"{shown}: the server gives no size (Content-Length).")
        if int(length) != size:
            raise _sizes_disagree(url, size, int(length), start)
        return 0
    match = re.fullmatch(r"bytes (\d+)-(\d+)/(\d+)", content_range)
    first, last, total = map(int, match.groups()) if match else (-1, -1, -1)
    if not match or first != start or not first <= last < total or (
            length is not None and length.strip() != str(last - first + 1)):
        raise RemoteError(
            f"{shown}: unexpected Content-Range {content_range!r} (Content-Length "
            f"{length}) for a read from byte {start:,}."
        )
    if total != size:
        raise _sizes_disagree(url, size, total, start)
    return start


class RangeFile(io.RawIOBase):
    """A read-only, seekable file over an HTTP(S) object, read with Range requests.

    Sequential reads share one response; a seek elsewhere starts a new one.
    A dropped connection is reopened at the offset (`RETRIES` times in a row
    at most); a read under `minimum_rate()`, or another size or version of
    the object, is an error. `open_range` wraps it in `io.BufferedReader`.

    Args:
        url: the object's `http(s)://` URL.
        size: its size in bytes (`remote_stat(url)` if None).
        version: its `RemoteStat.version` if known (else that of the
            first answer).
    """

    def __init__(self, url: str, size: int | None = None,
                 version: str | None = None) -> None:
        super().__init__()
        self.url = url
        if size is None:
            size, _, version = remote_stat(url)
        self.size = size
        self.version = version
        self._timeout = read_timeout()
        self._pace = _Pace(math.inf, minimum_rate(), self._timeout)
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
            raise ValueError(f"Negative seek position {position} in {redact(self.url)}.")
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
        connection, response = _request(self.url, start=self._position,
                                        version=self.version, timeout=self._timeout)
        try:
            _check_version(self.url, response, self.version, self._position)
            if _body_start(self.url, response, self._position, self.size) != self._position:
                raise RemoteError(
                    f"{redact(self.url)}: the server does not support Range requests.")
        except BaseException:
            connection.close()
            raise
        if self.version is None:
            self.version = _version(response)
        self._connection, self._response = connection, response

    def readinto(self, buffer) -> int:
        if self._position >= self.size:
            return 0
        view = memoryview(buffer).cast("B")[: self.size - self._position]
        failures = 0
        self._pace.resume()
        while True:
            try:
                if self._response is None:
                    self._open()
                chunk = self._response.read1(len(view))
                self._pace.count(len(chunk))
                if not chunk:
                    raise RemoteError("the connection closed before the end")
                view[: len(chunk)] = chunk
                self._position += len(chunk)
                return len(chunk)
            except _OutOfTime as slow:
                self._drop()
                raise RemoteTimeoutError(
                    f"{redact(self.url)}: reading from byte {self._position:,} failed: "
                    f"{slow.reason}. Run again on a faster link, set {MIN_RATE_ENV} "
                    "lower (0 turns the check off), or download the file first and "
                    "read the local copy."
                ) from None
            except (RemoteNotFoundError, RemoteChangedError):
                self._drop()
                raise
            except (OSError, http.client.HTTPException) as error:
                self._drop()
                if isinstance(error, RemoteUnreachableError) or failures >= RETRIES:
                    raise RemoteError(
                        f"{redact(self.url)}: reading from byte {self._position:,} "
                        f"failed after {failures} retries ({type(error).__name__}: "
                        f"{error}); run again later."
                    ) from error
                failures += 1


def open_range(url: str, size: int | None = None,
               version: str | None = None) -> io.BufferedReader:
    """Opens an HTTP(S) object as a buffered, seekable binary file (see `RangeFile`)."""
    return io.BufferedReader(RangeFile(url, size, version), buffer_size=4 * 2**20)


def _partial_name(path: str, size: int, version: str | None) -> str:
    """`.<name>.<size>[.<version digest>].part` next to `path`."""
    directory, name = os.path.split(path)
    tag = ""
    if version is not None:
        tag = "." + hashlib.sha256(version.encode()).hexdigest()[:12]
    return os.path.join(directory, f".{name}.{size}{tag}.part")


def _stale_partials(path: str, keep: str) -> list[str]:
    directory, name = os.path.split(path)
    pattern = re.compile(re.escape(f".{name}.") + r"\d+(\.[0-9a-f]{12})?\.part")
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


class _Transfer:
    """The requests of one `download` into its locked partial file.

    `have`: bytes in the partial file; `ranged`: whether the last answer
    honoured the Range (the partial file is kept after a failure only then).
    """

    def __init__(self, url, path, partial, file, size, version, pace, timeout,
                 progress) -> None:
        self.url, self.shown, self.path, self.partial = url, redact(url), path, partial
        self.file, self.size, self.version = file, size, version
        self.pace, self.timeout, self.progress = pace, timeout, progress
        self.have = os.fstat(file.fileno()).st_size
        self.ranged = True

    def run(self) -> None:
        """Requests the missing bytes until the partial file is complete."""
        failures = 0
        furthest = self.have
        error = None
        try:
            while self.have < self.size:
                self.pace.resume()
                try:
                    connection, response = _request(
                        self.url, start=self.have, version=self.version,
                        timeout=self.pace.timeout(self.timeout))
                except RemoteNotFoundError:
                    raise
                except (OSError, http.client.HTTPException) as caught:
                    # No connection at all on the first try: offline, answer now.
                    if isinstance(caught, RemoteUnreachableError) and not (
                            self.have or failures):
                        raise
                    error, connection = caught, None
                if connection is not None:
                    error = self._receive(connection, response)
                if self.have >= self.size:
                    return
                if self.have >= furthest + CHUNK_BYTES:
                    failures = 0  # a real step forward, not a restart from byte 0
                furthest = max(furthest, self.have)
                failures += 1
                if failures > RETRIES:
                    detail = f" ({type(error).__name__}: {error})" if error else ""
                    raise RemoteError(
                        f"{self.shown}: the download stopped at byte {self.have:,} of "
                        f"{self.size:,} after {RETRIES} retries{detail}; {self._kept()}, "
                        f"or download the file by hand to {self.path}."
                    )
                time.sleep(min(0.2 * failures, 1.0))
        except _OutOfTime as out:
            setting = DEADLINE_ENV if DEADLINE_ENV in out.reason else MIN_RATE_ENV
            raise RemoteTimeoutError(
                f"{self.shown}: the download stopped at byte {self.have:,} of "
                f"{self.size:,}: {out.reason}; {self._kept()}, set {setting} for a "
                f"slow link, or download the file by hand to {self.path}."
            ) from None

    def _kept(self) -> str:
        """What happens to the partial file after a failure, as advice."""
        if not self.ranged:
            self.file.truncate(0)
            os.remove(self.partial)
            return ("the server ignores Range requests, so a download cannot resume "
                    "and nothing was kept; run again later")
        if self.have:
            return f"run again to resume from {self.partial} ({self.have:,} bytes kept)"
        return "run again later"

    def _receive(self, connection, response):
        """Appends one answer's body; returns the error to retry after, or None."""
        try:
            _check_version(self.url, response, self.version, self.have)
            start = _body_start(self.url, response, self.have, self.size)
            self.ranged = response.status == 206
            if start != self.have:  # Range ignored: start again.
                self.file.truncate(0)
                self.file.seek(0)
                if self.progress:
                    self.progress(-self.have)
                self.have = 0
            while self.have < self.size:
                chunk = response.read1(min(CHUNK_BYTES, self.size - self.have))
                if not chunk:
                    if response.length:
                        return RemoteError("the connection closed before the end")
                    return RemoteError(f"the answer ended at byte {self.have:,}")
                written = self.file.write(chunk)
                self.have += written
                if self.progress:
                    self.progress(written)
                self.pace.count(written)
            return None
        except (OSError, http.client.HTTPException) as caught:
            # A changed object, or a full or read-only disk: no retry.
            if isinstance(caught, RemoteChangedError) or getattr(
                    caught, "errno", None) in _DISK_ERRORS:
                raise
            return caught
        finally:
            connection.close()


def download(url: str, path: str, *, size: int | None = None,
             md5: str | None = None, version: str | None = None,
             progress: Callable[[int], None] | None = None,
             deadline: float | None = None, min_rate: float | None = None) -> str:
    """Downloads an HTTP(S) object to `path`, resuming a partial download.

    The bytes go to `.<name>.<size>[.<version digest>].part` next to `path`,
    renamed once complete; a `path` of the right size is kept. A partial file
    continues only if the object still has its size and version (`ETag`, else
    `Last-Modified`), and is kept after a failure only if the server honours
    Range. A dropped connection resumes from the last byte, `RETRIES` times
    in a row at most (the count restarts after `CHUNK_BYTES` of new
    progress). Two processes downloading the same object take turns.

    Args:
        url: the object's `http(s)://` URL.
        path: the file to write (its directory is created).
        size: the object's size if known (else a HEAD request, which also
            gives the MD5 and version).
        md5: the object's hex MD5 if known; a complete file that differs is
            deleted.
        version: the object's `RemoteStat.version` if known (with `size`).
        progress: called with the count of new bytes after each write
            (negative when a server ignoring Range makes it restart).
        deadline: seconds the whole download may take (default
            `$KERAS_VMOE_HTTP_DEADLINE`, else a day).
        min_rate: bytes per second to keep over every `read_timeout()`
            seconds (default `$KERAS_VMOE_HTTP_MIN_RATE`, else 10,000; 0: none).

    Returns:
        `path`.

    Raises:
        ValueError: a bad `deadline`, `min_rate` or environment variable.
        RemoteNotFoundError, RemoteUnreachableError, RemoteChangedError,
        RemoteTimeoutError, RemoteError.
    """
    timeout = read_timeout()
    pace = _Pace(deadline_seconds(deadline), minimum_rate(min_rate), timeout)
    if size is None:
        size, md5, version = remote_stat(url)
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
    with open(partial, "ab", buffering=0) as file:
        _lock(file)  # waits while another process downloads the same object
        if os.path.isfile(path) and not os.path.exists(partial):
            if progress:
                progress(size)
            return path  # that process finished it meanwhile
        if os.fstat(file.fileno()).st_size > size:
            file.truncate(0)
        transfer = _Transfer(url, path, partial, file, size, version, pace, timeout,
                             progress)
        if progress and transfer.have:
            progress(transfer.have)
        transfer.run()
        # Checked and renamed under the lock, before a waiting process looks.
        have = os.fstat(file.fileno()).st_size
        if have != size:
            raise RemoteError(
                f"{redact(url)}: downloaded {have} bytes, expected {size}.")
        if md5 is not None and _md5(partial) != md5:
            os.remove(partial)
            raise RemoteError(
                f"{redact(url)}: the downloaded file's MD5 differs from the server's "
                f"({md5}); it was deleted, run again to download it again.")
        os.replace(partial, path)
    return path
