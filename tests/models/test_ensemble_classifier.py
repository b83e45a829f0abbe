"""EnsembleImageClassifier (E³ ensemble of members)."""

import numpy as np
import pytest
import testing
import tiny_configs
from tiny_configs import e3_16px_classifier as _e3

from keras_vmoe import models
from keras_vmoe.evaluation import metrics


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


# --- The shared test base (tests/testing.py) --------------------------------

@pytest.mark.heavy
def test_ensemble_image_classifier_through_the_shared_base(tmp_path):
    images = np.random.default_rng(0).uniform(-1, 1, size=(4, 32, 32, 3)).astype("float32")
    labels = np.array([0, 1, 2, 1], dtype="int32")
    backbone = models.VisionTransformerBackbone(**tiny_configs.e3())
    testing.run_task_test(
        models.EnsembleImageClassifier, {"backbone": backbone, "num_classes": 3},
        (images, labels), (4, 2, 3), run_saving=True, tmp_path=tmp_path,
    )
