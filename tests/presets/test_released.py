"""Released weights downloaded over HTTP from a server on 127.0.0.1.

The server holds the tiny V-MoE upstream fixture in the bucket's layout
(`<base>/vmoe_checkpoints/<released name>.index`, `.data-*`) and
`$KERAS_VMOE_CHECKPOINT_ROOT` points at it.
"""

import os
import shutil
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
from http_server import Server

from keras_vmoe import presets
from keras_vmoe.formats import remote

LIGHT1 = "vmoe_s32_last2_ilsvrc2012_randaug_light1"
DATA = f"vmoe_checkpoints/{LIGHT1}.data-00000-of-00001"
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_CHILD = f"""
from keras_vmoe import presets
presets.from_preset({LIGHT1!r}, verbose=0)
"""


@pytest.fixture
def bucket(tmp_path, upstream_dir):
    served = tmp_path / "served"
    (served / "vmoe_checkpoints").mkdir(parents=True)
    for suffix in (".index", ".data-00000-of-00001"):
        shutil.copy(upstream_dir / "vmoe_tiny" / f"checkpoint{suffix}",
                    served / "vmoe_checkpoints" / f"{LIGHT1}{suffix}")
    return served


def _check_logits(model, upstream_dir):
    fixture = upstream_dir / "vmoe_tiny"
    logits = np.asarray(model.predict(np.load(fixture / "inputs.npy"), verbose=0))
    np.testing.assert_allclose(
        logits, np.load(fixture / "logits_bf16dispatch.npy"), atol=1e-4)


@pytest.mark.heavy
def test_download_killed_then_resumed_dropped_then_resumed_and_converted(
        isolated_cache, bucket, monkeypatch, upstream_dir, capsys):
    with Server(bucket) as server:
        monkeypatch.setenv("KERAS_VMOE_CHECKPOINT_ROOT", server.base)
        # 1. A process downloading on a slow link is killed half-way.
        server.delay = 0.3
        env = dict(os.environ, PYTHONPATH=ROOT, KERAS_BACKEND="jax")
        child = subprocess.Popen([sys.executable, "-c", _CHILD], env=env)
        downloads = isolated_cache / "keras_vmoe" / ".downloads" / "vmoe_checkpoints"
        partial = downloads / f".{LIGHT1}.data-00000-of-00001.584835.part"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not (
                partial.exists() and partial.stat().st_size > 0):
            time.sleep(0.05)
        child.kill()
        child.wait()
        have = partial.stat().st_size
        assert 0 < have < 584835
        assert not (isolated_cache / "keras_vmoe" / LIGHT1).exists()
        # 2. The rerun continues from the partial file; its connection drops
        # once more and resumes again; progress is shown.
        server.delay = 0.0
        server.drops[DATA] = 100_000
        server.requests.clear()
        model = presets.from_preset(LIGHT1, verbose=1, capacity_factor=1.0,
                                    group_size=34)
    ranges = [r for m, p, r in server.requests if p == DATA and m == "GET"]
    assert ranges == [f"bytes={have}-", f"bytes={have + 100_000}-"]
    out = capsys.readouterr().out
    assert f"Downloading gs://vmoe_checkpoints/{LIGHT1}" in out
    assert "588705/588705" in out and "MB/s" in out
    assert f"Converting gs://vmoe_checkpoints/{LIGHT1} to the preset" in out
    _check_logits(model, upstream_dir)
    # The preset is cached; the downloaded files are gone.
    assert (isolated_cache / "keras_vmoe" / LIGHT1 / "config.json").exists()
    assert os.listdir(isolated_cache / "keras_vmoe") == [LIGHT1]


def test_quiet_when_not_a_terminal(isolated_cache, bucket, monkeypatch, capsys):
    with Server(bucket) as server:
        monkeypatch.setenv("KERAS_VMOE_CHECKPOINT_ROOT", server.base)
        presets.from_preset(LIGHT1)  # verbose="auto"; pytest's stdout is no tty
    assert capsys.readouterr().out == ""
    with pytest.raises(ValueError, match="verbose='yes'"):
        presets.from_preset(LIGHT1, verbose="yes")


def test_missing_objects_are_reported(isolated_cache, tmp_path, monkeypatch):
    with Server(tmp_path) as server:
        monkeypatch.setenv("KERAS_VMOE_CHECKPOINT_ROOT", server.base + "/")
        with pytest.raises(presets.PresetWeightsUnavailableError) as info:
            presets.from_preset(LIGHT1)
    message = str(info.value)
    assert f"{server.base}/vmoe_checkpoints/{LIGHT1}.index: not found (HTTP 404" in message
    assert message.endswith("load_weights=False to build the architecture with "
                            "random weights.")


