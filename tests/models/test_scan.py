"""Scanned encoder blocks (`scan=True`, JAX) against the same model without.

Models with dropout and router noise run in training mode, so that every
side effect of a block call is exercised: seed generators advance, the MoE
layers add their auxiliary losses.
"""

import jax
import keras
import numpy as np
import pytest
import tiny_configs

from keras_vmoe import models
from keras_vmoe.models import scan as scan_lib

IMAGES = np.random.default_rng(0).uniform(-1, 1, (4, 16, 16, 3)).astype("float32")
LABELS = np.array([0, 1, 2, 1])


def _vmoe(**overrides):
    """V-MoE every2: blocks 1 and 3 are MoE blocks, one segment of two pairs."""
    return tiny_configs.vmoe_16px_stochastic(num_layers=4, moe_layers=(1, 3), **overrides)


def _pair(config, task=models.ImageClassifier):
    """Two classifiers, without and with scan, with equal variables (seeds too)."""
    keras.utils.set_random_seed(0)
    plain = task(models.VisionTransformerBackbone(**config), num_classes=3)
    scanned = task(models.VisionTransformerBackbone(**config, scan=True), num_classes=3)
    rng = np.random.default_rng(1)
    for a, b in zip(plain.variables, scanned.variables, strict=True):
        if "seed_generator" not in a.path:  # random weights, the head included
            a.assign(rng.normal(0, 0.3, a.shape).astype(a.dtype))
        b.assign(np.array(a.value))  # a copy: JAX's `predict` may donate buffers
    return plain, scanned


def _train_step(model):
    """Jitted `(loss, outputs, losses, gradients, new non-trainable values)`
    of a cross-entropy + auxiliary-loss step, as Keras' JAX trainer computes it."""

    def loss_fn(trainable, non_trainable, images, labels):
        logits, non_trainable, losses = model.stateless_call(
            trainable, non_trainable, images, training=True, return_losses=True)
        loss = keras.ops.mean(keras.losses.sparse_categorical_crossentropy(
            labels, keras.ops.reshape(logits, (labels.shape[0], -1, 3))[:, 0],
            from_logits=True)) + sum(losses)
        return loss, (logits, losses, non_trainable)

    grad_fn = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))
    (loss, (logits, losses, non_trainable)), grads = grad_fn(
        [v.value for v in model.trainable_variables],
        [v.value for v in model.non_trainable_variables], IMAGES, LABELS)
    return loss, logits, losses, grads, non_trainable


def _assert_same_step(plain, scanned, num_losses):
    expected, actual = _train_step(plain), _train_step(scanned)
    loss, logits, losses, grads, non_trainable = actual
    np.testing.assert_allclose(logits, expected[1], rtol=0, atol=1e-6)
    # One auxiliary loss per MoE block, collected once.
    assert len(losses) == len(expected[2]) == num_losses
    for value, reference in zip(losses, expected[2], strict=True):
        np.testing.assert_allclose(value, reference, rtol=0, atol=1e-6)
    np.testing.assert_allclose(loss, expected[0], rtol=0, atol=1e-6)
    assert len(grads) == len(expected[3])
    for variable, grad, reference in zip(scanned.trainable_variables, grads,
                                         expected[3], strict=True):
        np.testing.assert_allclose(grad, reference, rtol=0, atol=1e-5,
                                   err_msg=variable.path)
    # The seed generators (dropout, router noise) advanced as without scan.
    for variable, value, reference in zip(scanned.non_trainable_variables,
                                          non_trainable, expected[4], strict=True):
        np.testing.assert_array_equal(value, reference, err_msg=variable.path)
    assert any(not np.array_equal(value, v.value) for v, value in
               zip(scanned.non_trainable_variables, non_trainable, strict=True))


