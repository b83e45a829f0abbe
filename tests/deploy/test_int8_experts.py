"""Weight-only int8 of the expert banks (per-expert, per-output-channel
scales), reached by `model.quantize("int8")`; the MoE layer's config keeps
the bank's int8 policy."""

import keras
import numpy as np
import pytest
import tiny_configs

from keras_vmoe.layers.experts import Experts
from keras_vmoe.layers.experts import quantize_expert_bank
from keras_vmoe.layers.moe_layer import MoeLayer

# The deploy group (`pytest -m export`, run by .ci/run): ~1 min of builds.
pytestmark = pytest.mark.export


def test_quantize_expert_bank_scales_per_expert_and_channel():
    rng = np.random.default_rng(0)
    kernel = rng.normal(size=(3, 8, 5)).astype("float32")
    kernel[0] *= 100.0  # one loud expert must not coarsen the others
    kernel[1, :, 2] = 0.0  # an all-zero channel
    q, scale = quantize_expert_bank(kernel)
    assert q.dtype == np.int8 and q.shape == (3, 8, 5) and scale.shape == (3, 5)
    np.testing.assert_allclose(scale[1:, :][scale[1:, :] != 1.0],
                               np.abs(kernel[1:]).max(axis=1)[scale[1:, :] != 1.0] / 127,
                               rtol=1e-6)
    error = np.abs(q * scale[:, None, :] - kernel)
    assert (error <= scale[:, None, :] / 2 + 1e-7).all()
    assert error[2].max() < 0.02  # a per-bank scale would be ~100x coarser here
    assert (q[1, :, 2] == 0).all() and scale[1, 2] == 1.0


def test_experts_int8_call_matches_dequantized_weights():
    experts = Experts(num_experts=4, mlp_dim=16, identical_init=False, name="experts")
    x = keras.random.normal((2, 4, 6, 8), seed=1)
    y_float = np.asarray(experts(x))
    k0, k1 = (np.asarray(experts.kernel_0), np.asarray(experts.kernel_1))
    experts.quantize("int8")
    assert experts.quantization_mode == "int8"
    assert str(experts.kernel_0.dtype) == "int8" and tuple(experts.kernel_0.shape) == (4, 8, 16)
    assert tuple(experts.kernel_1_scale.shape) == (4, 8)
    deq0 = np.asarray(experts.kernel_0, "float32") * np.asarray(experts.kernel_0_scale)[:, None]
    assert np.abs(deq0 - k0).max() <= np.abs(k0).max() / 127
    y_int8 = np.asarray(experts(x))
    assert 0 < np.abs(y_int8 - y_float).max() < 0.05 * np.abs(y_float).max()
    assert len(experts.trainable_weights) == 2  # the biases; int8 kernels are frozen
    del k1


def test_moe_layer_config_restores_int8_experts():
    layer = MoeLayer(num_experts=4, mlp_dim=16, router={"capacity_factor": 2.0},
                     name="moe")
    x = keras.random.normal((2, 5, 8), seed=2)
    layer(x)
    layer.experts.quantize("int8")
    y = np.asarray(layer(x))
    config = keras.saving.serialize_keras_object(layer)
    assert config["config"]["experts_dtype"]["config"]["mode"] == "int8"
    restored = keras.saving.deserialize_keras_object(config)
    restored(x)  # builds the int8 bank
    assert restored.experts.quantization_mode == "int8"
    restored.set_weights(layer.get_weights())
    np.testing.assert_array_equal(np.asarray(restored(x)), y)


def test_model_quantize_reaches_the_expert_banks():
    from keras_vmoe.models import ImageClassifier
    from keras_vmoe.models import VisionTransformerBackbone

    backbone = VisionTransformerBackbone(**tiny_configs.vit(
        px=16, classifier="token", moe_layers=(1,), moe=tiny_configs.moe()))
    model = ImageClassifier(backbone, num_classes=3)
    x = np.random.default_rng(0).uniform(-1, 1, (2, 16, 16, 3)).astype("float32")
    before = np.asarray(model.predict_on_batch(x))
    model.quantize("int8")
    experts = [layer for layer in model._flatten_layers(recursive=True)
               if isinstance(layer, Experts)]
    assert experts and all(e.quantization_mode == "int8" for e in experts)
    after = np.asarray(model.predict_on_batch(x))
    assert np.isfinite(after).all() and np.abs(after - before).max() < 0.1


def test_an_int8_bank_loops_over_its_experts_at_inference_on_a_cpu(monkeypatch):
    from keras_vmoe.layers import experts as experts_lib

    x = keras.random.normal((2, 4, 3, 8), seed=3)
    outputs = {}
    for implementation in ("batched", "auto"):
        experts = Experts(num_experts=4, mlp_dim=16, identical_init=False,
                          implementation=implementation, name="experts")
        experts(x)
        if implementation == "batched":
            weights = experts.get_weights()
        experts.set_weights(weights)
        experts.quantize("int8")
        outputs[implementation] = np.asarray(experts(x))
    # Few rows and a small bank: a float bank would run batched.
    assert experts.uses_loop(training=False, rows=6)
    assert not experts.uses_loop(training=True, rows=6)
    np.testing.assert_allclose(outputs["auto"], outputs["batched"], atol=1e-6)
    monkeypatch.setattr(experts_lib, "compute_platform", lambda: "gpu")
    assert not experts.uses_loop(training=False, rows=6)
    monkeypatch.undo()
    experts.enable_lora(2)  # the loop would have to widen the bank to add A @ B
    assert not experts.uses_loop(training=False, rows=6)
    np.testing.assert_allclose(np.asarray(experts(x)), outputs["batched"], atol=1e-6)
