"""Tests for keras_vmoe.formats.partitioned (vmoe's partitioned format)."""

import dataclasses
import os
import re
import shutil
import subprocess
import sys
import textwrap
import tracemalloc
import types
from pathlib import Path

import ml_dtypes
import msgpack
import numpy as np
import pytest
from checkpoint_tampering import BOMB_SHAPE
from checkpoint_tampering import HEAD
from checkpoint_tampering import copy_fixture as _copy_fixture
from checkpoint_tampering import run_convert as _run_convert
from checkpoint_tampering import tamper_index as _tamper_index

import keras_vmoe
from keras_vmoe.formats import partitioned as P
from keras_vmoe.formats import read_upstream_shapes

FIXTURES = ("vmoe_tiny", "vmoe_tiny_ec", "eee_tiny", "softmoe_tiny")
DATA_DIR = Path(__file__).resolve().parent.parent / "data" / "upstream_vmoe"
EXPERT_KERNEL = "Encoder/encoderblock_10/Moe/Mlp/Dense_0/kernel"
EXPERT_BIAS = "Encoder/encoderblock_10/Moe/Mlp/Dense_0/bias"
_PARAMS_LINE = re.compile(r"^\s*(\d+)\s+(\S+)\s+(\(.*\))\s+(\S+)\s+(\d+)\s*$")


# ---------------------------------------------------------------- helpers ---


def fixture_prefix(name: str) -> str:
    """Checkpoint prefix of a fixture written by the real upstream writer."""
    prefix = DATA_DIR / name / "checkpoint"
    if not Path(f"{prefix}.index").exists():
        pytest.skip(f"fixture {name} not found in {DATA_DIR}")
    return str(prefix)


def parse_params(name: str) -> list[tuple[int, str, tuple[int, ...], str]]:
    """Parses params.txt: (leaf_id, path, shape, dtype) per line."""
    rows = []
    for line in (DATA_DIR / name / "params.txt").read_text().splitlines():
        if line.startswith("#") or not line.strip():
            continue
        match = _PARAMS_LINE.match(line)
        assert match, line
        leaf_id, path, shape, dtype, _ = match.groups()
        dims = tuple(int(d) for d in shape.strip("()").split(",") if d.strip())
        rows.append((int(leaf_id), path, dims, dtype))
    return rows


def assert_same(actual: np.ndarray, expected: np.ndarray) -> None:
    expected = np.asarray(expected)
    assert isinstance(actual, np.ndarray)
    assert actual.dtype == expected.dtype
    assert actual.shape == expected.shape
    assert (
        np.ascontiguousarray(actual).tobytes()
        == np.ascontiguousarray(expected).tobytes()
    )


def flatten(tree, prefix=()):
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(flatten(value, (*prefix, key)))
        else:
            out["/".join((*prefix, key))] = np.asarray(value)
    return out


def example_tree(seed: int = 0) -> dict:
    """Tree with sort-order traps, expert arrays, bfloat16, scalars, empty."""
    rng = np.random.default_rng(seed)
    e, d, m = 4, 6, 10
    return {
        "Encoder": {
            "encoderblock_10": {
                "Moe": {
                    "Mlp": {
                        "Dense_0": {
                            "kernel": rng.standard_normal((e, d, m)).astype(np.float32),
                            "bias": rng.standard_normal((e, m)).astype(np.float32),
                        }
                    }
                }
            },
            "encoderblock_2": {"Moe": {"Router": {"scale": np.array(1.5, np.float32)}}},
            "encoder_norm": {
                "scale": rng.standard_normal(d).astype(ml_dtypes.bfloat16)
            },
        },
        "Zed": {"x": np.arange(3, dtype=np.int32)},
        "cls": rng.standard_normal((1, 1, d)).astype(ml_dtypes.bfloat16),
        "head": {
            "kernel": rng.standard_normal((d, 7)).astype(np.float32),
            "bias": rng.standard_normal(7).astype(np.float32),
        },
        "mask": np.array([True, False, True, True, False]),
        "step": np.array(7, np.int64),
        "temp": np.array(0.25, ml_dtypes.bfloat16),
        "empty": np.zeros((0, 3), np.float32),
    }


