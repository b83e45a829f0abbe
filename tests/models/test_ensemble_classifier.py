"""keras_vmoe.models.ensemble_classifier: EnsembleImageClassifier (E³)
through the shared test base, then what is specific to it: the members,
the ensemble's scores, losses and metrics."""

import math

import keras
import numpy as np
import pytest
import testing
import tiny_configs
from tiny_configs import e3_16px_classifier as _e3

from keras_vmoe.evaluation import metrics
from keras_vmoe.models import EnsembleAccuracy
from keras_vmoe.models import EnsembleCrossentropy
from keras_vmoe.models import EnsembleImageClassifier
from keras_vmoe.models import VisionTransformerBackbone
from keras_vmoe.models.ensemble_classifier import ensemble_log_probabilities
from keras_vmoe.models.ensemble_classifier import ensemble_probabilities


@pytest.mark.heavy
def test_ensemble_image_classifier_through_the_shared_base(tmp_path):
    images = np.random.default_rng(0).uniform(-1, 1, size=(4, 32, 32, 3)).astype("float32")
    labels = np.array([0, 1, 2, 1], dtype="int32")
    backbone = VisionTransformerBackbone(**tiny_configs.e3())
    testing.run_task_test(
        EnsembleImageClassifier, {"backbone": backbone, "num_classes": 3},
        (images, labels), (4, 2, 3), run_saving=True, tmp_path=tmp_path,
    )


def _softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


@pytest.fixture(scope="module")
def eee_classifier(images, labels):
    """A tiny E³ classifier (2 members) after one `fit` step; history kept on
    the model."""
    model = EnsembleImageClassifier(VisionTransformerBackbone(**tiny_configs.e3()),
                                    num_classes=3)
    model.fit_history = model.fit(images, labels, batch_size=4, epochs=1, verbose=0)
    return model


def test_eee_fit_one_step(eee_classifier):
    loss = eee_classifier.fit_history.history["loss"][0]
    assert 0.0 < loss - math.log(3) < 0.05  # mean member CE + aux loss


@pytest.mark.slow  # keeps the default suite under 10 min; run with -m slow
def test_eee_prediction_is_the_mean_of_member_softmax(eee_classifier, images):
    model = eee_classifier
    model.get_layer("head").kernel.assign(
        np.random.default_rng(1).normal(size=(32, 3)).astype("float32")
    )
    logits = model.predict_members(images, verbose=0)
    assert logits.shape == (4, 2, 3)
    assert not np.allclose(logits[:, 0], logits[:, 1])
    want = _softmax(logits.astype("float64")).mean(axis=1)
    np.testing.assert_allclose(
        model.predict_probabilities(images, verbose=0), want, rtol=1e-5
    )
    np.testing.assert_allclose(
        np.asarray(ensemble_probabilities(logits)), want, rtol=1e-5
    )
    np.testing.assert_allclose(
        np.asarray(ensemble_log_probabilities(logits)), np.log(want), atol=1e-5
    )
    np.testing.assert_allclose(
        model.predict_probabilities(images, log=True, verbose=0),
        np.log(want),
        atol=1e-5,
    )


def test_predict_gives_ensemble_scores_and_members_one_call_away(eee_classifier, images):
    # The convention of every classifier: predict -> (B, classes) scores
    # whose softmax is the prediction; the members through predict_members.
    scores = np.asarray(eee_classifier.predict(images, verbose=0))
    assert scores.shape == (4, 3)
    np.testing.assert_allclose(eee_classifier.predict_probabilities(images, verbose=0),
                               _softmax(scores.astype("float64")), atol=1e-5)
    members = np.asarray(eee_classifier.predict_members(images, verbose=0))
    assert members.shape == (4, 2, 3)
    np.testing.assert_allclose(scores, np.asarray(ensemble_log_probabilities(members)),
                               atol=1e-5)
    # The evaluation still sees the members.
    from keras_vmoe.evaluation.predictions import predict_log_probabilities

    result = predict_log_probabilities(eee_classifier, images, batch_size=4)
    np.testing.assert_allclose(result["member_logits"], members, atol=1e-5)
    np.testing.assert_allclose(
        result["log_probabilities"],
        eee_classifier.predict_probabilities(images, log=True, verbose=0), atol=1e-5)


