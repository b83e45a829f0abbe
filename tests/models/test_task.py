"""keras_vmoe.models.task: a subclass passes the shared test base; `predict`
under a distribution pads the partial last batch: 20 images in batches of 16
on 8 devices."""

import jax
import keras
import numpy as np
import pytest
import testing
import tiny_configs

from keras_vmoe import distribution
from keras_vmoe.models import Task
from keras_vmoe.models.image_classifier import ImageClassifier
from keras_vmoe.models.task import classification_head
from keras_vmoe.models.task import images_input
from keras_vmoe.models.vit_backbone import VisionTransformerBackbone

pytestmark = pytest.mark.multi_device

# One token group per image (4 tokens), 8 experts split over the devices.
CONFIG = tiny_configs.expert_parallel_8px(num_layers=1, moe_layers=(0,))


@pytest.fixture(autouse=True)
def _needs_8_devices():
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 (virtual) devices")
    yield
    keras.distribution.set_distribution(None)


def _model(weights=None):
    keras.utils.set_random_seed(0)
    model = ImageClassifier(VisionTransformerBackbone(**CONFIG), num_classes=3,
                            compile=False)
    if weights is not None:
        model.set_weights(weights)
    return model


@pytest.mark.heavy
def test_predict_pads_the_partial_last_batch_under_the_expert_layout():
    x = np.random.default_rng(0).uniform(-1, 1, size=(20, 8, 8, 3)).astype("float32")
    reference = _model()
    expected = reference.predict(x, batch_size=20, verbose=0)  # one compile
    mesh = distribution.make_mesh(data=2, expert=4)
    keras.distribution.set_distribution(distribution.make_distribution(
        "expert", mesh, config=CONFIG, batch_size=16))
    model = _model(reference.get_weights())
    actual = model.predict(x, batch_size=16, verbose=0)
    assert actual.shape == (20, 3)
    np.testing.assert_allclose(actual, expected, rtol=1e-4, atol=1e-5)


# --- The shared test base (tests/testing.py) --------------------------------

@keras.saving.register_keras_serializable(package="keras_vmoe_tests")
class HeadOnTheFeatures(Task):
    """The smallest `Task` subclass the base documents: a classification
    head on the backbone's pooled features, and its own compile defaults."""

    def __init__(self, backbone, num_classes, preprocessor=None, compile=True, **kwargs):
        head = classification_head(backbone, num_classes)
        self.num_classes = num_classes
        images = images_input(backbone)
        super().__init__(backbone, preprocessor, inputs=images,
                         outputs=head(backbone(images)), compile=compile, **kwargs)

    def compile(self, optimizer="adam", loss=None, **kwargs):
        loss = loss or keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        super().compile(optimizer=optimizer, loss=loss, **kwargs)

    def get_config(self):
        return {**super().get_config(), "num_classes": self.num_classes}


# A task compiles several models (jit, int8, LoRA, one fit step): the heavy
# group runs it.
@pytest.mark.heavy
def test_a_task_subclass_passes_the_shared_base():
    rng = np.random.default_rng(0)
    images = rng.uniform(-1, 1, size=(4, 16, 16, 3)).astype("float32")
    labels = np.array([0, 1, 2, 1], dtype="int32")
    backbone = VisionTransformerBackbone(**tiny_configs.vit(px=16))
    task = testing.run_task_test(HeadOnTheFeatures, {"backbone": backbone, "num_classes": 3},
                                 (images, labels), (4, 3))
    assert isinstance(task, Task)