EXPECTED_ORDER = [
    "Encoder/encoder_norm/scale",
    EXPERT_BIAS,
    EXPERT_KERNEL,
    "Encoder/encoderblock_2/Moe/Router/scale",
    "Zed/x",
    "cls",
    "empty",
    "head/bias",
    "head/kernel",
    "mask",
    "step",
    "temp",
]

CHUNK_SLICES = {
    # Expert-sliced (E, D, M): one chunk per expert.
    EXPERT_KERNEL: [[(i, i + 1), (0, 6), (0, 10)] for i in range(4)],
    # Arbitrary slices, not all along the leading axis.
    EXPERT_BIAS: [[(0, 2), (0, 10)], [(2, 4), (0, 5)], [(2, 4), (5, 10)]],
    "head/kernel": [[slice(None), slice(0, 3)], [slice(None), slice(3, None)]],
    "Encoder/encoder_norm/scale": [[(0, 3)], [(3, 6)]],
}


def write_example(
    tmp_path: Path, num_shards: int = 1, version=P.VERSION_V1, **kwargs
) -> tuple[str, dict]:
    prefix = str(tmp_path / "ckpt")
    tree = example_tree()
    P.save_checkpoint(
        prefix,
        tree,
        num_shards=num_shards,
        version=version,
        chunk_slices=CHUNK_SLICES,
        **kwargs,
    )
    return prefix, tree


def pack_data_file(path: str, entries: dict, magic: bool = True) -> None:
    """Writes a data shard by hand: {leaf_key: [(sub-chunk arrays, box), ...]}."""
    document = {P.MAGIC_KEY: True} if magic else {}
    for key, chunks in entries.items():
        document[key] = [
            [
                [P._ndarray_ext(np.asarray(p)) for p in parts],
                msgpack.ExtType(6, P._slice_nd_payload(box)),
            ]
            for parts, box in chunks
        ]
    with open(path, "wb") as file:
        file.write(msgpack.packb(document, use_bin_type=True, strict_types=True))


def rewrite_shard(
    prefix: str, tree: dict, shard: int, keep=lambda leaf, box: True
) -> None:
    """Rewrites one shard from the index, keeping only the chunks `keep` accepts."""
    index = P.read_index(prefix)
    arrays = flatten(tree)
    entries = []
    for leaf in index.leaves:
        chunks = [
            (box, arrays[leaf.path_str])
            for box, s in zip(leaf.slices, leaf.shards, strict=True)
            if s == shard and keep(leaf, box)
        ]
        if chunks:
            entries.append((leaf.leaf_id, chunks))
    P._write_shard(P.shard_path(prefix, shard, index.shard_count), entries)


def edit_index(prefix: str, edit) -> None:
    """Rewrites the index with `edit(leaf) -> LeafInfo` applied to every leaf."""
    index = P.read_index(prefix)
    leaves = [edit(leaf) for leaf in index.leaves]
    P._write_index(prefix, P.CheckpointIndex(index.version, index.shard_count, leaves))


def with_leaf(path: str, **changes):
    def edit(leaf: P.LeafInfo) -> P.LeafInfo:
        return dataclasses.replace(leaf, **changes) if leaf.path_str == path else leaf

    return edit


# ------------------------------------------------------- real fixtures ------


@pytest.mark.parametrize("name", FIXTURES)
def test_fixture_index_matches_params_txt(name):
    index = P.read_index(fixture_prefix(name))
    expected = parse_params(name)
    assert index.version == P.VERSION_V1
    assert index.shard_count == 1
    got = [
        (leaf.leaf_id, leaf.path_str, leaf.shape, leaf.dtype.name)
        for leaf in index.leaves
    ]
    assert got == expected
    assert [leaf.leaf_id for leaf in index.leaves] == list(range(len(expected)))
    # Leaf ids follow the depth-first walk with sorted keys.
    paths = [leaf.path for leaf in index.leaves]
    assert paths == sorted(paths)
    for leaf in index.leaves:
        assert leaf.shards == [0]
        assert leaf.slices == [tuple((0, d) for d in leaf.shape)]


