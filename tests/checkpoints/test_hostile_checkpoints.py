"""Checkpoints from strangers.

Every format's declared shapes are checked against its data before anything
is allocated, the coverage check stays small whatever the slices, and the
converter refuses values that cannot be float parameters, naming the leaf.
"""

import dataclasses
import io
import json
import shutil
import tracemalloc
import zipfile

import numpy as np
import pytest

from keras_vmoe.checkpoints import convert
from keras_vmoe.formats import partitioned as P
from keras_vmoe.formats import train_state
from keras_vmoe.formats import vit_npz

BOMB_SHAPE = (48, 10**8)  # 19.2 GB of float32
ROUTER = "Encoder/encoderblock_1/Moe/Router/dense/kernel"
HEAD = "head/kernel"
ROUTING = dict(num_selected_experts=2, capacity_factor=1.0, group_size=34,
               batch_priority=False)


@pytest.fixture(scope="module")
def params(upstream_dir):
    return convert.load_upstream_params(upstream_dir / "vmoe_tiny" / "checkpoint")


def _npy_bytes(array, declared_shape=None):
    """`.npy` bytes of `array`, its header optionally declaring another shape."""
    buffer = io.BytesIO()
    header = {"descr": np.lib.format.dtype_to_descr(array.dtype),
              "fortran_order": False,
              "shape": tuple(declared_shape or array.shape)}
    np.lib.format.write_array_header_1_0(buffer, header)
    buffer.write(array.tobytes())
    return buffer.getvalue()


# ----------------------------------------------------------------------
# Item 2: .npz, Orbax and partitioned sizes.
# ----------------------------------------------------------------------


def test_npz_header_declaring_a_huge_array_is_refused(params, tmp_path):
    path = tmp_path / "ViT.npz"
    with zipfile.ZipFile(path, "w") as archive:
        for key, value in params.items():
            shape = BOMB_SHAPE if key == HEAD else None
            archive.writestr(key + ".npy", _npy_bytes(np.asarray(value), shape))
    for read in (vit_npz.read_shapes, lambda p: dict(vit_npz.iter_arrays(p)),
                 convert.build_model_from_upstream):
        with pytest.raises(P.CheckpointError) as info:
            read(str(path))
        message = str(info.value)
        assert "head/kernel.npy" in message and str(BOMB_SHAPE) in message
        assert "19200000000 bytes" in message


def test_orbax_zarray_declaring_a_huge_array_is_refused(params, tmp_path):
    ocp = pytest.importorskip("orbax.checkpoint")
    tree = {}
    for key, value in params.items():
        node = tree
        *parents, last = key.split("/")
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = np.asarray(value)
    item = tmp_path / "state"
    checkpointer = ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_ocdbt=False))
    checkpointer.save(str(item), args=ocp.args.PyTreeSave({"params": tree}))
    checkpointer.close()
    zarray = item / "params.head.kernel" / ".zarray"
    header = json.loads(zarray.read_text())
    header["shape"] = list(BOMB_SHAPE)
    zarray.write_text(json.dumps(header))
    with pytest.raises(P.CheckpointError) as info:
        train_state.resolve_checkpoint(str(item))
    message = str(info.value)
    assert str(zarray) in message and str(BOMB_SHAPE) in message
    assert "chunk file" in message


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


# ----------------------------------------------------------------------
# Item 5: values that cannot be float parameters.
# ----------------------------------------------------------------------


def _with(params, path, value):
    return {**params, path: value}


@pytest.mark.parametrize(
    "path, make, expected",
    [
        (HEAD, lambda v: (v * 100).astype(np.int32), "dtype int32"),
        (HEAD, lambda v: v > 0, "dtype bool"),
        (HEAD, lambda v: v.astype(np.complex64) + 1j, "dtype complex64"),
        (HEAD, lambda v: np.where(np.arange(v.size).reshape(v.shape) == 3, np.inf, v),
         "1 non-finite value"),
        (ROUTER, lambda v: np.full_like(v, np.nan), "192 non-finite value"),
    ],
    ids=["int32", "bool", "complex", "inf_head", "nan_router"],
)
def test_converter_refuses_values_that_are_not_float_weights(params, path, make,
                                                             expected):
    bad = _with(params, path, make(np.asarray(params[path])))
    with pytest.raises(convert.ConversionError) as info:
        convert.build_model_from_upstream(bad, **ROUTING)
    assert repr(path) in str(info.value) and expected in str(info.value)


def test_bfloat16_weights_are_still_accepted(params):
    import ml_dtypes

    small = _with(params, HEAD, np.asarray(params[HEAD]).astype(ml_dtypes.bfloat16))
    model = convert.build_model_from_upstream(small, **ROUTING)
    assert model.get_layer("head").kernel.shape == (48, 10)
