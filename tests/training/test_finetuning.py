"""Fine-tuning recipe, task input path (converter, labels), kill-and-resume."""

import os

import keras
import numpy as np
import pytest
import tiny_configs

from keras_vmoe import training
from keras_vmoe.models import EnsembleImageClassifier
from keras_vmoe.models import ImageClassifier
from keras_vmoe.models import VisionTransformerBackbone
from keras_vmoe.training import finetuning

TINY = tiny_configs.vmoe_8px(router={"noise_std": 0.0})


def _classifier(num_classes=3, seed=0, **kwargs):
    keras.utils.set_random_seed(seed)
    return ImageClassifier(VisionTransformerBackbone(**TINY), num_classes=num_classes,
                           **kwargs)


def _data(n=32, num_classes=3, seed=0):
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, num_classes, n)
    images = rng.integers(0, 64, (n, 8, 8, 3)) + labels[:, None, None, None] * 64
    return images.astype("uint8"), labels.astype("int32")


def _dataset(images, labels, batch_size=8):
    import tensorflow as tf

    x = (images.astype("float32") / 127.5 - 1.0)
    return tf.data.Dataset.from_tensor_slices((x, labels)).batch(batch_size)


def test_uint8_and_float_inputs_give_the_same_predictions():
    model = _classifier()
    images, _ = _data(4)
    model.get_layer("head").kernel.assign(
        np.random.default_rng(1).normal(size=model.get_layer("head").kernel.shape))
    from_uint8 = model.predict(images, verbose=0)
    from_float = model.predict(images / 127.5 - 1.0, verbose=0)
    np.testing.assert_allclose(from_uint8, from_float, atol=1e-4)
    # Floats are read as [-1, 1]: unscaled 0..255 floats are refused (they
    # would be mis-scaled silently), with the range to declare.
    with pytest.raises(ValueError, match=r"float_range=\(-1.0, 1.0\).*images / 127.5 - 1"):
        model.predict(images.astype("float32"), verbose=0)
    with pytest.raises(ValueError, match="3 \\(RGB\\) channels"):
        model.predict(images[..., :2], verbose=0)


@pytest.mark.slow  # keeps the default suite under 10 min; run with -m slow
def test_converter_survives_save_and_load(tmp_path):
    from keras_vmoe import presets
    from keras_vmoe.models import ImageClassifierPreprocessor
    from keras_vmoe.preprocessing import ImageConverter

    model = _classifier(preprocessor=ImageClassifierPreprocessor(
        ImageConverter(8, float_range=(0, 1))))
    path = presets.save_to_preset(model, str(tmp_path / "p"))
    loaded = presets.from_preset(path)
    assert loaded.preprocessor.image_converter.float_range == (0.0, 1.0)
    images, _ = _data(2)
    np.testing.assert_allclose(loaded.predict(images / 255.0, verbose=0),
                               model.predict(images, verbose=0), atol=1e-5)


def test_new_head_keeps_a_custom_converter(tmp_path):
    from keras_vmoe import presets
    from keras_vmoe.models import ImageClassifierPreprocessor
    from keras_vmoe.preprocessing import ImageConverter

    model = _classifier(preprocessor=ImageClassifierPreprocessor(
        ImageConverter(8, float_range=(0, 1))))
    path = presets.save_to_preset(model, str(tmp_path / "p"))
    loaded = presets.from_preset(path, num_classes=5)
    assert loaded.num_classes == 5
    assert loaded.preprocessor.image_converter.float_range == (0.0, 1.0)
    assert loaded.preprocessor is not model.preprocessor
    # The default converter stays the default one.
    plain = presets.from_preset(presets.save_to_preset(_classifier(), str(tmp_path / "q")),
                                num_classes=5)
    assert plain.preprocessor.image_converter.float_range == (-1.0, 1.0)


# 27 s of training: the heavy group (.ci/run).
@pytest.mark.heavy
def test_short_finetune_decreases_loss_with_aux_loss_in_total():
    model = _classifier()
    images, labels = _data(64)
    history = training.finetune(model, _dataset(images, labels), _dataset(images, labels),
                                epochs=4, learning_rate=0.1, verbose=0)
    logs = history.history
    assert logs["loss"][-1] < logs["loss"][0]
    assert all(a > 0 for a in logs["auxiliary_loss"])
    # Evaluation runs without auxiliary losses: no constant-0 val entry.
    assert "val_auxiliary_loss" not in logs and "val_loss" in logs
    optimizer = model.optimizer
    assert isinstance(optimizer, training.UpstreamSGD)
    # Upstream's fine-tuning configs clip at global norm 10, not 1.
    assert optimizer.momentum == 0.9 and optimizer.global_clipnorm == 10.0
    # The total loss includes the auxiliary loss: the task loss alone is lower.
    assert model.evaluate(images, labels, verbose=0, return_dict=True)["loss"] > 0