@pytest.mark.parametrize("name", FIXTURES)
def test_fixture_restore(name):
    prefix = fixture_prefix(name)
    expected = parse_params(name)
    flat = P.restore_flat(prefix)
    assert [(p, a.shape, a.dtype.name) for p, a in flat.items()] == [
        (p, s, d) for _, p, s, d in expected
    ]
    for array in flat.values():
        assert array.flags.writeable
        assert np.all(np.isfinite(array)) and np.all(
            array != 0
        )  # Fixture params are all non-zero.
    streamed = list(P.iter_leaves(prefix))
    assert [p for p, _ in streamed] == list(flat)
    for path, array in streamed:
        assert_same(array, flat[path])
    tree = P.restore_checkpoint(prefix)
    assert flatten(tree).keys() == flat.keys()
    assert_same(
        tree["Encoder"]["encoder_norm"]["bias"], flat["Encoder/encoder_norm/bias"]
    )


@pytest.mark.parametrize("name", FIXTURES)
def test_rewriting_fixture_is_byte_identical(name, tmp_path):
    prefix = fixture_prefix(name)
    out = str(tmp_path / "checkpoint")
    P.save_checkpoint(out, P.restore_checkpoint(prefix))
    for suffix in (".index", ".data-00000-of-00001"):
        assert Path(out + suffix).read_bytes() == Path(prefix + suffix).read_bytes()
    assert sorted(os.listdir(tmp_path)) == [
        "checkpoint.data-00000-of-00001",
        "checkpoint.index",
    ]


def test_fixture_scalar_leaves():
    flat = P.restore_flat(fixture_prefix("softmoe_tiny"))
    scale = flat["Encoder/encoderblock_2/Moe/Router/scale"]
    assert scale.shape == () and scale.dtype == np.float32


def test_fixture_iter_leaves_subset():
    prefix = fixture_prefix("vmoe_tiny")
    wanted = ["head/kernel", ("Encoder", "encoder_norm", "bias")]
    got = dict(P.iter_leaves(prefix, paths=wanted))
    assert list(got) == ["Encoder/encoder_norm/bias", "head/kernel"]
    assert got["head/kernel"].shape == (48, 10)
    with pytest.raises(KeyError, match="no/such/leaf"):
        P.iter_leaves(prefix, paths=["no/such/leaf"])


# ----------------------------------------------------------- round trip -----


@pytest.mark.parametrize("num_shards", [1, 3])
@pytest.mark.parametrize("version", [P.VERSION_V1, None])
def test_round_trip(tmp_path, num_shards, version):
    prefix, tree = write_example(tmp_path, num_shards=num_shards, version=version)
    files = sorted(os.listdir(tmp_path))
    assert files == [
        f"ckpt.data-{i:05d}-of-{num_shards:05d}" for i in range(num_shards)
    ] + ["ckpt.index"]
    document = msgpack.unpackb(
        Path(prefix + ".index").read_bytes(), strict_map_key=False
    )
    assert ("version" in document) == (version is not None)

    index = P.read_index(prefix)
    assert index.version == version and index.shard_count == num_shards
    assert index.paths == EXPECTED_ORDER
    kernel = index.leaf(EXPERT_KERNEL)
    assert kernel.slices == [((i, i + 1), (0, 6), (0, 10)) for i in range(4)]
    assert kernel.shards == [s % num_shards for s in kernel.shards]
    if num_shards == 3:
        assert len(set(kernel.shards)) == 3  # Spread over every shard.

    expected = flatten(tree)
    flat = P.restore_flat(prefix)
    assert list(flat) == EXPECTED_ORDER
    for path in EXPECTED_ORDER:
        assert_same(flat[path], expected[path])
    restored = P.restore_checkpoint(prefix)
    assert restored["temp"].dtype == ml_dtypes.bfloat16 and restored["temp"].shape == ()
    assert_same(
        restored["Encoder"]["encoderblock_2"]["Moe"]["Router"]["scale"],
        np.array(1.5, np.float32),
    )


