"""Reading a partitioned checkpoint over HTTP: streamed leaf by leaf with
Range reads, or downloaded to disk and then read (the released-weights
path), against reading the local file.

A single-shard checkpoint of ViT-B/16's size (86 M float32 parameters,
345 MB; `--quick`: 5 MB) is generated, served from a separate process on
127.0.0.1 (HTTP/1.1 with Range support, read from disk), and each mode runs
in its own process, `--repeats` times, alternating; time and peak RSS
(`VmHWM`) per run. The local server measures the client's overhead, not
a network link.

    python benchmarks/http_checkpoint.py > benchmarks/results/http_checkpoint_<date>.json
"""

import argparse
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import harness  # noqa: E402

MODES = ("stream", "download", "local")


def _generate(prefix, quick):
    import numpy as np

    from keras_vmoe.formats import partitioned

    rng = np.random.default_rng(0)
    width, layers = (64, 2) if quick else (768, 12)
    tree = {f"block{i:02d}": {
        "qkv": rng.standard_normal((width, 3 * width), dtype="float32"),
        "out": rng.standard_normal((width, width), dtype="float32"),
        "mlp1": rng.standard_normal((width, 4 * width), dtype="float32"),
        "mlp2": rng.standard_normal((4 * width, width), dtype="float32"),
    } for i in range(layers)}
    tree["embedding"] = rng.standard_normal((768, width), dtype="float32")
    tree["head"] = rng.standard_normal((width, 1000), dtype="float32")
    partitioned.save_checkpoint(prefix, tree)


def _serve(root):
    from http.server import BaseHTTPRequestHandler
    from http.server import ThreadingHTTPServer

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):
            pass

        def _head(self, body):
            path = os.path.join(root, self.path.lstrip("/"))
            if not os.path.isfile(path):
                self.send_response(404)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return None
            size = os.path.getsize(path)
            start = 0
            header = self.headers.get("Range")
            if body and header:
                start = int(header.removeprefix("bytes=").split("-")[0])
                self.send_response(206)
                self.send_header("Content-Range", f"bytes {start}-{size - 1}/{size}")
            else:
                self.send_response(200)
            self.send_header("Content-Length", str(size - start))
            self.end_headers()
            return path, start

        def do_HEAD(self):
            self._head(False)

        def do_GET(self):
            found = self._head(True)
            if found:
                with open(found[0], "rb") as file:
                    file.seek(found[1])
                    shutil.copyfileobj(file, self.wfile, 2**20)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    print(f"http://127.0.0.1:{server.server_address[1]}", flush=True)
    server.serve_forever()


def _measure(mode, source, work):
    from keras_vmoe.formats import partitioned
    from keras_vmoe.formats import remote

    start = time.perf_counter()
    download_s = None
    if mode == "download":
        local = os.path.join(work, "download", "checkpoint")
        shutil.rmtree(os.path.dirname(local), ignore_errors=True)
        for suffix in (".index", ".data-00000-of-00001"):
            remote.download(source + suffix, local + suffix)
        download_s = time.perf_counter() - start
        source = local
    total = sum(array.nbytes for _, array in partitioned.iter_leaves(source))
    seconds = time.perf_counter() - start
    print(json.dumps({"mode": mode, "bytes": total, "seconds": round(seconds, 3),
                      "download_seconds": download_s and round(download_s, 3),
                      "peak_rss_mib": _peak_rss_mib()}))


def _peak_rss_mib():
    """This process's peak RSS (VmHWM: unlike ru_maxrss, not inherited from
    the parent across fork and exec)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        pass
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


def _child(args, env):
    done = subprocess.run([sys.executable, os.path.abspath(__file__), *args], env=env,
                          capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="a 5 MB checkpoint, 1 run")
    parser.add_argument("--output", default=None, help="also write the JSON here")
    parser.add_argument("--serve", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--measure", nargs=3, default=None, help=argparse.SUPPRESS)
    harness.add_arguments(parser)
    args = parser.parse_args(argv)
    if args.serve:
        return _serve(args.serve)
    if args.measure:
        return _measure(*args.measure)
    harness.record_start(args.allow_loaded)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
         os.environ.get("PYTHONPATH", "")]))
    runs = {mode: [] for mode in MODES}
    with tempfile.TemporaryDirectory() as work:
        served = os.path.join(work, "served")
        os.makedirs(served)
        _generate(os.path.join(served, "checkpoint"), args.quick)
        server = subprocess.Popen([sys.executable, os.path.abspath(__file__),
                                   "--serve", served], env=env, stdout=subprocess.PIPE,
                                  text=True)
        try:
            base = server.stdout.readline().strip()
            for _ in range(1 if args.quick else args.repeats):
                for mode in MODES:
                    source = (os.path.join(served, "checkpoint") if mode == "local"
                              else f"{base}/checkpoint")
                    runs[mode].append(_child(["--measure", mode, source, work], env))
        finally:
            server.kill()
            server.wait()
        size = sum(os.path.getsize(os.path.join(served, f)) for f in os.listdir(served))
    return harness.write_result({
        "benchmark": "http_checkpoint",
        "checkpoint": {"bytes": size, "shards": 1,
                       "model": "5 MB (quick)" if args.quick else "ViT-B/16 size"},
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
        "runs": runs,
        "best_seconds": {m: min(r["seconds"] for r in runs[m]) for m in MODES},
    }, args.output, indent=1)


if __name__ == "__main__":
    main()