def test_learning_rate_warms_up_then_decays():
    optimizer = finetuning.finetune_optimizer(0.1, total_steps=100, warmup_steps=10)
    schedule = optimizer._learning_rate  # the LearningRateSchedule
    values = [float(schedule(step)) for step in (0, 5, 10, 55, 100)]
    assert values[0] == 0.0 and values[1] == pytest.approx(0.05, rel=1e-4)
    assert values[2] == pytest.approx(0.1, rel=1e-4)
    # Cosine down to upstream's end value 1e-5 (not 0).
    assert values[3] == pytest.approx(0.05, rel=1e-3)
    assert values[4] == pytest.approx(1e-5, rel=1e-4)
    with pytest.raises(ValueError, match="warmup_steps"):
        finetuning.finetune_optimizer(0.1, total_steps=10, warmup_steps=10)


def test_frozen_backbone_trains_the_head_only():
    model = _classifier()
    before = [np.asarray(w) for w in model.backbone.weights]
    images, labels = _data(16)
    training.finetune(model, _dataset(images, labels), epochs=1, freeze_backbone=True,
                      verbose=0)
    for b, w in zip(before, model.backbone.weights, strict=True):
        np.testing.assert_array_equal(b, np.asarray(w))
    assert np.abs(np.asarray(model.get_layer("head").kernel)).max() > 0


class _Kill(keras.callbacks.Callback):
    def __init__(self, at_epoch, at_batch):
        super().__init__()
        self.at = (at_epoch, at_batch)
        self.epoch = 0

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if (self.epoch, batch) == self.at:
            raise KeyboardInterrupt("simulated kill")


# 28 s: the faults group (.ci/run), next to the real-process kill tests.
@pytest.mark.faults
def test_kill_and_resume_gives_the_same_weights(tmp_path):
    images, labels = _data(32)
    args = dict(epochs=2, learning_rate=0.05, verbose=0)

    reference = _classifier(seed=1)
    training.finetune(reference, _dataset(images, labels), **args)

    killed = _classifier(seed=1)
    ckpt = str(tmp_path / "ckpt")
    with pytest.raises(KeyboardInterrupt):
        training.finetune(killed, _dataset(images, labels), checkpoint_dir=ckpt,
                          callbacks=[_Kill(at_epoch=1, at_batch=1)], **args)
    assert os.path.exists(os.path.join(ckpt, "checkpoint.json"))
    resumed = _classifier(seed=1)  # a fresh process would rebuild the model
    training.finetune(resumed, _dataset(images, labels), checkpoint_dir=ckpt, **args)
    for a, b in zip(reference.weights, resumed.weights, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6, err_msg=a.path)


@pytest.mark.parametrize("bad, match", [
    (np.array([0, 1, 3, 1]), r"labels `y` must be in \[0, 2\]"),
    (np.array([0, -1, 2, 1]), r"labels `y` must be in \[0, 2\]"),
    (np.array([0.0, np.nan, 2.0, 1.0]), "NaN"),
])
def test_out_of_range_and_nan_labels_fail_clearly(bad, match):
    images, _ = _data(4)
    model = _classifier()
    with pytest.raises(ValueError, match=match):
        model.fit(images, bad, epochs=1, verbose=0)
    with pytest.raises(ValueError, match=match):
        model.evaluate(images, bad, verbose=0)
    ensemble = EnsembleImageClassifier(VisionTransformerBackbone(
        **TINY, ensemble_size=2), num_classes=3)
    with pytest.raises(ValueError, match=match):
        ensemble.fit(images, bad, epochs=1, verbose=0)
    with pytest.raises(ValueError, match=match):
        ensemble.evaluate(images, bad, verbose=0)


def test_out_of_range_labels_in_a_dataset_fail_clearly():
    images, _ = _data(4)
    model = _classifier()
    with pytest.raises(Exception, match=r"labels must be integer class ids in \[0, 2\]"):
        model.evaluate(_dataset(images, np.array([0, 1, 7, 1])), verbose=0)


def test_the_model_fingerprint_ignores_the_evaluation_only_routing():
    from keras_vmoe.training.finetuning import _model_fingerprint

    model = _classifier()
    reference = _model_fingerprint(model)
    model.set_routing(capacity_factor=8.0, phase="eval")
    assert _model_fingerprint(model) == reference
    model.set_routing(capacity_factor=1.0, phase="train")
    assert _model_fingerprint(model) != reference


# Two short fits: the heavy group.
@pytest.mark.heavy
def test_finetune_with_remat_trains_the_same_weights():
    images, labels = _data(16)
    models = [_classifier(), _classifier()]
    models[1].backbone.set_weights(models[0].backbone.get_weights())
    models[1].set_weights(models[0].get_weights())
    histories = [training.finetune(model, _dataset(images, labels), epochs=1, verbose=0,
                                   remat=remat)
                 for model, remat in zip(models, (None, True), strict=True)]
    assert not models[0].backbone.remat
    assert models[1].backbone.remat and models[1].backbone.get_config()["remat"]
    assert all(block.remat for block in models[1].backbone.get_encoder_blocks())
    np.testing.assert_allclose(histories[1].history["loss"], histories[0].history["loss"],
                               rtol=1e-5)
    for a, b in zip(models[0].weights, models[1].weights, strict=True):
        np.testing.assert_allclose(np.asarray(b.value), np.asarray(a.value), atol=1e-5,
                                   err_msg=a.path)
