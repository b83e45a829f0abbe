"""keras_vmoe.evaluation.capacity: the sweep's arguments and labels are
checked before anything runs."""

import numpy as np
import pytest
import tiny_configs

from keras_vmoe import evaluation
from keras_vmoe import models


@pytest.fixture(scope="module")
def classifier():
    model = models.ImageClassifier(
        models.VisionTransformerBackbone(**tiny_configs.vmoe_8px_micro()), num_classes=3)
    images = np.random.default_rng(0).uniform(-1, 1, (3, 8, 8, 3)).astype("float32")
    return model, images


@pytest.mark.parametrize("batch_priorities", [["yes"], [2], [], None, True, [None]])
def test_batch_priorities_must_be_a_non_empty_list_of_booleans(classifier, batch_priorities):
    model, images = classifier
    with pytest.raises(ValueError, match=r"`batch_priorities` must be a non-empty list of "
                       r"booleans.*Received: batch_priorities="):
        evaluation.capacity_sweep(model, images, np.arange(3), capacity_factors=(1.0,),
                                  batch_priorities=batch_priorities)


@pytest.mark.parametrize("labels, message", [
    (np.array([0, 1, 3]), r"in \[0, 2\] \(3 classes\)\. Received values in \[0, 3\]"),
    (np.array([0, -1, 2]), r"in \[0, 2\]"),
    (np.array([0.0, np.nan, 2.0]), r"NaN or inf"),
])
def test_labels_that_are_no_class_id_are_refused(classifier, labels, message):
    model, images = classifier
    before = model.backbone.get_config()
    with pytest.raises(ValueError, match=message):
        evaluation.capacity_sweep(model, images, labels, capacity_factors=(1.0,))
    assert model.backbone.get_config() == before


def test_a_sweep_takes_numpy_booleans(classifier):
    model, images = classifier
    sweep = evaluation.capacity_sweep(model, images, np.array([0, 1, 2]),
                                      capacity_factors=(1.0,),
                                      batch_priorities=np.array([True]))
    [row] = sweep["rows"]
    assert row["batch_priority"] is True and 0.0 <= row["accuracy"] <= 1.0
