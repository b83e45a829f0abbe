"""The checkpoint store against hostile folders and tampered checkpoint files.

FIFOs are real (`os.mkfifo`); every call that could block runs under an
alarm, so a regression fails instead of hanging. The zip bomb is a real
8 GiB member of deflated zeros, read in a child process under an
address-space limit (`faults`).
"""

import json
import os
import subprocess
import sys
import zipfile

import numpy as np
import pytest

from keras_vmoe.training import checkpoints
from keras_vmoe.training.checkpoints import CheckpointError
from keras_vmoe.training.checkpoints import CheckpointStore

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LIMITS = {"model/00000": 4096 * 4}


from testing import deadline as _deadline  # noqa: E402


def _save(store, step, value, **meta):
    return store.save({"model/00000": np.full((4096,), value, "float32")},
                      {"global_step": step, "epoch": step, "step": 0, **meta})


def _rewrite(path, arrays=None, meta_update=None, dtypes=None):
    """Rewrites a checkpoint with changed arrays or record, checksums kept valid."""
    with np.load(path) as data:
        stored = {k: data[k] for k in data.files}
    meta = json.loads(bytes(stored.pop(checkpoints.META_KEY)).decode())
    for key, value in (arrays or {}).items():
        if value is None:
            stored.pop(key)
            continue
        stored[key] = value
        meta["checksums"][key] = checkpoints._checksum(value)
        meta["dtypes"][key] = str(value.dtype)
    meta["dtypes"].update(dtypes or {})
    meta.update(meta_update or {})
    stored[checkpoints.META_KEY] = np.frombuffer(json.dumps(meta).encode(), np.uint8)
    np.savez(path, **stored)
    # The index's SHA-256 would catch the edit: forget it (a lost index).
    os.remove(os.path.join(os.path.dirname(path), checkpoints.POINTER))


def test_clear_removes_only_the_files_the_index_lists(tmp_path):
    store = CheckpointStore(tmp_path)
    _save(store, 1, 1.0)
    _save(store, 2, 2.0)
    foreign = tmp_path / "ckpt-0000000099.npz"
    foreign.write_bytes(b"the user's file")
    notes = tmp_path / "notes.txt"
    notes.write_text("mine")
    store.clear()
    assert sorted(os.listdir(tmp_path)) == ["ckpt-0000000099.npz", "notes.txt"]
    assert foreign.read_bytes() == b"the user's file"


def test_a_fifo_as_the_index_is_refused_naming_it(tmp_path):
    os.mkfifo(tmp_path / checkpoints.POINTER)
    with _deadline(), pytest.raises(CheckpointError, match="checkpoint.json is not a "
                                    "regular file"):
        CheckpointStore(tmp_path).load()


def test_a_directory_as_the_index_is_refused_naming_it(tmp_path):
    os.mkdir(tmp_path / checkpoints.POINTER)
    with pytest.raises(CheckpointError, match="checkpoint.json is a directory"):
        CheckpointStore(tmp_path).load()


def test_a_fifo_or_dev_zero_as_a_listed_checkpoint_falls_back(tmp_path, capsys):
    store = CheckpointStore(tmp_path)
    _save(store, 1, 1.0)
    newest = _save(store, 2, 2.0)
    os.remove(newest)
    os.mkfifo(newest)
    with _deadline():
        arrays, meta, _ = store.load(limits=LIMITS)
    assert meta["global_step"] == 1
    assert f"checkpoint {newest} is damaged" in capsys.readouterr().err
    os.remove(newest)
    os.symlink("/dev/zero", newest)
    with _deadline():
        assert store.load(limits=LIMITS)[1]["global_step"] == 1
    assert "not a regular file" in capsys.readouterr().err


@pytest.mark.parametrize("arrays, dtypes, reason", [
    ({"model/00000": np.full((4096,), np.nan, "float32")}, None, "NaN or infinite"),
    ({"model/00000": np.ones((2048,), "complex64")}, None, "complex64"),
    ({"model/00000": None}, None, "missing"),
    ({}, {"model/00000": "object"}, "unsupported stored dtype"),
])
def test_non_finite_complex_and_missing_arrays_are_damaged(tmp_path, capsys, arrays,
                                                           dtypes, reason):
    store = CheckpointStore(tmp_path)
    _save(store, 1, 1.0)
    newest = _save(store, 2, 2.0)
    _rewrite(newest, arrays, dtypes=dtypes)
    assert store.load(limits=LIMITS)[1]["global_step"] == 1
    err = capsys.readouterr().err
    assert f"checkpoint {newest} is damaged" in err and reason in err


@pytest.mark.parametrize("update, reason", [
    ({"epoch": -1}, "'epoch' is -1"),
    ({"step": "3"}, "'step' is '3'"),
    ({"global_step": 1.5}, "'global_step' is 1.5"),
    ({"steps_per_epoch": 4, "step": 9}, "do not fit"),
    ({"history": "lots"}, "'history' is a str"),
    ({"history": [{"loss": "low"}]}, "history is not a list of numbers"),
    ({"layout": {"model": [["w", [-4]]]}}, "layout of 'model' is malformed"),
    ({"fit_seconds": float("nan")}, "'fit_seconds'"),
])
def test_malformed_records_are_damaged_naming_the_file(tmp_path, update, reason):
    store = CheckpointStore(tmp_path)
    only = _save(store, 2, 2.0)
    _rewrite(only, meta_update=update)
    with pytest.raises(CheckpointError) as error:
        store.load(limits=LIMITS)
    assert only in str(error.value) and reason in str(error.value)


