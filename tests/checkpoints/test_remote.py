"""HTTP(S) reading and downloading against a real server on 127.0.0.1."""

import hashlib
import os
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from http_server import Server

from keras_vmoe.formats import partitioned as P
from keras_vmoe.formats import remote

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def served(tmp_path):
    """A bucket folder with a 1 MB object and the tiny V-MoE checkpoint."""
    bucket = tmp_path / "bucket" / "b"
    bucket.mkdir(parents=True)
    data = np.random.default_rng(0).integers(0, 256, 10**6, dtype="uint8").tobytes()
    (bucket / "blob.bin").write_bytes(data)
    with Server(tmp_path / "bucket") as server:
        yield server, data


def test_public_url_maps_gs_to_the_base():
    assert remote.public_url("gs://b/a b/c.npz", "http://127.0.0.1:8/m/") == (
        "http://127.0.0.1:8/m/b/a%20b/c.npz")
    assert remote.public_url("https://x/y") == "https://x/y"
    with pytest.raises(ValueError, match="base='ftp://x'"):
        remote.public_url("gs://b/o", "ftp://x")
    with pytest.raises(ValueError, match="url='/tmp/x'"):
        remote.public_url("/tmp/x")


def test_range_file_reads_and_seeks(served):
    server, data = served
    url = server.url("b/blob.bin")
    assert remote.remote_size(url) == len(data)
    with remote.open_range(url) as file:
        assert file.read(10) == data[:10]
        file.seek(500_000)
        assert file.read(7) == data[500_000:500_007]
        file.seek(-3, os.SEEK_END)
        assert file.read() == data[-3:]
    assert ("GET", "b/blob.bin", "bytes=999997-") in server.requests


def test_range_file_resumes_a_dropped_connection(served):
    server, data = served
    server.drops["b/blob.bin"] = 300_000
    with remote.open_range(server.url("b/blob.bin")) as file:
        assert file.read() == data
    assert ("GET", "b/blob.bin", "bytes=300000-") in server.requests


def test_partitioned_checkpoint_read_over_http(tmp_path, upstream_dir):
    fixture = upstream_dir / "vmoe_tiny"
    with Server(fixture) as server:
        over_http = dict(P.iter_leaves(server.url("checkpoint")))
    local = P.restore_flat(str(fixture / "checkpoint"))
    assert list(over_http) and sorted(over_http) == sorted(local)
    for key, value in local.items():
        np.testing.assert_array_equal(over_http[key], value)


def test_gs_reads_go_over_https_without_tensorflow(monkeypatch, upstream_dir):
    monkeypatch.setitem(sys.modules, "tensorflow", None)
    with Server(upstream_dir) as server:
        monkeypatch.setattr(remote, "GCS_BASE", server.base)
        index = P.read_index("gs://vmoe_tiny/checkpoint", check_data=True)
    assert index.shard_count == 1


def test_download_and_resume_after_a_drop(served, tmp_path):
    server, data = served
    server.drops["b/blob.bin"] = 400_000
    seen = []
    target = tmp_path / "out" / "blob.bin"
    remote.download(server.url("b/blob.bin"), str(target), progress=seen.append)
    assert target.read_bytes() == data
    assert sum(seen) == len(data)
    assert ("GET", "b/blob.bin", "bytes=400000-") in server.requests
    assert os.listdir(target.parent) == ["blob.bin"]


def test_missing_object_is_a_404_error(served, tmp_path):
    server, _ = served
    url = server.url("b/nothing.bin")
    with pytest.raises(remote.RemoteNotFoundError, match="nothing.bin.*404"):
        remote.download(url, str(tmp_path / "x"))
    assert not (tmp_path / "x").exists()


def test_a_partial_file_of_another_size_restarts(served, tmp_path):
    server, data = served
    target = tmp_path / "blob.bin"
    stale = tmp_path / f".blob.bin.{len(data) + 5}.part"
    stale.write_bytes(b"x" * 1000)
    longer = tmp_path / f".blob.bin.{len(data)}.part"
    remote.download(server.url("b/blob.bin"), str(target))
    assert target.read_bytes() == data
    assert not stale.exists() and not longer.exists()
    # A partial file longer than the object is discarded too.
    target.unlink()
    longer.write_bytes(data + b"extra")
    remote.download(server.url("b/blob.bin"), str(target))
    assert target.read_bytes() == data


def test_an_object_changing_size_is_refused(served, tmp_path):
    server, data = served
    server.sizes["b/blob.bin"] = len(data) + 1  # HEAD and GET disagree
    with pytest.raises(remote.RemoteSizeChangedError, match="sizes disagree"):
        remote.download(server.url("b/blob.bin"), str(tmp_path / "blob.bin"))
    with pytest.raises(remote.RemoteSizeChangedError, match="sizes disagree"):
        with remote.open_range(server.url("b/blob.bin")) as file:
            file.read()
    assert not (tmp_path / "blob.bin").exists()


def test_a_stalled_server_times_out(served, tmp_path, monkeypatch):
    server, _ = served
    monkeypatch.setenv(remote.TIMEOUT_ENV, "0.3")
    server.stalls.add("b/blob.bin")
    start = time.monotonic()
    with pytest.raises(remote.RemoteError, match="after 3 retries.*run again"):
        remote.download(server.url("b/blob.bin"), str(tmp_path / "blob.bin"))
    assert time.monotonic() - start < 5
    assert not (tmp_path / "blob.bin").exists()
    monkeypatch.setenv(remote.TIMEOUT_ENV, "soon")
    with pytest.raises(ValueError, match="KERAS_VMOE_HTTP_TIMEOUT.*'soon'"):
        remote.read_timeout()