def test_a_changed_object_is_reported(isolated_cache, bucket, monkeypatch):
    with Server(bucket) as server:
        server.sizes[DATA] = 10  # HEAD and GET disagree
        monkeypatch.setenv("KERAS_VMOE_CHECKPOINT_ROOT", server.base)
        with pytest.raises(presets.PresetWeightsUnavailableError, match="sizes disagree"):
            presets.from_preset(LIGHT1)
    assert not (isolated_cache / "keras_vmoe" / LIGHT1).exists()


def test_a_stalled_server_times_out(isolated_cache, bucket, monkeypatch):
    monkeypatch.setenv(remote.TIMEOUT_ENV, "0.3")
    with Server(bucket) as server:
        server.stalls.add(DATA)
        monkeypatch.setenv("KERAS_VMOE_CHECKPOINT_ROOT", server.base)
        start = time.monotonic()
        with pytest.raises(presets.PresetWeightsUnavailableError,
                           match="the download failed.*stopped at byte 0"):
            presets.from_preset(LIGHT1)
    assert time.monotonic() - start < 10


def _offline_message(isolated_cache):
    start = time.monotonic()
    with pytest.raises(presets.PresetWeightsUnavailableError) as info:
        presets.from_preset(LIGHT1)
    assert time.monotonic() - start < 10
    return str(info.value)


def test_offline_answers_within_ten_seconds(isolated_cache, monkeypatch):
    # Connection refused (a closed port).
    message = _offline_message(isolated_cache)
    assert f"http://127.0.0.1:9/vmoe_checkpoints/{LIGHT1}" in message
    assert "no connection to the server" in message
    for needed in ("KERAS_VMOE_CHECKPOINT_ROOT", "hf://", "load_weights=False"):
        assert needed in message
    # No answer at all (an accept queue that is full drops the attempts, as
    # a host without a route does).
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    fillers = []
    try:
        for _ in range(4):
            filler = socket.socket()
            filler.setblocking(False)
            filler.connect_ex(listener.getsockname())
            fillers.append(filler)
        base = f"http://127.0.0.1:{listener.getsockname()[1]}"
        monkeypatch.setattr(remote, "GCS_BASE", base)
        message = _offline_message(isolated_cache)
    finally:
        for sock in [*fillers, listener]:
            sock.close()
    assert f"{base}/vmoe_checkpoints/{LIGHT1}" in message
    assert "no connection to the server" in message


def test_the_offline_error_has_no_chained_socket_traceback(isolated_cache):
    import traceback

    with pytest.raises(presets.PresetWeightsUnavailableError) as info:
        presets.from_preset(LIGHT1)
    # The cause (ConnectionRefusedError) is one line of the message.
    assert "ConnectionRefusedError" in str(info.value)
    assert info.value.__cause__ is None and info.value.__suppress_context__
    printed = "".join(traceback.format_exception(info.value))
    assert "During handling" not in printed and "direct cause" not in printed


def test_the_weights_check_downloads_nothing(isolated_cache, bucket, tmp_path,
                                             monkeypatch, tiny_preset_dir):
    from keras_vmoe.catalog import PRESETS
    from keras_vmoe.presets import released

    entry = PRESETS[LIGHT1]
    # Offline: the same message as `from_preset`'s, without a traceback chain.
    with pytest.raises(presets.PresetWeightsUnavailableError) as info:
        released.check_released_weights(LIGHT1, entry)
    assert "no connection to the server" in str(info.value)
    assert info.value.__cause__ is None and info.value.__suppress_context__
    # On the server: one HEAD request, nothing downloaded.
    with Server(bucket) as server:
        monkeypatch.setenv("KERAS_VMOE_CHECKPOINT_ROOT", server.base)
        released.check_released_weights(LIGHT1, entry)
    assert [m for m, _, _ in server.requests] == ["HEAD"]
    assert not (isolated_cache / "keras_vmoe").exists() or not os.listdir(
        isolated_cache / "keras_vmoe")
    # In a local mirror, or converted in the cache: no request at all.
    monkeypatch.setenv("KERAS_VMOE_CHECKPOINT_ROOT", str(bucket))
    released.check_released_weights(LIGHT1, entry)
    monkeypatch.setenv("KERAS_VMOE_CHECKPOINT_ROOT", str(tmp_path / "empty"))
    with pytest.raises(presets.PresetWeightsUnavailableError, match="does not hold"):
        released.check_released_weights(LIGHT1, entry)
    shutil.copytree(tiny_preset_dir, presets.preset_cache_dir(LIGHT1))
    released.check_released_weights(LIGHT1, entry)


