"""`LoraEinsumDense`: rank-r updates of whole projections, on float and int8 kernels."""

import keras
import numpy as np
import pytest

from keras_vmoe.layers.lora_einsum import LoraEinsumDense


def _projection(equation, output_shape, bias_axes, input_shape, seed=0):
    keras.utils.set_random_seed(seed)
    layer = LoraEinsumDense(equation, output_shape=output_shape, bias_axes=bias_axes)
    layer.build(input_shape)
    return layer


CASES = {
    "query": ("btd,dnk->btnk", (None, 2, 8), "nk", (None, None, 16), (2, 5, 16)),
    "out": ("btnk,nkd->btd", (None, 16), "d", (None, None, 2, 8), (2, 5, 2, 8)),
}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("int8", [False, True])
def test_update_is_added_at_call_and_merged_on_save(name, int8):
    equation, output_shape, bias_axes, input_shape, x_shape = CASES[name]
    layer = _projection(equation, output_shape, bias_axes, input_shape)
    if int8:
        layer.quantize("int8")
    x = np.random.default_rng(0).uniform(-1, 1, x_shape).astype("float32")
    base = np.asarray(layer(x))
    layer.enable_lora(3, lora_alpha=6)
    np.testing.assert_array_equal(np.asarray(layer(x)), base)  # B starts at zero
    rng = np.random.default_rng(1)
    layer.lora_kernel_b.assign(rng.standard_normal(layer.lora_kernel_b.shape).astype("float32"))
    delta = 2.0 * np.tensordot(np.asarray(layer.lora_kernel_a.value),
                               np.asarray(layer.lora_kernel_b.value), axes=1)
    assert delta.shape == tuple(layer._kernel.shape)
    fan_in = int(np.prod(x_shape[2:]))
    assert np.linalg.matrix_rank(delta.reshape(fan_in, -1), tol=1e-5) == 3
    expected = base + np.einsum(equation, x, delta)
    np.testing.assert_allclose(np.asarray(layer(x)), expected, atol=1e-4)
    # Saving writes the merged kernel (quantized again for int8) for a layer
    # without LoRA.
    store = {}
    layer.save_own_variables(store)
    plain = _projection(equation, output_shape, bias_axes, input_shape, seed=1)
    if int8:
        plain.quantize("int8")
    plain.load_own_variables(store)
    tolerance = 0.05 * np.abs(expected).max() if int8 else 1e-5
    np.testing.assert_allclose(np.asarray(plain(x)), expected, atol=tolerance)


def test_quantize_with_lora_and_a_rank_beyond_the_projection_are_refused():
    layer = _projection(*CASES["query"][:4])
    with pytest.raises(ValueError, match=r"between 1 and min\(fan_in, fan_out\) = 16"):
        layer.enable_lora(17)
    assert not layer.lora_enabled and len(layer.weights) == 2
    layer.enable_lora(2)
    with pytest.raises(ValueError, match="Cannot quantize .* with LoRA enabled"):
        layer.quantize("int8")