def test_save_returns_the_index_it_wrote(tmp_path):
    prefix = str(tmp_path / "ckpt")
    written = P.save_checkpoint(
        prefix, example_tree(), num_shards=2, chunk_slices=CHUNK_SLICES
    )
    assert written == P.read_index(prefix)


def test_iter_leaves_yields_every_leaf_once(tmp_path):
    prefix, tree = write_example(tmp_path, num_shards=3)
    seen = [path for path, _ in P.iter_leaves(prefix)]
    assert sorted(seen) == sorted(EXPECTED_ORDER) and len(seen) == len(set(seen))


def test_leaf_spread_over_shards_in_any_order(tmp_path):
    prefix = str(tmp_path / "ckpt")
    tree = example_tree()
    shards = {EXPERT_KERNEL: [2, 0, 1, 2], EXPERT_BIAS: [1, 1, 0]}
    P.save_checkpoint(
        prefix, tree, num_shards=3, chunk_slices=CHUNK_SLICES, chunk_shards=shards
    )
    assert P.read_index(prefix).leaf(EXPERT_KERNEL).shards == [2, 0, 1, 2]
    flat = P.restore_flat(prefix)
    assert_same(
        flat[EXPERT_KERNEL],
        tree["Encoder"]["encoderblock_10"]["Moe"]["Mlp"]["Dense_0"]["kernel"],
    )


def test_iter_leaves_opens_only_needed_shards(tmp_path):
    prefix = str(tmp_path / "ckpt")
    tree = {"a": np.arange(4.0), "b": np.arange(3.0)}
    P.save_checkpoint(prefix, tree, num_shards=2)  # a -> shard 0, b -> shard 1.
    os.remove(P.shard_path(prefix, 1, 2))
    assert_same(dict(P.iter_leaves(prefix, paths=["a"]))["a"], tree["a"])
    with pytest.raises(P.CheckpointError, match="data-00001-of-00002"):
        P.iter_leaves(prefix)


def test_max_chunk_bytes_splits_along_leading_axis(tmp_path):
    prefix = str(tmp_path / "ckpt")
    array = np.arange(10 * 3, dtype=np.float32).reshape(10, 3)
    P.save_checkpoint(prefix, {"w": array}, num_shards=2, max_chunk_bytes=40)
    leaf = P.read_index(prefix).leaf("w")
    assert len(leaf.slices) == 3 and leaf.shards == [0, 1, 0]
    assert [box[0] for box in leaf.slices] == [(0, 3), (3, 7), (7, 10)]
    assert_same(P.restore_flat(prefix)["w"], array)


def test_small_subchunks_are_concatenated(tmp_path, monkeypatch):
    monkeypatch.setattr(
        P, "MAX_SUBCHUNK_BYTES", 12
    )  # 3 float32 / 6 bfloat16 per sub-chunk.
    prefix, tree = write_example(tmp_path, num_shards=2)
    expected = flatten(tree)
    for path, array in P.iter_leaves(prefix):
        assert_same(array, expected[path])
    # The data really holds several sub-chunks per chunk.
    document = msgpack.unpackb(Path(P.shard_path(prefix, 0, 2)).read_bytes())
    assert (
        max(
            len(chunk[0])
            for key, value in document.items()
            if key != P.MAGIC_KEY
            for chunk in value
        )
        > 3
    )


