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


# ----------------------------------------------------------------------
# Every transfer ends: misbehaving servers.
# ----------------------------------------------------------------------


def _ends_within(seconds, function, *args, **kwargs):
    """Runs `function` in a thread; fails the test if it is still running
    after `seconds` (instead of hanging it). Returns what it raised."""
    outcome = {}

    def target():
        try:
            outcome["value"] = function(*args, **kwargs)
        except BaseException as error:  # returned to the test
            outcome["error"] = error

    thread = threading.Thread(target=target, daemon=True)
    start = time.monotonic()
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still running after {seconds} s"
    outcome["seconds"] = time.monotonic() - start
    return outcome


def test_a_server_ignoring_range_and_dropping_every_transfer_gives_up(served, tmp_path):
    server, data = served
    server.ignore_range.add("b/blob.bin")
    server.cuts["b/blob.bin"] = 100_000
    target = tmp_path / "out" / "blob.bin"
    outcome = _ends_within(20, remote.download, server.url("b/blob.bin"), str(target))
    error = outcome.get("error")
    assert isinstance(error, remote.RemoteError), outcome
    message = str(error)
    assert f"{server.url('b/blob.bin')}: the download stopped at byte 100,000" in message
    assert "after 3 retries" in message and "ignores Range requests" in message
    assert "nothing was kept" in message and f"by hand to {target}" in message
    # Restarts from byte 0 are no progress: 1 request and 3 retries.
    gets = [r for m, p, r in server.requests if m == "GET"]
    assert len(gets) == remote.RETRIES + 1
    # Bytes of a server that cannot resume are not kept.
    assert os.listdir(target.parent) == []


def test_a_server_honouring_range_but_dropping_keeps_the_partial_file(served, tmp_path):
    server, data = served
    server.cuts["b/blob.bin"] = 100_000
    target = tmp_path / "blob.bin"
    outcome = _ends_within(20, remote.download, server.url("b/blob.bin"), str(target))
    error = outcome.get("error")
    assert isinstance(error, remote.RemoteError), outcome
    assert "stopped at byte 400,000 of 1,000,000 after 3 retries" in str(error)
    assert "run again to resume from" in str(error)
    ranges = [r for m, p, r in server.requests if m == "GET"]
    assert ranges == ["bytes=0-", "bytes=100000-", "bytes=200000-", "bytes=300000-"]
    # The next call resumes from the kept bytes.
    del server.cuts["b/blob.bin"]
    remote.download(server.url("b/blob.bin"), str(target))
    assert target.read_bytes() == data
    assert ("GET", "b/blob.bin", "bytes=400000-") in server.requests


def test_a_trickling_body_is_too_slow(served, tmp_path, monkeypatch):
    server, data = served
    server.trickle["b/blob.bin"] = 0.02  # 50 bytes/s
    monkeypatch.setenv(remote.TIMEOUT_ENV, "0.5")
    monkeypatch.setenv(remote.MIN_RATE_ENV, "1000")
    target = tmp_path / "blob.bin"
    outcome = _ends_within(10, remote.download, server.url("b/blob.bin"), str(target))
    error = outcome.get("error")
    assert isinstance(error, remote.RemoteTimeoutError), outcome
    assert outcome["seconds"] < 5
    message = str(error)
    assert message.startswith(f"{server.url('b/blob.bin')}: the download stopped at byte ")
    assert "too slow" in message and "under the minimum of 1,000 bytes/s" in message
    assert f"set {remote.MIN_RATE_ENV}" in message and "run again to resume" in message
    # Reading without downloading (RangeFile) has the same minimum.
    outcome = _ends_within(10, lambda: remote.open_range(server.url("b/blob.bin")).read(10**5))
    assert isinstance(outcome.get("error"), remote.RemoteTimeoutError), outcome
    assert "reading from byte" in str(outcome["error"])