def test_segments_of_repeated_units():
    assert scan_lib.plan_segments(list("aaaa")) == [[[0], [1], [2], [3]]]
    # every2: dense/MoE pairs.
    assert scan_lib.plan_segments(list("abab")) == [[[0, 1], [2, 3]]]
    # last-n: a dense segment and a segment of pairs.
    assert scan_lib.plan_segments(list("aaaaabab")) == [
        [[0], [1], [2], [3]], [[4, 5], [6, 7]]]
    # The E³ tiling before the first MoE block is a boundary.
    assert scan_lib.plan_segments(list("aaaa"), boundaries=(2,)) == [
        [[0], [1]], [[2], [3]]]
    # No repeats: units run one by one.
    assert len(scan_lib.plan_segments(list("abc"))) == 2
    backbone = models.VisionTransformerBackbone(**tiny_configs.vmoe(
        px=16, num_layers=6, layout="last2", num_experts=4))
    names = [[[b.name for b in unit] for unit in segment]
             for segment in scan_lib.block_segments(backbone)]
    assert names == [[["encoderblock_0"], ["encoderblock_1"]],
                     [["encoderblock_2", "encoderblock_3"],
                      ["encoderblock_4", "encoderblock_5"]]]


@pytest.mark.heavy
def test_train_step_outputs_gradients_losses_and_seeds_equal_without_scan():
    plain, scanned = _pair(_vmoe())
    _assert_same_step(plain, scanned, num_losses=2)


# Eager calls run the unscanned model op by op: slow, the heavy group.
@pytest.mark.heavy
def test_eager_call_adds_each_auxiliary_loss_once_and_advances_the_seeds():
    plain, scanned = _pair(_vmoe())
    expected = plain(IMAGES, training=True)
    actual = scanned(IMAGES, training=True)
    np.testing.assert_allclose(actual, expected, rtol=0, atol=1e-6)
    assert len(scanned.losses) == len(plain.losses) == 2
    for value, reference in zip(scanned.losses, plain.losses, strict=True):
        np.testing.assert_allclose(value, reference, rtol=0, atol=1e-6)
    for a, b in zip(plain.non_trainable_variables, scanned.non_trainable_variables,
                    strict=True):
        np.testing.assert_array_equal(b.value, a.value, err_msg=a.path)
    # A second call replaces the losses of the first.
    scanned(IMAGES, training=True)
    assert len(scanned.losses) == 2


def test_config_round_trip_set_scan_and_configs_without_scan():
    backbone = models.VisionTransformerBackbone(**tiny_configs.vit(scan=True))
    config = backbone.get_config()
    assert config["scan"] is True
    assert models.VisionTransformerBackbone.from_config(config).scan is True
    del config["scan"]  # a config saved before the option existed
    restored = models.VisionTransformerBackbone.from_config(config)
    assert restored.scan is False
    restored.set_scan(True)
    assert restored.scan and restored.get_config()["scan"] is True
    with pytest.raises(ValueError, match="`scan` must be True or False"):
        models.VisionTransformerBackbone(**tiny_configs.vit(scan="yes"))
    with pytest.raises(ValueError, match="`scan` must be True or False"):
        restored.set_scan(1.5)


def test_backends_without_scan_are_refused(monkeypatch):
    monkeypatch.setattr(keras.config, "backend", lambda: "torch")
    with pytest.raises(ValueError, match="'torch' backend.*Valid backends for scan: jax"):
        scan_lib.check_scan_backend(True)
    scan_lib.check_scan_backend(False)


@pytest.mark.heavy
@pytest.mark.parametrize("config, num_losses", [
    (tiny_configs.vit(px=16, num_layers=3, dropout_rate=0.1,
                      attention_dropout_rate=0.1), 0),
    (tiny_configs.vmoe(px=16, num_layers=6, layout="last2", num_experts=4,
                       dropout_rate=0.1), 2),
    (tiny_configs.soft_moe(px=16, num_layers=4, dropout_rate=0.1), 0),
], ids=["dense", "vmoe_last2", "soft_moe"])
def test_other_families_train_step_equal_without_scan(config, num_losses):
    plain, scanned = _pair(config)
    _assert_same_step(plain, scanned, num_losses)


@pytest.mark.heavy
def test_ensemble_classifier_equal_without_scan():
    config = tiny_configs.e3(px=16, num_layers=6, dropout_rate=0.1)
    plain, scanned = _pair(config, task=models.EnsembleImageClassifier)
    _assert_same_step(plain, scanned, num_losses=3)


