"""keras_vmoe.models.image_classifier: ImageClassifier through the shared
test base, then what is specific to it: its head, its losses and its
prediction convention."""

import math

import keras
import numpy as np
import pytest
import testing
import tiny_configs

from keras_vmoe.models import ImageClassifier
from keras_vmoe.models import VisionTransformerBackbone

IMAGES = np.random.default_rng(0).uniform(-1, 1, size=(4, 32, 32, 3)).astype("float32")
LABELS = np.array([0, 1, 2, 1], dtype="int32")


@pytest.mark.heavy
def test_image_classifier_through_the_shared_base(tmp_path):
    backbone = VisionTransformerBackbone(**tiny_configs.vmoe())
    testing.run_task_test(
        ImageClassifier, {"backbone": backbone, "num_classes": 3},
        (IMAGES, LABELS), (4, 3), run_saving=True, tmp_path=tmp_path,
    )


def _softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


@pytest.fixture(scope="module")
def vmoe_classifier(images, labels):
    """A tiny V-MoE classifier after one `fit` step; history kept on the model."""
    model = ImageClassifier(VisionTransformerBackbone(**tiny_configs.vmoe()), num_classes=3)
    model.fit_history = model.fit(images, labels, batch_size=4, epochs=1, verbose=0)
    return model


def test_fit_one_step_includes_the_auxiliary_loss(vmoe_classifier):
    model = vmoe_classifier
    loss = model.fit_history.history["loss"][0]
    # Zero-initialised head: the cross-entropy of the first step is log(3);
    # the rest is the weighted MoE auxiliary loss (importance + load).
    assert 0.0 < loss - math.log(3) < 0.05
    assert "accuracy" in model.fit_history.history
    # The auxiliary loss is also reported on its own in the fit logs.
    aux = model.fit_history.history["auxiliary_loss"][0]
    assert 0.0 < aux < 0.05
    assert abs((loss - math.log(3)) - aux) < 1e-3
    assert isinstance(model.optimizer, keras.optimizers.Adam)
    assert model.get_layer("head").kernel.trainable


def test_predict_gives_class_scores_whose_softmax_is_the_prediction(
        vmoe_classifier, images):
    # The convention of every classifier: predict -> (B, classes) scores
    # whose softmax is the prediction.
    scores = np.asarray(vmoe_classifier.predict(images, verbose=0))
    assert scores.shape == (4, 3)
    np.testing.assert_allclose(vmoe_classifier.predict_probabilities(images, verbose=0),
                               _softmax(scores.astype("float64")), atol=1e-5)


def test_classifier_without_head():
    backbone = VisionTransformerBackbone(**tiny_configs.vit_s16())
    model = ImageClassifier(backbone)
    assert [v.path for v in model.weights] == [v.path for v in backbone.weights]
    assert tuple(model.output.shape) == (None, 32)
    assert model.loss is None
    revived = ImageClassifier.from_config(model.get_config())
    assert revived.num_classes is None


def test_classifier_head_and_errors():
    backbone = VisionTransformerBackbone(**tiny_configs.vit_s16())
    model = ImageClassifier(
        backbone, num_classes=7, head_bias_init=-math.log(7), activation="softmax"
    )
    head = model.get_layer("head")
    assert [v.path for v in head.weights] == ["head/kernel", "head/bias"]
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(head.kernel.value), 0.0)
    np.testing.assert_allclose(
        keras.ops.convert_to_numpy(head.bias.value), -math.log(7)
    )
    assert not model.loss.get_config()["from_logits"]
    with pytest.raises(ValueError, match="num_classes"):
        ImageClassifier(backbone, num_classes=0)
    eee = VisionTransformerBackbone(**tiny_configs.e3())
    with pytest.raises(ValueError, match="EnsembleImageClassifier"):
        ImageClassifier(eee, num_classes=3)


def test_mixed_precision(images, jit_call):
    backbone = VisionTransformerBackbone(**tiny_configs.vmoe(dtype="mixed_bfloat16"))
    assert backbone.dtype_policy.name == "mixed_bfloat16"
    assert all(v.dtype == "float32" for v in backbone.weights)
    model = ImageClassifier(backbone, num_classes=3, head_bias_init=-1.0, compile=False)
    logits = jit_call(model, images)
    assert keras.backend.standardize_dtype(logits.dtype) == "bfloat16"
    np.testing.assert_allclose(np.asarray(logits, "float32"), -1.0)
    assert VisionTransformerBackbone.from_config(
        backbone.get_config()).dtype_policy.name == "mixed_bfloat16"