def test_a_download_has_a_deadline(served, tmp_path, monkeypatch):
    server, _ = served
    server.trickle["b/blob.bin"] = 0.02
    monkeypatch.setenv(remote.DEADLINE_ENV, "0.8")
    monkeypatch.setenv(remote.MIN_RATE_ENV, "0")  # no minimum rate: the deadline ends it
    outcome = _ends_within(10, remote.download, server.url("b/blob.bin"),
                           str(tmp_path / "blob.bin"))
    error = outcome.get("error")
    assert isinstance(error, remote.RemoteTimeoutError), outcome
    assert "did not finish within 0.8 s (KERAS_VMOE_HTTP_DEADLINE)" in str(error)
    assert 0.7 < outcome["seconds"] < 5
    # As an argument, checked like the variable.
    with pytest.raises(ValueError, match=r"`deadline` must be .*Received: -1"):
        remote.download(server.url("b/blob.bin"), str(tmp_path / "x"), deadline=-1)
    with pytest.raises(ValueError, match=r"`min_rate` must be .*Received: 'fast'"):
        remote.download(server.url("b/blob.bin"), str(tmp_path / "x"), min_rate="fast")


def test_trickled_headers_time_out(served, monkeypatch):
    server, _ = served
    server.slow_headers.add("b/blob.bin")
    monkeypatch.setenv(remote.TIMEOUT_ENV, "0.5")
    outcome = _ends_within(10, remote.remote_stat, server.url("b/blob.bin"))
    assert isinstance(outcome.get("error"), remote.RemoteError), outcome
    assert "no complete answer within 0.5 s" in str(outcome["error"])


@pytest.mark.parametrize("value", ["inf", "1e300", "nan", "0", "-1", "3601", "soon"])
def test_the_timeout_variable_is_checked(served, tmp_path, monkeypatch, value):
    server, _ = served
    monkeypatch.setenv(remote.TIMEOUT_ENV, value)
    with pytest.raises(ValueError, match=(
            rf"KERAS_VMOE_HTTP_TIMEOUT must be a finite number of seconds in "
            rf"\(0, 3,600\]\. Received: '{value}'")):
        remote.download(server.url("b/blob.bin"), str(tmp_path / "blob.bin"))
    assert server.requests == []
    for env in (remote.MIN_RATE_ENV, remote.DEADLINE_ENV):
        monkeypatch.setenv(remote.TIMEOUT_ENV, "30")
        monkeypatch.setenv(env, "inf")
        with pytest.raises(ValueError, match=f"{env} must be a finite number"):
            remote.download(server.url("b/blob.bin"), str(tmp_path / "blob.bin"))
        monkeypatch.delenv(env)


# ----------------------------------------------------------------------
# Another object of the same size.
# ----------------------------------------------------------------------


def _replace(server, data, etag=None, modified=None):
    """Replaces b/blob.bin by other bytes of the same size."""
    replacement = bytes(255 - b for b in data[:1000]) + data[1000:]
    with open(os.path.join(server.root, "b", "blob.bin"), "wb") as file:
        file.write(replacement)
    if etag:
        server.etags["b/blob.bin"] = etag
    if modified:
        server.modified["b/blob.bin"] = modified
    return replacement


@pytest.mark.parametrize("header", ["etags", "modified"])
def test_a_partial_file_of_a_replaced_object_is_not_continued(
        served, tmp_path, monkeypatch, header):
    server, data = served
    first, second = (('"v1"', '"v2"') if header == "etags" else
                     ("Mon, 01 Jan 2024 00:00:00 GMT", "Tue, 02 Jan 2024 00:00:00 GMT"))
    getattr(server, header)["b/blob.bin"] = first
    url = server.url("b/blob.bin")
    target = tmp_path / "out" / "blob.bin"
    # An interrupted download leaves its partial file (as a killed one does).
    server.cuts["b/blob.bin"] = 300_000
    monkeypatch.setattr(remote, "RETRIES", 0)
    with pytest.raises(remote.RemoteError, match="run again to resume"):
        remote.download(url, str(target))
    assert [p.stat().st_size for p in target.parent.glob(".blob.bin.*.part")] == [300_000]
    # The object is replaced by another of the same size; the server sends no MD5.
    del server.cuts["b/blob.bin"]
    replacement = _replace(server, data, **{header[:-1] if header == "etags" else
                                            header: second})
    remote.download(url, str(target))
    assert target.read_bytes() == replacement
    assert os.listdir(target.parent) == ["blob.bin"]
    assert ("GET", "b/blob.bin", "bytes=0-") == server.requests[-1]