def test_refused_connection_fails_at_once(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    start = time.monotonic()
    with pytest.raises(remote.RemoteUnreachableError, match=f"127.0.0.1:{port}"):
        remote.download(f"http://127.0.0.1:{port}/b/o", str(tmp_path / "o"))
    assert time.monotonic() - start < 2


def test_unanswered_connection_gives_up_within_the_connect_timeout(tmp_path):
    # A listening socket whose accept queue is full drops new connection
    # attempts, as a host without a route does.
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    fillers = []
    try:
        for _ in range(4):
            filler = socket.socket()
            filler.setblocking(False)
            filler.connect_ex(("127.0.0.1", port))
            fillers.append(filler)
        time.sleep(0.2)
        start = time.monotonic()
        with pytest.raises(remote.RemoteUnreachableError):
            remote.remote_size(f"http://127.0.0.1:{port}/b/o")
        assert time.monotonic() - start <= remote.CONNECT_TIMEOUT + 1
    finally:
        for sock in [*fillers, listener]:
            sock.close()


_CHILD = """
import sys
import threading
from keras_vmoe.formats import remote
remote.download(sys.argv[1], sys.argv[2])
"""


def test_killed_download_resumes_on_the_next_run(served, tmp_path):
    server, data = served
    server.delay = 0.05  # about 1.3 MB/s
    target = tmp_path / "blob.bin"
    env = dict(os.environ, PYTHONPATH=ROOT)
    child = subprocess.Popen([sys.executable, "-c", _CHILD, server.url("b/blob.bin"),
                              str(target)], env=env)
    partial = tmp_path / f".blob.bin.{len(data)}.part"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not (
            partial.exists() and partial.stat().st_size >= 2**17):
        time.sleep(0.05)
    child.kill()
    child.wait()
    have = partial.stat().st_size
    assert 0 < have < len(data) and not target.exists()
    server.delay = 0.0
    remote.download(server.url("b/blob.bin"), str(target))
    assert target.read_bytes() == data
    assert ("GET", "b/blob.bin", f"bytes={have}-") in server.requests


def test_a_hanging_name_lookup_counts_in_the_connect_timeout(monkeypatch, tmp_path):
    release = threading.Event()

    def hang(*args, **kwargs):
        release.wait(30)
        raise socket.gaierror("released")

    monkeypatch.setattr(remote.socket, "getaddrinfo", hang)
    monkeypatch.setattr(remote, "CONNECT_TIMEOUT", 0.5)
    start = time.monotonic()
    try:
        with pytest.raises(remote.RemoteUnreachableError,
                           match="name lookup of bucket.example took more than 0.5 s"):
            remote.download("https://bucket.example/b/o", str(tmp_path / "o"))
    finally:
        release.set()
    assert time.monotonic() - start < 2


def test_the_servers_md5_is_checked(served, tmp_path):
    server, data = served
    tmp_path = tmp_path / "out"
    url = server.url("b/blob.bin")
    server.md5["b/blob.bin"] = hashlib.md5(data).hexdigest()
    assert remote.remote_info(url) == (len(data), hashlib.md5(data).hexdigest())
    remote.download(url, str(tmp_path / "good.bin"))
    assert (tmp_path / "good.bin").read_bytes() == data
    server.md5["b/blob.bin"] = hashlib.md5(b"other").hexdigest()
    with pytest.raises(remote.RemoteError, match="MD5 differs.*run again"):
        remote.download(url, str(tmp_path / "bad.bin"))
    assert os.listdir(tmp_path) == ["good.bin"]
    # A complete file that does not match is not reused.
    with pytest.raises(remote.RemoteError, match="MD5 differs"):
        remote.download(url, str(tmp_path / "good.bin"))


def test_two_downloads_of_the_same_object_take_turns(served, tmp_path):
    server, data = served
    server.delay = 0.01
    target = tmp_path / "out" / "blob.bin"
    errors = []

    def fetch():
        try:
            remote.download(server.url("b/blob.bin"), str(target))
        except Exception as error:  # reported below
            errors.append(error)

    threads = [threading.Thread(target=fetch) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert errors == [] and target.read_bytes() == data
    assert [m for m, p, _ in server.requests if p == "b/blob.bin"].count("GET") == 1
    assert os.listdir(target.parent) == ["blob.bin"]


def test_npz_read_over_http(tmp_path):
    from keras_vmoe.formats import vit_npz

    params = {"Transformer/encoder_norm/scale": np.arange(6, dtype="float32"),
              "head/kernel": np.ones((3, 2), "float32")}
    (tmp_path / "b").mkdir()
    vit_npz.save(str(tmp_path / "b" / "ViT.npz"), params)
    with Server(tmp_path) as server:
        loaded = vit_npz.load(server.url("b/ViT.npz"))
        with pytest.raises(P.CheckpointError, match="not found: .*b/none.npz"):
            vit_npz.load(server.url("b/none.npz"))
    assert sorted(loaded) == sorted(params)
    for key, value in params.items():
        np.testing.assert_array_equal(loaded[key], value)
