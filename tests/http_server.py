"""A threaded HTTP server on 127.0.0.1 serving a folder, with Range support.

The tests of HTTP(S) reading and downloading use it as a stand-in for the
public bucket (`<base>/<bucket>/<object>`). Knobs make it misbehave:
`drops[path] = n` ends the next GET of `path` after `n` bytes (the
connection closes mid-body), `stalls` holds paths whose GETs send headers
and then nothing, `sizes[path] = n` makes HEAD report `n` bytes, and
`delay` sleeps between 64 kB blocks (a slow link), `md5[path] = hex` makes
HEAD send Cloud Storage's `x-goog-hash: md5=<base64>`. `ignores_range`
holds paths served whole (200) whatever the Range header, `always_drops[path]
= n` ends every GET of `path` after `n` bytes, `trickle[path] = s` sends one
byte every `s` seconds, `etags[path] = tag` makes HEAD send an `ETag`.
`requests` logs `(method, path, Range header)`.
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
        self.always_drops = {}
        self.ignores_range = set()
        self.trickle = {}
        self.etags = {}
        self.stalls = set()
        self.sizes = {}
        self.md5 = {}
        self.delay = 0.0
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

    def _serve(self, handler, body):
        path = urllib.parse.unquote(urllib.parse.urlsplit(handler.path).path).lstrip("/")
        header = handler.headers.get("Range")
        self.requests.append((handler.command, path, header))
        file = os.path.join(self.root, *path.split("/"))
        if not os.path.isfile(file):
            handler.send_response(404)
            handler.send_header("Content-Length", "0")
            handler.end_headers()
            return
        with open(file, "rb") as f:
            data = f.read()
        if not body:
            handler.send_response(200)
            handler.send_header("Content-Length", str(self.sizes.get(path, len(data))))
            handler.send_header("Accept-Ranges", "bytes")
            if path in self.etags:
                handler.send_header("ETag", self.etags[path])
            if path in self.md5:
                digest = base64.b64encode(bytes.fromhex(self.md5[path])).decode()
                handler.send_header("x-goog-hash", f"crc32c=AAAAAA==,md5={digest}")
            handler.end_headers()
            return
        start = 0
        if path in self.ignores_range:
            header = None
        if header:
            start = int(header.removeprefix("bytes=").split("-")[0])
        part = data[start:]
        if header:
            handler.send_response(206)
            handler.send_header("Content-Range",
                                f"bytes {start}-{len(data) - 1}/{len(data)}")
        else:
            handler.send_response(200)
        handler.send_header("Content-Length", str(len(part)))
        handler.end_headers()
        if path in self.stalls:
            handler.wfile.flush()
            self.stop.wait(60)
            return
        limit = self.drops.pop(path, self.always_drops.get(path))
        if path in self.trickle:
            for index in range(len(part)):
                try:
                    handler.wfile.write(part[index:index + 1])
                    handler.wfile.flush()
                except OSError:
                    return
                if self.stop.wait(self.trickle[path]):
                    return
            return
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
