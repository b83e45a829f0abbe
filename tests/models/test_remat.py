"""Rematerialised encoder blocks (`remat=True`) against the same model without.

The tiny V-MoE of `tiny_configs` (16px, two blocks, the second an MoE block
with router noise) with dropout, so that every side effect of a block call
is exercised: seed generators advance, the MoE layer adds its auxiliary
loss. The PyTorch and TensorFlow versions are in tests/backends/test_remat.py.
"""

import jax
import keras
import numpy as np
import pytest
import tiny_configs

from keras_vmoe import models
from keras_vmoe.models import remat as remat_lib

IMAGES = np.random.default_rng(0).uniform(-1, 1, (4, 16, 16, 3)).astype("float32")
LABELS = np.array([0, 1, 2, 1])


def _config(**overrides):
    return tiny_configs.vmoe_16px_stochastic(**overrides)


def _pair():
    """Two classifiers, without and with remat, with equal variables (seeds too)."""
    keras.utils.set_random_seed(0)
    plain = models.ImageClassifier(models.VisionTransformerBackbone(**_config()),
                                   num_classes=3)
    remat = models.ImageClassifier(
        models.VisionTransformerBackbone(**_config(remat=True)), num_classes=3)
    rng = np.random.default_rng(1)
    for a, b in zip(plain.variables, remat.variables, strict=True):
        assert a.path == b.path or "seed_generator" in a.path  # numbered per process
        if "seed_generator" not in a.path:  # random weights, the head included
            a.assign(rng.normal(0, 0.3, a.shape).astype(a.dtype))
        b.assign(np.array(a.value))  # a copy: JAX's `predict` may donate buffers
    return plain, remat


def _train_step(model):
    """Jitted `(outputs, losses, gradients, new non-trainable values)` of a
    cross-entropy + auxiliary-loss step, as Keras' JAX trainer computes it."""

    def loss_fn(trainable, non_trainable, images, labels):
        logits, non_trainable, losses = model.stateless_call(
            trainable, non_trainable, images, training=True, return_losses=True)
        loss = keras.ops.mean(keras.losses.sparse_categorical_crossentropy(
            labels, logits, from_logits=True)) + sum(losses)
        return loss, (logits, losses, non_trainable)

    grad_fn = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))
    (loss, (logits, losses, non_trainable)), grads = grad_fn(
        [v.value for v in model.trainable_variables],
        [v.value for v in model.non_trainable_variables], IMAGES, LABELS)
    return loss, logits, losses, grads, non_trainable


@pytest.mark.heavy
def test_outputs_gradients_and_auxiliary_losses_equal_without_remat():
    plain, remat = _pair()
    expected, actual = _train_step(plain), _train_step(remat)
    loss, logits, losses, grads, non_trainable = actual
    np.testing.assert_allclose(logits, expected[1], rtol=0, atol=1e-6)
    # One auxiliary loss per MoE block, collected once, not once per pass.
    assert len(losses) == len(expected[2]) == 1
    np.testing.assert_allclose(losses[0], expected[2][0], rtol=0, atol=1e-6)
    np.testing.assert_allclose(loss, expected[0], rtol=0, atol=1e-6)
    assert len(grads) == len(expected[3])
    for variable, grad, reference in zip(remat.trainable_variables, grads, expected[3],
                                         strict=True):
        np.testing.assert_allclose(grad, reference, rtol=0, atol=1e-5,
                                   err_msg=variable.path)
    # The seed generators (dropout, router noise) advanced as without remat.
    for variable, value, reference in zip(remat.non_trainable_variables, non_trainable,
                                          expected[4], strict=True):
        np.testing.assert_array_equal(value, reference, err_msg=variable.path)
    assert any(not np.array_equal(value, v.value) for v, value in
               zip(remat.non_trainable_variables, non_trainable, strict=True))


@pytest.mark.heavy
def test_eager_call_adds_each_auxiliary_loss_once_and_advances_the_seeds():
    plain, remat = _pair()
    expected = plain(IMAGES, training=True)
    actual = remat(IMAGES, training=True)
    np.testing.assert_allclose(actual, expected, rtol=0, atol=1e-6)
    assert len(remat.losses) == len(plain.losses) == 1
    np.testing.assert_allclose(remat.losses[0], plain.losses[0], rtol=0, atol=1e-6)
    for a, b in zip(plain.non_trainable_variables, remat.non_trainable_variables,
                    strict=True):
        np.testing.assert_array_equal(b.value, a.value, err_msg=a.path)
    # A second call replaces the losses of the first.
    remat(IMAGES, training=True)
    assert len(remat.losses) == 1


# Four more compiles (LoRA step, int8 predict): the heavy group.
@pytest.mark.heavy
def test_features_routing_metrics_lora_and_int8_are_unchanged():
    plain, remat = _pair()
    a, b = plain.backbone, remat.backbone
    features = (a.extract_features(IMAGES, blocks=None, jit_compile=False),
                b.extract_features(IMAGES, blocks=None, jit_compile=False))
    assert features[0].keys() == features[1].keys()
    for name in features[0]:
        np.testing.assert_allclose(features[1][name], features[0][name], atol=1e-6)
    metrics = (a.routing_metrics(IMAGES, jit_compile=False),
               b.routing_metrics(IMAGES, jit_compile=False))
    assert metrics[1].keys() == metrics[0].keys()
    assert metrics[1]["encoderblock_1"] == pytest.approx(metrics[0]["encoderblock_1"],
                                                         abs=1e-6)
    for model in (plain, remat):
        model.backbone.quantize("int8")
    np.testing.assert_allclose(remat.predict_on_batch(IMAGES),
                               plain.predict_on_batch(IMAGES), rtol=0, atol=1e-6)
    # LoRA on the int8 model: gradients reach the factors through remat.
    for model in (plain, remat):
        model.enable_lora(2, targets=("query", "value"), experts=True)
    rng = np.random.default_rng(2)
    for va, vb in zip(plain.variables, remat.variables, strict=True):
        if "lora" in va.path:
            va.assign(rng.normal(0, 0.3, va.shape).astype(va.dtype))
            vb.assign(np.array(va.value))
    expected, actual = _train_step(plain), _train_step(remat)
    np.testing.assert_allclose(actual[1], expected[1], rtol=0, atol=1e-6)
    assert any("lora" in v.path for v in remat.trainable_variables)
    assert len(actual[3]) == len(expected[3])
    for variable, grad, reference in zip(remat.trainable_variables, actual[3],
                                         expected[3], strict=True):
        np.testing.assert_allclose(grad, reference, rtol=0, atol=1e-5,
                                   err_msg=variable.path)


def test_config_round_trip_and_configs_without_remat():
    backbone = models.VisionTransformerBackbone(**tiny_configs.vit(remat=True))
    config = backbone.get_config()
    assert config["remat"] is True
    assert all(block.remat for block in backbone.get_encoder_blocks())
    restored = models.VisionTransformerBackbone.from_config(config)
    assert restored.remat and restored.get_encoder_blocks()[0].get_config()["remat"]
    del config["remat"]  # a config saved before the option existed
    assert models.VisionTransformerBackbone.from_config(config).remat is False
    with pytest.raises(ValueError, match="`remat` must be True or False"):
        models.VisionTransformerBackbone(**tiny_configs.vit(remat="yes"))


def test_backends_without_gradient_checkpointing_are_refused(monkeypatch):
    monkeypatch.setattr(keras.config, "backend", lambda: "numpy")
    with pytest.raises(ValueError, match="'numpy' backend.*jax, torch, tensorflow"):
        remat_lib.check_remat_backend(True)
    remat_lib.check_remat_backend(False)