def test_an_object_replaced_during_a_download_is_an_error(served, tmp_path):
    server, data = served
    server.etags["b/blob.bin"] = '"v1"'
    server.drops["b/blob.bin"] = 300_000
    server.after_get["b/blob.bin"] = lambda s: _replace(s, data, etag='"v2"')
    with pytest.raises(remote.RemoteChangedError,
                       match=r"blob.bin: the object changed while being read "
                             r"\(ETag: \"v1\", now \"v2\""):
        remote.download(server.url("b/blob.bin"), str(tmp_path / "blob.bin"))
    assert not (tmp_path / "blob.bin").exists()


@pytest.mark.parametrize("extra", [1000, -1000])
def test_an_npz_whose_head_size_is_wrong_says_the_sizes_disagree(tmp_path, extra):
    from keras_vmoe.formats import vit_npz

    (tmp_path / "b").mkdir()
    vit_npz.save(str(tmp_path / "b" / "ViT.npz"), {"head/kernel": np.ones((500, 2), "f4")})
    actual = (tmp_path / "b" / "ViT.npz").stat().st_size
    with Server(tmp_path) as server:
        server.sizes["b/ViT.npz"] = actual + extra
        with pytest.raises(P.CheckpointError) as info:
            vit_npz.load(server.url("b/ViT.npz"))
    message = str(info.value)
    assert "not a zip file" not in message
    assert "the sizes disagree" in message
    assert f"{actual + extra:,} bytes when the read started" in message
    assert f"gives {actual:,} bytes" in message


# ----------------------------------------------------------------------
# Credentials in a mirror's URL.
# ----------------------------------------------------------------------

PASSWORD = "s3cret-pw"


def _texts(error):
    """The messages of an error and of the errors behind it."""
    texts = []
    while error is not None:
        texts.append(f"{type(error).__name__}: {error}")
        error = error.__cause__ or error.__context__
    return "\n".join(texts)


def test_credentials_are_sent_and_never_shown(served, tmp_path, monkeypatch, caplog):
    import logging

    from keras_vmoe.formats import vit_npz

    caplog.set_level(logging.DEBUG)
    server, data = served
    server.auth = ("me", PASSWORD)
    base = server.base.replace("http://", f"http://me:{PASSWORD}@")
    # The credentials are sent (HTTP Basic): the download works.
    remote.download(f"{base}/b/blob.bin?token={PASSWORD}", str(tmp_path / "ok.bin"))
    assert (tmp_path / "ok.bin").read_bytes() == data
    monkeypatch.setenv(remote.TIMEOUT_ENV, "0.3")
    monkeypatch.setattr(remote, "RETRIES", 0)
    server.sizes["b/other.bin"] = 5
    (tmp_path / "bucket" / "b" / "other.bin").write_bytes(b"x" * 10)
    failures = {
        "not found": lambda: remote.download(f"{base}/b/none.bin", str(tmp_path / "n")),
        "refused": lambda: remote.download(
            f"http://me:{PASSWORD}@127.0.0.1:9/b/o", str(tmp_path / "r")),
        "sizes": lambda: remote.open_range(f"{base}/b/other.bin").read(),
        "wrong password": lambda: remote.remote_stat(
            base.replace(PASSWORD, PASSWORD[::-1]) + "/b/blob.bin"),
        "npz": lambda: vit_npz.load(f"{base}/b/none.npz"),
        "bad base": lambda: remote.public_url("gs://b/o", f"ftp://me:{PASSWORD}@x"),
    }
    server.stalls.add("b/stall.bin")
    (tmp_path / "bucket" / "b" / "stall.bin").write_bytes(b"y" * 10)
    failures["stall"] = lambda: remote.download(f"{base}/b/stall.bin", str(tmp_path / "s"))
    for name, fail in failures.items():
        with pytest.raises((OSError, ValueError)) as info:
            fail()
        text = _texts(info.value)
        assert PASSWORD not in text and PASSWORD[::-1] not in text, (name, text)
        assert "***@" in text or name == "npz" and "***" in text, (name, text)
    assert PASSWORD not in caplog.text
