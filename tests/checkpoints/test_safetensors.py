"""The NumPy safetensors reader and writer (keras_vmoe.formats.safetensors)."""

import json

import ml_dtypes
import numpy as np
import pytest

from keras_vmoe.formats import safetensors


def test_round_trip_keeps_names_dtypes_shapes_and_values(tmp_path):
    tensors = {
        "a.weight": np.arange(12, dtype="float32").reshape(3, 4),
        "b": np.linspace(-1, 1, 5).astype(ml_dtypes.bfloat16),
        "c": np.arange(3, dtype="int64"),
        "d": np.ones((2, 1, 2), "float16"),
    }
    path = safetensors.save(str(tmp_path / "m.safetensors"), tensors, {"format": "pt"})
    header, start = safetensors.read_header(path)
    assert header["__metadata__"] == {"format": "pt"}
    assert start % 8 == 0
    loaded = safetensors.load(path)
    assert sorted(loaded) == sorted(tensors)
    for name, value in tensors.items():
        assert loaded[name].dtype == value.dtype
        np.testing.assert_array_equal(loaded[name], value)
    assert sorted(safetensors.load(path, names=["c"])) == ["c"]


def test_corrupt_files_are_refused_with_the_reason(tmp_path):
    short = tmp_path / "short.safetensors"
    short.write_bytes(b"\x01\x02")
    with pytest.raises(safetensors.SafetensorsError, match="too short"):
        safetensors.load(str(short))
    huge = tmp_path / "huge.safetensors"
    huge.write_bytes((10**9).to_bytes(8, "little") + b"{}")
    with pytest.raises(safetensors.SafetensorsError, match="header length"):
        safetensors.load(str(huge))
    path = safetensors.save(str(tmp_path / "t.safetensors"),
                            {"w": np.zeros((64, 64), "float32")})
    data = open(path, "rb").read()
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(data[: len(data) // 2])
    with pytest.raises(safetensors.SafetensorsError, match="truncated"):
        safetensors.load(str(truncated))
    text = json.dumps({"w": {"dtype": "F7", "shape": [1], "data_offsets": [0, 1]}})
    odd = tmp_path / "odd.safetensors"
    odd.write_bytes(len(text).to_bytes(8, "little") + text.encode() + b"\0")
    with pytest.raises(safetensors.SafetensorsError, match="dtypes this reader knows"):
        safetensors.load(str(odd))