def test_numpy_scalar_ext_and_str_payload_are_decoded(tmp_path):
    prefix = str(tmp_path / "ckpt")
    P.save_checkpoint(
        prefix, {"s": np.array(3.5, np.float32), "v": np.arange(2, dtype=np.int16)}
    )
    scalar_ext = P._ndarray_ext(np.array(3.5, np.float32))
    assert scalar_ext.code == 3
    # Payload written with the old str type for the raw bytes (takes the slow path).
    v = np.array([7, -1], np.int16)
    legacy_payload = msgpack.packb([[2], "int16", v.tobytes()], use_bin_type=False)
    document = {
        P.MAGIC_KEY: True,
        "0": [[[scalar_ext], msgpack.ExtType(6, b"\x90")]],
        "1": [
            [
                [msgpack.ExtType(1, legacy_payload)],
                msgpack.ExtType(6, P._slice_nd_payload(((0, 2),))),
            ]
        ],
    }
    Path(P.shard_path(prefix, 0, 1)).write_bytes(
        msgpack.packb(document, use_bin_type=True)
    )
    flat = P.restore_flat(prefix)
    assert_same(flat["s"], np.array(3.5, np.float32))
    assert_same(flat["v"], v)


def test_covered_elements_counts_overlaps_once():
    shape = (4, 6)
    assert P._covered_elements(shape, [((0, 4), (0, 6))]) == 24
    assert P._covered_elements(shape, [((0, 2), (0, 6)), ((1, 3), (0, 6))]) == 18
    assert P._covered_elements(shape, [((0, 2), (0, 3)), ((2, 4), (3, 6))]) == 12
    assert P._covered_elements((), [()]) == 1 and P._covered_elements((), []) == 0
    assert P._covered_elements((0, 3), []) == 0


def test_writer_rejects_bad_chunk_slices(tmp_path):
    prefix = str(tmp_path / "ckpt")
    with pytest.raises(ValueError, match=r"w.*2 of its 6 elements are missing"):
        P.save_checkpoint(
            prefix, {"w": np.zeros((2, 3))}, chunk_slices={"w": [[(0, 2), (0, 2)]]}
        )
    with pytest.raises(ValueError, match="out of bounds"):
        P.save_checkpoint(
            prefix, {"w": np.zeros((2, 3))}, chunk_slices={"w": [[(0, 3), (0, 3)]]}
        )
    with pytest.raises(ValueError, match="unknown leaves"):
        P.save_checkpoint(prefix, {"w": np.zeros(2)}, chunk_slices={"x": [[(0, 2)]]})
    with pytest.raises(ValueError, match="Unsupported dtype"):
        P.save_checkpoint(prefix, {"w": np.array(["a"])})
    assert os.listdir(tmp_path) == []


def test_failed_write_leaves_no_files(tmp_path, monkeypatch):
    calls = []

    def failing_ext(array):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("disk full")
        return original(array)

    original = P._ndarray_ext
    monkeypatch.setattr(P, "_ndarray_ext", failing_ext)
    with pytest.raises(RuntimeError, match="disk full"):
        P.save_checkpoint(str(tmp_path / "ckpt"), example_tree())
    assert os.listdir(tmp_path) == []


def test_module_imports_no_heavy_frameworks():
    path = Path(P.__file__)
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('p', {str(path)!r})\n"
        "m = importlib.util.module_from_spec(spec); sys.modules['p'] = m\n"
        "spec.loader.exec_module(m)\n"
        "print(sorted(x for x in ('jax', 'flax', 'tensorflow', 'keras', 'torch')\n"
        "             if x in sys.modules))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "[]"


# ------------------------------------------------------------- gs:// --------


def test_gs_path_without_tensorflow(monkeypatch, tmp_path):
    from keras_vmoe.formats import remote

    monkeypatch.setitem(sys.modules, "tensorflow", None)
    # Reading goes to the public URL (a closed port on 127.0.0.1 in tests).
    with pytest.raises(remote.RemoteUnreachableError,
                       match=r"127.0.0.1:9 to read .*/vmoe_checkpoints/vmoe_s32.index"):
        P.read_index("gs://vmoe_checkpoints/vmoe_s32")
    # Writing needs tf.io.gfile.
    with pytest.raises(ImportError, match=r"keras-vmoe\[tensorflow\]"):
        P.save_checkpoint("gs://bucket/out", {"a": np.zeros(2, "float32")})


