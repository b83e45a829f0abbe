"""The export formulations of routing (sorts and gathers, no TopK/scatter)
give exactly the fast path's outputs; export errors are clear. Fast: no
converter runs here (tests/deploy/test_export_parity.py, marker `export`)."""

import builtins

import keras
import numpy as np
import pytest

from keras_vmoe.deploy import export as export_lib
from keras_vmoe.layers import allocation
from keras_vmoe.layers.allocation import exportable_routing


def _gates(seed, shape, ties=False):
    rng = np.random.default_rng(seed)
    x = rng.random(shape).astype("float32")
    if ties:  # many equal values: tie-breaking must match TopK's
        x = np.round(x * 4) / 4
    return keras.ops.softmax(keras.ops.convert_to_tensor(x), axis=-1)


@pytest.mark.parametrize("ties", [False, True])
def test_top_k_by_sort_equals_top_k(ties):
    x = _gates(0, (3, 10, 8), ties=ties)
    values, index = allocation.top_k(x, 3)
    with exportable_routing():
        values_s, index_s = allocation.top_k(x, 3)
    np.testing.assert_array_equal(np.asarray(index_s), np.asarray(index))
    np.testing.assert_array_equal(np.asarray(values_s), np.asarray(values))


@pytest.mark.parametrize("k,capacity,batch_priority,with_valid", [
    (1, 3, False, False), (2, 2, True, False), (2, 5, False, True), (3, 1, True, True),
])
@pytest.mark.heavy
def test_token_choice_by_sort_equals_scatter(k, capacity, batch_priority, with_valid):
    gates = _gates(1, (4, 12, 6), ties=True)
    valid = None
    if with_valid:
        valid = keras.ops.convert_to_tensor(np.random.default_rng(2).random((4, 12)) > 0.3)
    args = (gates, gates, k, capacity, batch_priority, valid)
    fast = allocation.token_choice_allocation(*args)
    with exportable_routing():
        exported = allocation.token_choice_allocation(*args)
    # Empty slots or dropped choices: the masked paths are exercised.
    assert ((np.asarray(fast["buffer_token"]) == 12).any()
            or (np.asarray(fast["token_slot"]) == capacity).any())
    for name in fast:
        np.testing.assert_array_equal(np.asarray(exported[name]), np.asarray(fast[name]),
                                      err_msg=name)


def test_expert_choice_by_sort_equals_top_k():
    gates = _gates(3, (2, 9, 4), ties=True)
    fast = allocation.expert_choice_allocation(gates, gates, 5)
    with exportable_routing():
        exported = allocation.expert_choice_allocation(gates, gates, 5)
    for name in fast:
        np.testing.assert_array_equal(np.asarray(exported[name]), np.asarray(fast[name]))


def test_context_is_restored():
    assert not allocation.is_exportable_routing()
    with pytest.raises(RuntimeError):
        with exportable_routing():
            assert allocation.is_exportable_routing()
            raise RuntimeError("inside")
    assert not allocation.is_exportable_routing()


def test_missing_converter_names_the_extra(monkeypatch):
    real_import = builtins.__import__

    def fake_import(name, *args, **kwargs):
        if name == "jax2onnx":
            raise ImportError("No module named 'jax2onnx'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", fake_import)
    with pytest.raises(export_lib.ExportError, match=r"keras-vmoe\[export\]"):
        export_lib._require("jax2onnx", "ONNX")


def test_conversion_error_names_the_layer():
    inputs = keras.Input((4,))
    model = keras.Model(inputs, keras.layers.Dense(2, name="head")(inputs), name="m")
    error = TypeError("Exception encountered when calling Functional.call().\n"
                      "Exception encountered when calling Dense.call().\n"
                      "scatter pattern not supported")
    message = str(export_lib._conversion_error(model, "onnx", error))
    assert "layer head (Dense)" in message and "scatter pattern not supported" in message


def test_bad_arguments_are_refused_before_any_work():
    inputs = keras.Input((8, 8, 3))
    model = keras.Model(inputs, keras.layers.Flatten()(inputs))
    with pytest.raises(ValueError, match="format"):
        export_lib.export_model(model, "x", format="tflite")
    with pytest.raises(ValueError, match="batch_size"):
        export_lib.export_model(model, "x", format="onnx", batch_size=0)
    dense = keras.Sequential([keras.layers.Dense(2)])
    with pytest.raises(export_lib.ExportError, match="no fixed"):
        export_lib._image_shape(dense)
