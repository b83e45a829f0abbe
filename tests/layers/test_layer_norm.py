# keras_vmoe's LayerNorm: Keras' layer (weights, config) computed in flax's form.

import keras
import numpy as np
import pytest
from testing import run_layer_test

from keras_vmoe.layers.layer_norm import LayerNorm


def _flax_layer_norm(x, scale, bias, eps):
    """flax `nn.LayerNorm` (use_fast_variance=True) in NumPy, float64."""
    x = x.astype("float64")
    mean = x.mean(-1, keepdims=True)
    var = np.maximum((x * x).mean(-1, keepdims=True) - mean * mean, 0.0)
    return (x - mean) * (scale / np.sqrt(var + eps)) + bias


@pytest.mark.parametrize("center", [True, False])
def test_matches_flax_formula_and_keras_layer(center):
    rng = np.random.default_rng(0)
    x = rng.normal(2.0, 3.0, (2, 5, 16)).astype("float32")
    layer = LayerNorm(epsilon=1e-6, center=center)
    reference = keras.layers.LayerNormalization(epsilon=1e-6, center=center)
    layer.build(x.shape)
    reference.build(x.shape)
    gamma = rng.normal(size=16).astype("float32")
    beta = rng.normal(size=16).astype("float32")
    layer.gamma.assign(gamma)
    reference.gamma.assign(gamma)
    if center:
        layer.beta.assign(beta)
        reference.beta.assign(beta)
    out = keras.ops.convert_to_numpy(layer(x))
    expected = _flax_layer_norm(x, gamma, beta if center else 0.0, 1e-6)
    np.testing.assert_allclose(out, expected, rtol=0, atol=2e-5)
    np.testing.assert_allclose(out, keras.ops.convert_to_numpy(reference(x)),
                               rtol=0, atol=2e-5)
    assert [w.name for w in layer.weights] == [w.name for w in reference.weights]


def test_other_axes_fall_back_to_keras():
    x = np.random.default_rng(1).normal(size=(2, 3, 4)).astype("float32")
    layer = LayerNorm(axis=1)
    reference = keras.layers.LayerNormalization(axis=1)
    np.testing.assert_allclose(keras.ops.convert_to_numpy(layer(x)),
                               keras.ops.convert_to_numpy(reference(x)), atol=1e-6)


def test_bfloat16_policy_computes_in_float32_and_returns_bfloat16():
    x = np.random.default_rng(2).normal(size=(2, 8)).astype("float32")
    layer = LayerNorm(dtype="mixed_bfloat16")
    out = layer(keras.ops.cast(x, "bfloat16"))
    assert keras.backend.standardize_dtype(out.dtype) == "bfloat16"
    expected = _flax_layer_norm(
        keras.ops.convert_to_numpy(keras.ops.cast(keras.ops.cast(x, "bfloat16"), "float32")),
        np.ones(8), np.zeros(8), 1e-3)
    np.testing.assert_allclose(keras.ops.convert_to_numpy(keras.ops.cast(out, "float32")),
                               expected, atol=2e-2)


def test_config_round_trip():
    layer = LayerNorm(epsilon=1e-6, center=False, name="ln")
    again = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(layer))
    assert type(again) is LayerNorm
    assert again.epsilon == 1e-6 and again.center is False


def test_layer_norm_through_the_shared_base(tmp_path):
    x = np.random.default_rng(3).normal(size=(2, 5, 8)).astype("float32")
    run_layer_test(LayerNorm, {"epsilon": 1e-6, "name": "layer_norm"}, x, (2, 5, 8),
                   run_saving=True, tmp_path=tmp_path)