def test_npz_weights_are_downloaded_then_converted(
        isolated_cache, tmp_path, monkeypatch, tiny_preset_dir):
    from keras_vmoe.presets import convert as module

    served = tmp_path / "served" / "vit_models" / "imagenet21k"
    served.mkdir(parents=True)
    (served / "ViT-B_16.npz").write_bytes(b"npz bytes")
    seen = []

    def convert(source, output_dir, preset_name=None):
        seen.append((open(source, "rb").read(), preset_name))
        shutil.copytree(tiny_preset_dir, output_dir)

    monkeypatch.setattr(module, "convert_vit_npz_to_preset", convert)
    with Server(tmp_path / "served") as server:
        monkeypatch.setattr(remote, "GCS_BASE", server.base)  # the public bucket
        presets.from_preset("vit_b16_imagenet21k", verbose=0)
    assert seen == [(b"npz bytes", "vit_b16_imagenet21k")]
    assert os.listdir(isolated_cache / "keras_vmoe") == ["vit_b16_imagenet21k"]


def test_unreadable_downloads_are_deleted(isolated_cache, bucket, monkeypatch):
    import hashlib

    index = bucket / "vmoe_checkpoints" / f"{LIGHT1}.index"
    data = bucket / DATA
    data.write_bytes(b"\0" * data.stat().st_size)  # right size, not msgpack
    with Server(bucket) as server:
        server.md5[f"vmoe_checkpoints/{LIGHT1}.index"] = hashlib.md5(
            index.read_bytes()).hexdigest()
        monkeypatch.setenv("KERAS_VMOE_CHECKPOINT_ROOT", server.base)
        with pytest.raises(ValueError, match="data-00000-of-00001"):
            presets.from_preset(LIGHT1)
    assert os.listdir(isolated_cache / "keras_vmoe") == []


def _rewrite_index(bucket, **changes):
    """Rewrites the served index with `changes` to its `CheckpointIndex` fields."""
    import dataclasses

    from keras_vmoe.formats import partitioned

    prefix = str(bucket / "vmoe_checkpoints" / LIGHT1)
    index = partitioned.read_index(prefix)
    partitioned._write_index(prefix, dataclasses.replace(index, **changes))


def test_an_index_declaring_too_many_shards_is_refused_before_any_request(
        isolated_cache, bucket, monkeypatch):
    _rewrite_index(bucket, shard_count=100_000)
    with Server(bucket) as server:
        monkeypatch.setenv("KERAS_VMOE_CHECKPOINT_ROOT", server.base)
        with pytest.raises(ValueError, match=r"bad shard_count 100,000: a checkpoint "
                                             r"has at most 16,384 data files"):
            presets.from_preset(LIGHT1)
    assert [p for _, p, _ in server.requests if ".data-" in p] == []


def test_only_the_shards_the_leaves_use_are_requested(isolated_cache, bucket, tmp_path):
    from keras_vmoe.catalog import PRESETS
    from keras_vmoe.presets import released

    # 5,000 declared data files; the leaves use the first only.
    _rewrite_index(bucket, shard_count=5000)
    os.rename(bucket / DATA, bucket / DATA.replace("-of-00001", "-of-05000"))
    with Server(bucket) as server:
        source = released._download_released(
            PRESETS[LIGHT1]["weights"], server.base, str(tmp_path / "downloads"), 0)
    requested = [(m, p) for m, p, _ in server.requests if ".data-" in p]
    assert requested == [("HEAD", DATA.replace("-of-00001", "-of-05000")),
                         ("GET", DATA.replace("-of-00001", "-of-05000"))]
    assert os.path.exists(source + ".data-00000-of-05000")


def test_a_mirrors_credentials_are_never_shown(isolated_cache, bucket, monkeypatch,
                                               caplog, capsys):
    import logging

    caplog.set_level(logging.DEBUG)
    password = "s3cret-pw"
    with Server(bucket) as server:
        server.auth = ("me", password)
        base = server.base.replace("http://", f"http://me:{password}@")
        monkeypatch.setenv("KERAS_VMOE_CHECKPOINT_ROOT", base + "/missing")
        with pytest.raises(presets.PresetWeightsUnavailableError) as info:
            presets.from_preset(LIGHT1, verbose=1)
        server.stalls.add(DATA)
        monkeypatch.setenv(remote.TIMEOUT_ENV, "0.3")
        monkeypatch.setattr(remote, "RETRIES", 0)
        monkeypatch.setenv("KERAS_VMOE_CHECKPOINT_ROOT", base)
        with pytest.raises(presets.PresetWeightsUnavailableError) as stalled:
            presets.from_preset(LIGHT1, verbose=1)
    for error in (info.value, stalled.value):
        text = str(error) + str(error.__cause__)
        assert password not in text and "http://***@127.0.0.1" in text
    assert "stopped at byte 0" in str(stalled.value)
    out = capsys.readouterr()
    assert password not in caplog.text + out.out + out.err