@pytest.mark.heavy
def test_remat_and_scan_together_equal_without_either():
    plain, _ = _pair(_vmoe())
    _, both = _pair(_vmoe(remat=True))
    _assert_same_step(plain, both, num_losses=2)


@pytest.mark.heavy
def test_fit_predict_set_routing_lora_and_int8_with_scan():
    plain, scanned = _pair(_vmoe())
    for model in (plain, scanned):
        model.compile(optimizer=keras.optimizers.SGD(0.01),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    history = [m.fit(IMAGES, LABELS, epochs=2, batch_size=4, shuffle=False,
                     verbose=0).history["loss"]
               for m in (plain, scanned)]
    np.testing.assert_allclose(history[1], history[0], rtol=1e-5)
    np.testing.assert_allclose(scanned.train_on_batch(IMAGES, LABELS),
                               plain.train_on_batch(IMAGES, LABELS), rtol=1e-5)
    for model in (plain, scanned):
        model.backbone.set_routing(capacity_factor=1.0)
    np.testing.assert_allclose(scanned.predict(IMAGES, verbose=0),
                               plain.predict(IMAGES, verbose=0), rtol=0, atol=1e-5)
    # LoRA on every block keeps the blocks identical: still one segment.
    for model in (plain, scanned):
        model.enable_lora(2, targets=("query", "value"), experts=True)
    rng = np.random.default_rng(2)
    for va, vb in zip(plain.variables, scanned.variables, strict=True):
        if "lora" in va.path:
            va.assign(rng.normal(0, 0.3, va.shape).astype(va.dtype))
        # The fitted weights agree to rounding; the step below starts equal.
        vb.assign(np.array(va.value))
    assert len(scan_lib.block_segments(scanned.backbone)) == 1
    _assert_same_step(plain, scanned, num_losses=2)
    # int8 on one block only: the blocks differ, the segment splits.
    for model in (plain, scanned):
        model.backbone.get_encoder_blocks()[0].mlp_layer.dense_0.quantize("int8")
    assert len(scan_lib.block_segments(scanned.backbone)) > 1
    np.testing.assert_allclose(scanned.predict_on_batch(IMAGES),
                               plain.predict_on_batch(IMAGES), rtol=0, atol=1e-5)


@pytest.mark.heavy
def test_expert_parallel_layout_gives_the_same_outputs_and_step():
    from keras_vmoe import distribution

    if len(jax.devices()) < 8:
        pytest.skip("needs 8 (virtual) devices")
    # Two dense/MoE pairs, 8 experts split over 4 expert devices.
    config = tiny_configs.expert_parallel_8px(num_layers=4, moe_layers=(1, 3))
    rng = np.random.default_rng(0)
    x = rng.uniform(-1, 1, (16, 8, 8, 3)).astype("float32")
    y = np.arange(16) % 3
    results = []
    try:
        for scan in (False, True):
            mesh = distribution.make_mesh(data=2, expert=4)
            keras.distribution.set_distribution(distribution.make_distribution(
                "expert", mesh, config=config, batch_size=16))
            keras.utils.set_random_seed(0)
            model = models.ImageClassifier(
                models.VisionTransformerBackbone(**config, scan=scan), num_classes=3,
                compile=False)
            model.compile(optimizer=keras.optimizers.SGD(0.1),
                          loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
            kernel = next(v for v in model.weights
                          if v.path.endswith("encoderblock_3/moe/experts/kernel_0"))
            shards = {s.data.shape for s in kernel.value.addressable_shards}
            results.append((model.predict_on_batch(x), model.train_on_batch(x, y),
                            model.predict_on_batch(x), shards))
    finally:
        keras.distribution.set_distribution(None)
    (before, loss, after, shards), expected = results[1], results[0]
    np.testing.assert_allclose(before, expected[0], rtol=0, atol=1e-5)
    np.testing.assert_allclose(loss, expected[1], rtol=1e-5)
    np.testing.assert_allclose(after, expected[2], rtol=0, atol=1e-5)
    assert shards == expected[3] and len(shards) == 1  # experts stay split