def test_a_deeply_nested_record_is_damaged(tmp_path):
    store = CheckpointStore(tmp_path)
    only = _save(store, 2, 2.0)
    with np.load(only) as data:
        stored = {k: data[k] for k in data.files}
    meta = json.loads(bytes(stored[checkpoints.META_KEY]).decode())
    text = json.dumps(meta)[:-1] + ', "deep": ' + "[" * 100_000 + "]" * 100_000 + "}"
    stored[checkpoints.META_KEY] = np.frombuffer(text.encode(), np.uint8)
    np.savez(only, **stored)
    os.remove(tmp_path / checkpoints.POINTER)
    with pytest.raises(CheckpointError, match="nested too deeply"):
        store.load()


def test_an_array_larger_than_its_variable_is_refused_before_reading(tmp_path):
    store = CheckpointStore(tmp_path)
    only = _save(store, 2, 2.0)
    with pytest.raises(CheckpointError, match=r"more than the 1024 of the variable"):
        store.load(limits={"model/00000": 1024})
    with pytest.raises(CheckpointError, match="not a variable of this model"):
        store.load(limits={"model/00001": 4096 * 4})
    assert os.path.exists(only)


def test_malformed_index_entries_are_ignored(tmp_path, capsys):
    store = CheckpointStore(tmp_path)
    _save(store, 1, 1.0)
    index = tmp_path / checkpoints.POINTER
    record = json.loads(index.read_text())
    record["checkpoints"] += [{"file": "../../etc/passwd"}, {"file": 7},
                              {"file": "ckpt-0000000001.npz", "sha256": ["x"]}]
    index.write_text(json.dumps(record))
    assert store.load()[1]["global_step"] == 1
    assert capsys.readouterr().err.count("malformed entry") == 3
    store.clear()
    assert not os.path.exists("../../etc/passwd") or os.path.exists("/etc/passwd")


_BOMB_CHILD = r"""
import resource, sys
from keras_vmoe.training.checkpoints import CheckpointStore, CheckpointError
with open("/proc/self/status") as f:
    vm = next(int(line.split()[1]) for line in f if line.startswith("VmSize")) * 1024
resource.setrlimit(resource.RLIMIT_AS, (vm + 2**30, vm + 2**30))
try:
    CheckpointStore(sys.argv[1]).load(limits={"model/00000": 4096 * 4})
except CheckpointError as error:
    print("REFUSED", error)
"""


@pytest.mark.faults  # writes an 8 GiB deflated member (~10 s) and starts a child
def test_a_zip_bomb_member_is_refused_under_a_memory_limit(tmp_path):
    store = CheckpointStore(tmp_path)
    path = _save(store, 1, 1.0)
    with np.load(path) as data:
        meta = data[checkpoints.META_KEY]
    os.remove(tmp_path / checkpoints.POINTER)
    size = 8 * 2**30
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED, compresslevel=1) as archive:
        with archive.open("model/00000.npy", "w", force_zip64=True) as member:
            np.lib.format.write_array_header_1_0(
                member, {"descr": "<f4", "fortran_order": False,
                         "shape": (size // 4,)})
            zeros = bytes(64 * 2**20)
            for _ in range(size // len(zeros)):
                member.write(zeros)
        with archive.open(checkpoints.META_KEY + ".npy", "w") as member:
            np.lib.format.write_array(member, meta)
    assert os.path.getsize(path) < 64 * 2**20
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    result = subprocess.run([sys.executable, "-c", _BOMB_CHILD, str(tmp_path)],
                            capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "REFUSED" in result.stdout and path in result.stdout
    assert "inflates to" in result.stdout or "more than the" in result.stdout


def test_starting_again_over_a_fifo_index_says_to_remove_it(tmp_path):
    os.mkfifo(tmp_path / checkpoints.POINTER)
    with _deadline(), pytest.raises(CheckpointError, match="is not a regular file.*remove it"):
        CheckpointStore(tmp_path).clear()


def test_one_checkpoint_error_for_upstream_and_training_checkpoints(tmp_path):
    from keras_vmoe import formats
    from keras_vmoe import training

    assert training.CheckpointError is formats.CheckpointError is CheckpointError
    prefix = tmp_path / "upstream_ckpt"
    (tmp_path / "upstream_ckpt.index").write_bytes(b"\x93 not msgpack")
    with pytest.raises(training.CheckpointError, match="upstream_ckpt.index"):
        formats.read_index(str(prefix))
    (tmp_path / "store").mkdir()
    (tmp_path / "store" / checkpoints.POINTER).mkdir()  # an index that is a folder
    with pytest.raises(training.CheckpointError, match="is a directory"):
        CheckpointStore(tmp_path / "store").load()