def test_gs_path_goes_through_gfile(tmp_path, monkeypatch):
    def local(path):
        assert path.startswith("gs://")
        return str(tmp_path / path[len("gs://") :])

    gfile = types.SimpleNamespace(
        exists=lambda p: os.path.exists(local(p)),
        isdir=lambda p: os.path.isdir(local(p)),
        stat=lambda p: types.SimpleNamespace(length=os.path.getsize(local(p))),
        GFile=lambda p, mode: open(local(p), mode),
        rename=lambda s, d, overwrite: os.replace(local(s), local(d)),
        remove=lambda p: os.remove(local(p)),
        makedirs=lambda p: os.makedirs(local(p), exist_ok=True),
    )
    monkeypatch.setitem(
        sys.modules,
        "tensorflow",
        types.SimpleNamespace(io=types.SimpleNamespace(gfile=gfile)),
    )
    tree = example_tree()
    P.save_checkpoint(
        "gs://bucket/dir/ckpt", tree, num_shards=2, chunk_slices=CHUNK_SLICES
    )
    assert sorted(os.listdir(tmp_path / "bucket" / "dir")) == [
        "ckpt.data-00000-of-00002",
        "ckpt.data-00001-of-00002",
        "ckpt.index",
    ]
    flat = P.restore_flat("gs://bucket/dir/ckpt")
    for path, array in flatten(tree).items():
        assert_same(flat[path], array)


# ------------------------------------------------------------- errors -------


def test_error_missing_index(tmp_path):
    with pytest.raises(P.CheckpointError, match=r"index not found: .*nothing\.index"):
        P.read_index(str(tmp_path / "nothing"))
    with pytest.raises(P.CheckpointError, match="index not found"):
        P.restore_checkpoint(str(tmp_path / "nothing"))


def test_error_missing_shards(tmp_path):
    prefix, _ = write_example(tmp_path, num_shards=3)
    os.remove(P.shard_path(prefix, 1, 3))
    os.remove(P.shard_path(prefix, 2, 3))
    with pytest.raises(P.CheckpointError) as info:
        P.restore_flat(prefix)
    message = str(info.value)
    assert "2 data shard file(s) missing" in message
    assert (
        "ckpt.data-00001-of-00003" in message and "ckpt.data-00002-of-00003" in message
    )
    assert "ckpt.data-00000-of-00003" not in message


def test_error_truncated_data(tmp_path):
    prefix, _ = write_example(tmp_path)
    path = Path(P.shard_path(prefix, 0, 1))
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(P.CheckpointError, match=re.escape(str(path)) + ".*truncated"):
        P.restore_flat(prefix)


def test_error_corrupt_data(tmp_path):
    prefix, _ = write_example(tmp_path)
    path = Path(P.shard_path(prefix, 0, 1))
    data = bytearray(path.read_bytes())
    data[len(P.MAGIC_KEY) + 3] = 0xC1  # Never-used msgpack byte, where a key starts.
    path.write_bytes(bytes(data))
    with pytest.raises(
        P.CheckpointError, match=re.escape(str(path)) + ".*corrupt msgpack"
    ):
        P.restore_flat(prefix)


def test_error_corrupt_and_truncated_index(tmp_path):
    prefix, _ = write_example(tmp_path)
    path = Path(prefix + ".index")
    original = path.read_bytes()
    path.write_bytes(original[:-10])
    with pytest.raises(P.CheckpointError, match=re.escape(str(path)) + ".*truncated"):
        P.read_index(prefix)
    path.write_bytes(b"\xc1" + original[1:])
    with pytest.raises(
        P.CheckpointError, match=re.escape(str(path)) + ".*corrupt msgpack"
    ):
        P.read_index(prefix)
    path.write_bytes(msgpack.packb({"index": {}}))
    with pytest.raises(P.CheckpointError, match="shard_count"):
        P.read_index(prefix)


