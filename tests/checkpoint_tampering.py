"""Tampered copies of the upstream fixture checkpoints, for the reader and
converter tests (tests/checkpoints/test_partitioned.py, test_convert.py)."""

import dataclasses
import shutil

from keras_vmoe.cli import convert_cmd
from keras_vmoe.formats import partitioned as P

HEAD = "head/kernel"
BOMB_SHAPE = (48, 10**8)  # 19.2 GB of float32, declared in a ~7 KB index.


def copy_fixture(upstream_dir, tmp_path, name="vmoe_tiny"):
    """A writable copy of an upstream fixture checkpoint; returns its prefix."""
    for suffix in (".index", ".data-00000-of-00001"):
        shutil.copy(upstream_dir / name / f"checkpoint{suffix}", tmp_path / f"ckpt{suffix}")
    return str(tmp_path / "ckpt")


def tamper_index(prefix, leaf_path, shape):
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


def run_convert(argv, capsys):
    """`keras-vmoe convert argv`: `(exit code, stderr)`."""
    code = convert_cmd.run([str(a) for a in argv])
    return code, capsys.readouterr().err