def test_predict_takes_a_list_of_raw_images_of_different_sizes(eee_classifier):
    rng = np.random.default_rng(3)
    # 4 photos: the batch size of the fixture's calls (no new compile).
    photos = [rng.integers(0, 256, size, dtype="uint8")
              for size in ((40, 60, 3), (16, 16, 3), (23, 31, 3), (9, 70, 3))]
    together = np.asarray(eee_classifier.predict(photos, verbose=0))
    assert together.shape == (4, 3)
    converter = eee_classifier.preprocessor.image_converter
    one_by_one = np.concatenate([np.asarray(converter(p[None])) for p in photos])
    np.testing.assert_allclose(
        together, eee_classifier.predict(one_by_one, verbose=0), atol=1e-5)
    with pytest.raises(ValueError, match="Image 1 of the list"):
        eee_classifier.predict([photos[0], photos[1][..., :2]], verbose=0)
    gray = photos[1][..., 0]  # (H, W): described as a grayscale image, with the fix
    with pytest.raises(ValueError, match=r"Image 1 of the list has shape \(16, 16\): a "
                       r"grayscale image.*np\.repeat\(image\[\.\.\., None\], 3"):
        eee_classifier.predict([photos[0], gray], verbose=0)


def test_set_routing_reaches_the_ensemble_and_its_keras_file(eee_classifier, tmp_path):
    eee_classifier.set_routing(capacity_factor=8.0)  # the E³ eval capacity
    assert eee_classifier.predict_function is None
    assert eee_classifier.backbone.get_moe_layers()[0].capacity_factor == 8.0
    path = str(tmp_path / "eee.keras")
    eee_classifier.save(path)
    loaded = keras.models.load_model(path)
    assert loaded.backbone.moe["router"]["capacity_factor"] == 8.0
    assert loaded.ensemble_size == 2


def test_ensemble_loss_and_accuracy():
    rng = np.random.default_rng(2)
    logits = rng.normal(size=(5, 3, 4)).astype("float32")
    labels = np.array([0, 3, 1, 1, 2])
    log_probs = np.log(_softmax(logits.astype("float64")))
    want = -log_probs[np.arange(5), :, labels].mean()  # mean member CE
    loss = EnsembleCrossentropy()
    assert float(loss(labels, logits)) == pytest.approx(want, rel=1e-5)
    assert float(loss(labels[:, None], logits)) == pytest.approx(want, rel=1e-5)
    dense = EnsembleCrossentropy(sparse=False)
    assert float(dense(np.eye(4)[labels], logits)) == pytest.approx(want, rel=1e-5)
    probs = EnsembleCrossentropy(from_logits=False)
    assert float(probs(labels, _softmax(logits))) == pytest.approx(want, rel=1e-4)
    metric = EnsembleAccuracy()
    metric.update_state(labels, logits)
    predicted = _softmax(logits).mean(1).argmax(-1)
    assert float(metric.result()) == pytest.approx(np.mean(predicted == labels))
    assert EnsembleCrossentropy.from_config(loss.get_config()).sparse


def _randomize_head(model):
    rng = np.random.default_rng(1)
    head = model.get_layer("head")
    head.kernel.assign(rng.normal(size=head.kernel.shape).astype("float32") * 3)


def test_e3_evaluation_loss_is_the_ensemble_nll():
    # Upstream's eval loss: -log mean_m softmax(z_m)[y]
    # (vmoe/evaluate/ensemble.py:97-112), not the mean member cross-entropy
    # (the training loss, ensemble.py:56-73).
    model = _e3()
    _randomize_head(model)
    rng = np.random.default_rng(0)
    images = rng.uniform(-1, 1, (8, 16, 16, 3)).astype("float32")
    labels = rng.integers(0, 4, 8)
    logits = np.asarray(model.predict_members(images, verbose=0), "float64")  # (B, N, C)
    log_p = metrics.log_softmax(logits)
    ensemble_nll = -np.mean(np.log(np.exp(log_p).mean(1))[np.arange(8), labels])
    member_ce = -np.mean(log_p[np.arange(8), :, labels])
    assert abs(ensemble_nll - member_ce) > 1e-3
    loss = model.evaluate(images, labels, verbose=0, return_dict=True)["loss"]
    assert loss == pytest.approx(ensemble_nll, rel=1e-4)