def test_the_used_shards_are_those_the_leaves_name(tmp_path):
    prefix, _ = write_example(tmp_path)
    index = P.read_index(prefix)
    assert index.used_shards == sorted({s for leaf in index.leaves for s in leaf.shards})
    assert set(index.used_shards) <= set(range(index.shard_count))


def test_error_leaf_id_not_in_index(tmp_path):
    prefix = str(tmp_path / "ckpt")
    P.save_checkpoint(prefix, {"a": np.arange(3.0)})
    path = P.shard_path(prefix, 0, 1)
    pack_data_file(
        path,
        {"0": [([np.arange(3.0)], ((0, 3),))], "99": [([np.arange(3.0)], ((0, 3),))]},
    )
    with pytest.raises(
        P.CheckpointError,
        match=re.escape(path)
        + r".*leaf id 99 is not in the index \(which has 1 leaves",
    ):
        P.restore_flat(prefix)


def test_error_chunk_shape_mismatch(tmp_path):
    prefix = str(tmp_path / "ckpt")
    P.save_checkpoint(prefix, {"a": np.zeros((4, 2), np.float32)})
    path = P.shard_path(prefix, 0, 1)
    chunk = np.zeros(6, np.float32)
    pack_data_file(path, {"0": [([chunk], ((0, 4), (0, 2)))]})
    with pytest.raises(
        P.CheckpointError,
        match=r"leaf 0 \(a\): chunk for slice \[0:4, 0:2\] \(shape \(4, 2\), 8 elements\) holds 6",
    ):
        P.restore_flat(prefix)


def test_error_chunk_dtype_and_bounds(tmp_path):
    prefix = str(tmp_path / "ckpt")
    P.save_checkpoint(prefix, {"a": np.zeros(4, np.float32)})
    path = P.shard_path(prefix, 0, 1)
    pack_data_file(path, {"0": [([np.zeros(4, np.float64)], ((0, 4),))]})
    with pytest.raises(
        P.CheckpointError,
        match="chunk dtype float64 differs from the index dtype float32",
    ):
        P.restore_flat(prefix)
    pack_data_file(path, {"0": [([np.zeros(4, np.float32)], ((2, 6),))]})
    with pytest.raises(
        P.CheckpointError, match=r"leaf 0 \(a\): slice \[2:6\] is out of bounds"
    ):
        P.restore_flat(prefix)


def test_error_missing_magic_key_and_trailing_data(tmp_path):
    prefix = str(tmp_path / "ckpt")
    P.save_checkpoint(prefix, {"a": np.zeros(4, np.float32)})
    path = P.shard_path(prefix, 0, 1)
    original = Path(path).read_bytes()
    pack_data_file(path, {"0": [([np.zeros(4, np.float32)], ((0, 4),))]}, magic=False)
    with pytest.raises(
        P.CheckpointError, match="not a partitioned checkpoint data file"
    ):
        P.restore_flat(prefix)
    Path(path).write_bytes(original + b"\x00")
    with pytest.raises(P.CheckpointError, match="unexpected data after the end"):
        P.restore_flat(prefix)


def test_error_index_slices_do_not_cover_leaf(tmp_path):
    prefix, _ = write_example(tmp_path, num_shards=2)
    kernel = P.read_index(prefix).leaf(EXPERT_KERNEL)
    edit_index(
        prefix,
        with_leaf(EXPERT_KERNEL, slices=kernel.slices[:3], shards=kernel.shards[:3]),
    )
    with pytest.raises(P.CheckpointError) as info:
        P.restore_checkpoint(prefix)
    message = str(info.value)
    assert "ckpt.index" in message and EXPERT_KERNEL in message
    assert "60 of its 240 elements are missing" in message
    # A larger global shape than the chunks is also incomplete.
    edit_index(prefix, with_leaf("head/bias", shape=(9,), slices=[((0, 9),)]))
    with pytest.raises(
        P.CheckpointError, match=r"head/bias.*2 of its 9 elements are missing"
    ):
        list(P.iter_leaves(prefix, paths=["head/bias"]))


