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

    def __init__(self, backbone, num_classes, image_converter=None, compile=True,
                 **kwargs):
        head = self._build_head(backbone, num_classes, 0.0, None)
        images = self._task_images_input(backbone)
        super().__init__(inputs=images, outputs=head(backbone(images)), **kwargs)
        self.backbone = backbone
        self.num_classes = num_classes
        self.image_converter = self._make_image_converter(image_converter, backbone)
        self._finish_task(backbone, compile)

    def compile(self, optimizer="adam", loss=None, **kwargs):
        loss = loss or keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        super().compile(optimizer=optimizer, loss=loss, **kwargs)

    def get_config(self):
        return {"name": self.name, "trainable": self.trainable,
                "backbone": keras.layers.serialize(self.backbone),
                "num_classes": self.num_classes,
                "image_converter": self._serialize_image_converter()}


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


def _load_quietly(path):
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = keras.saving.load_model(path)
    assert not [str(w.message) for w in caught if "optimizer" in str(w.message)]
    return loaded


def _saved_task(path):
    keras.utils.set_random_seed(0)
    model = ImageClassifier(VisionTransformerBackbone(**tiny_configs.vmoe_8px_micro()),
                            num_classes=3)
    model.save(path)
    return model


def test_a_keras_file_of_a_model_never_trained_loads_without_an_optimizer_warning(
        tmp_path):
    path = str(tmp_path / "model.keras")
    model = _saved_task(path)  # compiled, never trained: no optimizer slots
    loaded = _load_quietly(path)
    images = np.random.default_rng(0).uniform(-1, 1, (4, 8, 8, 3)).astype("float32")
    np.testing.assert_array_equal(loaded.predict_on_batch(images),
                                  model.predict_on_batch(images))
    assert not loaded.optimizer.built and int(loaded.optimizer.iterations) == 0


@pytest.mark.heavy
def test_a_keras_file_of_a_trained_model_restores_its_optimizer_without_a_warning(
        tmp_path):
    path = str(tmp_path / "model.keras")
    model = _saved_task(path)
    images = np.random.default_rng(0).uniform(-1, 1, (4, 8, 8, 3)).astype("float32")
    model.fit(images, np.array([0, 1, 2, 0]), epochs=1, verbose=0)
    model.save(path)
    loaded = _load_quietly(path)
    assert loaded.optimizer.built and int(loaded.optimizer.iterations) == 1
    for saved, restored in zip(model.optimizer.variables, loaded.optimizer.variables,
                               strict=True):
        np.testing.assert_array_equal(keras.ops.convert_to_numpy(saved),
                                      keras.ops.convert_to_numpy(restored))
    np.testing.assert_array_equal(loaded.predict_on_batch(images),
                                  model.predict_on_batch(images))
