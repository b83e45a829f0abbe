"""A threaded HTTP server on 127.0.0.1 serving a folder, with Range support.

The tests of HTTP(S) reading and downloading use it as a stand-in for the
public bucket (`<base>/<bucket>/<object>`). Knobs make it misbehave:
`drops[path] = n` ends the next GET of `path` after `n` bytes (the
connection closes mid-body), `stalls` holds paths whose GETs send headers
and then nothing, `sizes[path] = n` makes HEAD report `n` bytes, and
`delay` sleeps between 64 kB blocks (a slow link), `md5[path] = hex` makes
HEAD send Cloud Storage's `x-goog-hash: md5=<base64>`. `requests` logs
`(method, path, Range header)`.

More misbehaviour: `cuts[path] = n` ends every GET of `path` after `n`
bytes, `ignore_range` holds paths whose GETs answer 200 with the whole
object whatever the Range, `trickle[path] = s` sends the body one byte
every `s` seconds, `slow_headers` holds paths whose answers send their
headers one byte every 0.1 s and never end them, and `after_get[path]` is
called with the server after each GET of `path` (to replace the object
between two requests). As real servers do, a Range past the end is
answered 416 with `Content-Range: bytes */<size>`, `etags[path]` and
`modified[path]` are sent as `ETag` and `Last-Modified`, an `If-Range`
that does not match them is answered with the whole object (200), and
`auth = (user, password)` asks for HTTP Basic authentication (401).
"""

import base64
import os
import socket
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler
from http.server import ThreadingHTTPServer

BLOCK = 64 * 1024


class Server:
    """`with Server(root) as server:` serves `root` at `server.base`."""

    def __init__(self, root):
        self.root = str(root)
        self.drops = {}
        self.stalls = set()
        self.sizes = {}
        self.md5 = {}
        self.delay = 0.0
        self.cuts = {}
        self.ignore_range = set()
        self.trickle = {}
        self.slow_headers = set()
        self.after_get = {}
        self.etags = {}
        self.modified = {}
        self.auth = None
        self.requests = []
        self.stop = threading.Event()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_HEAD(self):
                outer._serve(self, body=False)

            def do_GET(self):
                outer._serve(self, body=True)

        class QuietServer(ThreadingHTTPServer):
            def handle_error(self, request, client_address):
                # A client that drops the connection (the resume and timeout
                # tests do it on purpose) is no server error.
                pass

        self.httpd = QuietServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.base = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.httpd.shutdown()
        self.httpd.server_close()

    def url(self, path):
        return f"{self.base}/{path}"

    def _status(self, handler, code, path, headers=()):
        handler.send_response(code)
        if path in self.etags:
            handler.send_header("ETag", self.etags[path])
        if path in self.modified:
            handler.send_header("Last-Modified", self.modified[path])
        for name, value in headers:
            handler.send_header(name, value)

    def _authorized(self, handler):
        if self.auth is None:
            return True
        expected = base64.b64encode(":".join(self.auth).encode()).decode()
        return handler.headers.get("Authorization") == f"Basic {expected}"

    def _serve(self, handler, body):
        path = urllib.parse.unquote(urllib.parse.urlsplit(handler.path).path).lstrip("/")
        header = handler.headers.get("Range")
        self.requests.append((handler.command, path, header))
        try:
            self._answer(handler, path, header, body)
        finally:
            if body and path in self.after_get:
                self.after_get[path](self)

    def _answer(self, handler, path, header, body):
        if not self._authorized(handler):
            handler.send_response(401)
            handler.send_header("WWW-Authenticate", 'Basic realm="mirror"')
            handler.send_header("Content-Length", "0")
            handler.end_headers()
            return
        if path in self.slow_headers:
            handler.wfile.write(b"HTTP/1.1 200 OK\r\n")
            while not self.stop.wait(0.1):
                try:
                    handler.wfile.write(b"X")
                    handler.wfile.flush()
                except OSError:
                    return
            return
        file = os.path.join(self.root, *path.split("/"))
        if not os.path.isfile(file):
            handler.send_response(404)
            handler.send_header("Content-Length", "0")
            handler.end_headers()
            return
        with open(file, "rb") as f:
            data = f.read()
        if not body:
            self._status(handler, 200, path)
            handler.send_header("Content-Length", str(self.sizes.get(path, len(data))))
            handler.send_header("Accept-Ranges", "bytes")
            if path in self.md5:
                digest = base64.b64encode(bytes.fromhex(self.md5[path])).decode()
                handler.send_header("x-goog-hash", f"crc32c=AAAAAA==,md5={digest}")
            handler.end_headers()
            return
        if_range = handler.headers.get("If-Range")
        if path in self.ignore_range or (if_range is not None and if_range not in (
                self.etags.get(path), self.modified.get(path))):
            header = None
        start = 0
        if header:
            start = int(header.removeprefix("bytes=").split("-")[0])
        if header and start >= len(data):
            self._status(handler, 416, path, [("Content-Range", f"bytes */{len(data)}"),
                                              ("Content-Length", "0")])
            handler.end_headers()
            return
        part = data[start:]
        if header:
            self._status(handler, 206, path, [
                ("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")])
        else:
            self._status(handler, 200, path)
        handler.send_header("Content-Length", str(len(part)))
        handler.end_headers()
        if path in self.trickle:
            for offset in range(len(part)):
                if self.stop.wait(self.trickle[path]):
                    return
                try:
                    handler.wfile.write(part[offset:offset + 1])
                    handler.wfile.flush()
                except OSError:
                    return
            return
        if path in self.stalls:
            handler.wfile.flush()
            self.stop.wait(60)
            return
        limit = self.drops.pop(path, self.cuts.get(path))
        if limit is not None:
            handler.wfile.write(part[:limit])
            handler.wfile.flush()
            handler.connection.shutdown(socket.SHUT_RDWR)
            handler.close_connection = True
            return
        for offset in range(0, len(part), BLOCK):
            try:
                handler.wfile.write(part[offset:offset + BLOCK])
            except OSError:
                return
            if self.delay:
                time.sleep(self.delay)