def test_error_data_chunks_do_not_cover_leaf(tmp_path):
    prefix, tree = write_example(tmp_path, num_shards=2)
    kernel = P.read_index(prefix).leaf(EXPERT_KERNEL)
    shard = kernel.shards[1]
    rewrite_shard(prefix, tree, shard, keep=lambda leaf, box: box != kernel.slices[1])
    with pytest.raises(P.CheckpointError) as info:
        P.restore_flat(prefix)
    message = str(info.value)
    assert EXPERT_KERNEL in message and "60 of its 240 elements are missing" in message
    assert "data files" in message


def test_error_leaf_absent_from_listed_shard(tmp_path):
    prefix, tree = write_example(tmp_path, num_shards=3)
    (shard,) = P.read_index(prefix).leaf("head/bias").shards
    rewrite_shard(
        prefix, tree, shard, keep=lambda leaf, box: leaf.path_str != "head/bias"
    )
    with pytest.raises(P.CheckpointError) as info:
        P.restore_flat(prefix)
    message = str(info.value)
    assert "head/bias" in message and "7 of its 7 elements are missing" in message
    assert f"{P.shard_path(prefix, shard, 3)}, but they hold no data for it" in message


def test_error_dtype_not_understood_in_index(tmp_path):
    prefix = str(tmp_path / "ckpt")
    P.save_checkpoint(
        prefix, {"a": np.zeros(2, np.float32), "b": np.zeros(2, np.int32)}
    )
    path = Path(prefix + ".index")
    path.write_bytes(path.read_bytes().replace(b"\xa7float32", b"\xa7float33"))
    with pytest.raises(
        P.CheckpointError,
        match=re.escape(str(path)) + r".*leaf 0 \(a\): dtype not understood: 'float33'",
    ):
        P.read_index(prefix)


def test_error_dtype_not_understood_in_data(tmp_path):
    prefix = str(tmp_path / "ckpt")
    P.save_checkpoint(prefix, {"a": np.zeros(2, np.float32)})
    path = Path(P.shard_path(prefix, 0, 1))
    path.write_bytes(path.read_bytes().replace(b"\xa7float32", b"\xa7object_"))
    with pytest.raises(
        P.CheckpointError,
        match=re.escape(str(path)) + ".*leaf 0: dtype not understood: 'object_'",
    ):
        P.restore_flat(prefix)


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
    for read in (P.restore_flat, P.check_data_files, read_upstream_shapes):
        with pytest.raises(P.CheckpointError, match=expected) as info:
            read(bomb_prefix)
        assert HEAD in str(info.value)


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


def test_coverage_check_of_many_tiny_slices_stays_small(upstream_dir, tmp_path):
    """20,000 one-element slices of a (10^6, 10^6) leaf: the old grid needed
    20,001^2 int64 cells (3.2 GB)."""
    for suffix in (".index", ".data-00000-of-00001"):
        shutil.copy(upstream_dir / "vmoe_tiny" / f"checkpoint{suffix}",
                    tmp_path / f"ckpt{suffix}")
    prefix = str(tmp_path / "ckpt")
    index = P.read_index(prefix)
    slices = [((i, i + 1), (i, i + 1)) for i in range(20_000)]
    leaves = [
        dataclasses.replace(leaf, shape=(10**6, 10**6), slices=slices,
                            shards=[0] * len(slices))
        if leaf.path_str == HEAD else leaf
        for leaf in index.leaves
    ]
    P._write_index(prefix, dataclasses.replace(index, leaves=leaves))
    with open(f"{prefix}.data-00000-of-00001", "ab") as f:  # room for the slices
        f.write(bytes(200_000))
    tracemalloc.start()
    try:
        with pytest.raises(P.CheckpointError, match="head/kernel.*incomplete"):
            P.check_data_files(prefix)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 200 * 2**20, f"peak {peak} bytes"
