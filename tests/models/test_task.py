"""keras_vmoe.models.task: `predict` under a distribution pads the partial
last batch: 20 images in batches of 16 on 8 devices."""

import jax
import keras
import numpy as np
import pytest
import tiny_configs

from keras_vmoe import distribution
from keras_vmoe.models.image_classifier import ImageClassifier
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
