"""Bad inputs to the checkpoint reader and `keras-vmoe convert`.

Tampered indexes, files replaced by directories, bad flags and missing
optional dependencies must give one clear error naming the file and the
problem, before any large allocation or model build.
"""

import dataclasses
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

import keras_vmoe
from keras_vmoe.checkpoints import convert
from keras_vmoe.conversion import build as conversion_build
from keras_vmoe.formats import partitioned as P

HEAD = "head/kernel"
BOMB_SHAPE = (48, 10**8)  # 19.2 GB of float32, declared in a ~7 KB index.


def _copy_fixture(upstream_dir, tmp_path, name="vmoe_tiny"):
    """A writable copy of an upstream fixture checkpoint; returns its prefix."""
    for suffix in (".index", ".data-00000-of-00001"):
        shutil.copy(upstream_dir / name / f"checkpoint{suffix}", tmp_path / f"ckpt{suffix}")
    return str(tmp_path / "ckpt")


def _tamper_index(prefix, leaf_path, shape):
    """Rewrites the index so that `leaf_path` declares `shape` (one chunk)."""
    index = P.read_index(prefix)
    leaves = [
        dataclasses.replace(
            leaf, shape=shape, slices=[tuple((0, d) for d in shape)], shards=[0]
        )
        if leaf.path_str == leaf_path
        else leaf
        for leaf in index.leaves
    ]
    P._write_index(prefix, dataclasses.replace(index, leaves=leaves))


@pytest.fixture
def bomb_prefix(upstream_dir, tmp_path):
    prefix = _copy_fixture(upstream_dir, tmp_path)
    _tamper_index(prefix, HEAD, BOMB_SHAPE)
    return prefix


def _run_convert(argv, capsys):
    code = convert.main([str(a) for a in argv])
    return code, capsys.readouterr().err


# ----------------------------------------------------------------------
# Item 5: declared shapes are checked against the data files' sizes.
# ----------------------------------------------------------------------


def test_huge_declared_leaf_fails_before_allocating(bomb_prefix):
    """The reader runs with 2 GiB of address space: allocating the declared
    19.2 GB leaf (what the reader did before) dies with MemoryError."""
    script = textwrap.dedent(f"""
        import resource
        from keras_vmoe.formats import partitioned
        resource.setrlimit(resource.RLIMIT_AS, (2 * 2**30, 2 * 2**30))
        try:
            partitioned.restore_flat({bomb_prefix!r})
        except partitioned.CheckpointError as error:
            print("CheckpointError:", error)
    """)
    root = os.path.dirname(os.path.dirname(os.path.abspath(keras_vmoe.__file__)))
    env = dict(os.environ, PYTHONPATH=root, OPENBLAS_NUM_THREADS="1")
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env,
        timeout=120, cwd=os.path.dirname(bomb_prefix),
    )
    assert result.returncode == 0, result.stderr[-2000:]
    message = result.stdout
    assert message.startswith("CheckpointError:"), message
    assert HEAD in message and str(BOMB_SHAPE) in message
    assert "19200000000 bytes" in message  # declared
    size = os.path.getsize(P.shard_path(bomb_prefix, 0, 1))
    assert f"holds only {size} bytes" in message  # available


@pytest.mark.parametrize(
    "shape, expected",
    [(BOMB_SHAPE, "19200000000 bytes"), ((2**63, 2), "dimension larger than")],
    ids=["huge", "int64-overflow"],
)
def test_tampered_shape_is_a_checkpoint_error(bomb_prefix, shape, expected):
    _tamper_index(bomb_prefix, HEAD, shape)
    for read in (P.restore_flat, P.check_data_files, convert.read_upstream_shapes):
        with pytest.raises(P.CheckpointError, match=expected) as info:
            read(bomb_prefix)
        assert HEAD in str(info.value)


def test_convert_checks_sizes_before_building_the_model(
    bomb_prefix, tmp_path, monkeypatch, capsys
):
    def no_build(*args, **kwargs):
        raise AssertionError("the model was built from an unchecked index")

    monkeypatch.setattr(conversion_build, "_build_keras_model", no_build)
    with pytest.raises(P.CheckpointError, match="head/kernel"):
        convert.build_model_from_upstream(bomb_prefix)
    code, err = _run_convert(
        ["--upstream", bomb_prefix, "--output", tmp_path / "out"], capsys
    )
    assert code == 1
    assert err.startswith("error: ") and HEAD in err and "holds only" in err
    assert not (tmp_path / "out").exists()


def test_chunk_layout_too_large_for_its_shard(tmp_path):
    """Each leaf fits its file, but together they cannot."""
    import numpy as np

    prefix = str(tmp_path / "ckpt")
    P.save_checkpoint(prefix, {"a": np.zeros(64, "float32"), "b": np.zeros(64, "float32")})
    size = os.path.getsize(P.shard_path(prefix, 0, 1))
    n = size // 4 // 2 + 8  # each leaf alone < size, both > size
    index = P.read_index(prefix)
    leaves = [
        dataclasses.replace(leaf, shape=(n,), slices=[((0, n),)]) for leaf in index.leaves
    ]
    P._write_index(prefix, dataclasses.replace(index, leaves=leaves))
    with pytest.raises(P.CheckpointError, match=r"the 2 leaves .* need .* holds only"):
        P.restore_flat(prefix)


# ----------------------------------------------------------------------
# Item 8 (convert): --capacity-factor is validated at argument parsing.
# ----------------------------------------------------------------------


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "abc", "-1", "0"])
def test_convert_rejects_bad_capacity_factor(value, capsys):
    with pytest.raises(SystemExit) as info:
        convert.build_parser().parse_args(
            ["--upstream", "x", "--output", "y", f"--capacity-factor={value}"]
        )
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "--capacity-factor" in err and repr(value) in err


def test_convert_accepts_a_good_capacity_factor():
    args = convert.build_parser().parse_args(
        ["--upstream", "x", "--output", "y", "--capacity-factor", "1.25"]
    )
    assert args.capacity_factor == 1.25


# ----------------------------------------------------------------------
# Item 14: files that are directories, gs:// without TensorFlow.
# ----------------------------------------------------------------------


def _index_is_a_directory(prefix):
    os.remove(P.index_path(prefix))
    os.mkdir(P.index_path(prefix))
    return P.index_path(prefix), "is a directory"


def _shard_is_a_directory(prefix):
    path = P.shard_path(prefix, 0, 1)
    os.remove(path)
    os.mkdir(path)
    return path, "is a directory"


@pytest.mark.parametrize(
    "damage", [_index_is_a_directory, _shard_is_a_directory], ids=["index", "shard"]
)
def test_directory_in_place_of_a_checkpoint_file(
    upstream_dir, tmp_path, capsys, damage
):
    prefix = _copy_fixture(upstream_dir, tmp_path)
    path, problem = damage(prefix)
    with pytest.raises(P.CheckpointError, match=problem) as info:
        P.restore_flat(prefix)
    assert path in str(info.value)
    code, err = _run_convert(["--upstream", prefix, "--output", tmp_path / "out"], capsys)
    assert code == 1 and err.startswith("error: ") and path in err
    assert "Traceback" not in err


def test_gs_without_tensorflow_is_a_cli_error(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "tensorflow", None)
    source = "gs://vmoe_checkpoints/vmoe_s32"
    code, err = _run_convert(["--upstream", source, "--output", tmp_path / "out"], capsys)
    assert code == 1
    # Read over HTTPS as a public object (a closed port on 127.0.0.1 here).
    assert err.startswith("error: ") and "vmoe_checkpoints/vmoe_s32.index" in err
    assert "Cannot connect" in err
