"""keras_vmoe.models.image_classifier_preprocessor: the task's input path for
every kind of data (arrays, lists of raw images, tf.data, generators,
PyDatasets), its label checks, and its place in a task's config."""

import keras
import numpy as np
import pytest
import testing
import tiny_configs

from keras_vmoe.models import ImageClassifier
from keras_vmoe.models import ImageClassifierPreprocessor
from keras_vmoe.models import VisionTransformerBackbone
from keras_vmoe.preprocessing import ImageConverter

PHOTOS = np.random.default_rng(0).integers(0, 256, (4, 24, 20, 3), "uint8")


def test_the_preprocessor_through_the_shared_base():
    images = PHOTOS.astype("float32")
    testing.run_layer_test(ImageClassifierPreprocessor, dict(image_size=16), images,
                           (4, 16, 16, 3))


def test_every_kind_of_data_is_converted_alike():
    preprocessor = ImageClassifierPreprocessor(image_size=16)
    expected = np.asarray(preprocessor.image_converter(PHOTOS))
    np.testing.assert_allclose(preprocessor.convert(PHOTOS), expected, atol=1e-6)
    listed = preprocessor.convert([PHOTOS[0], PHOTOS[1:, :, :15]])
    assert listed.shape == (4, 16, 16, 3)
    np.testing.assert_allclose(listed[0], expected[0], atol=1e-6)
    labels = np.arange(4)
    batches = list(preprocessor.convert(iter([(PHOTOS[:2], labels[:2]),
                                              (PHOTOS[2:], labels[2:])])))
    np.testing.assert_allclose(np.concatenate([b[0] for b in batches]), expected,
                               atol=1e-6)
    np.testing.assert_array_equal(batches[1][1], labels[2:])

    class Photos(keras.utils.PyDataset):
        def __len__(self):
            return 2

        def __getitem__(self, index):
            return PHOTOS[2 * index:2 * index + 2], labels[2 * index:2 * index + 2]

    mapped = preprocessor.convert(Photos())
    assert len(mapped) == 2
    np.testing.assert_allclose(mapped[1][0], expected[2:], atol=1e-6)


def test_tf_data_is_mapped_in_the_graph():
    tf = pytest.importorskip("tensorflow")
    preprocessor = ImageClassifierPreprocessor(image_size=16)
    dataset = tf.data.Dataset.from_tensor_slices((PHOTOS, np.arange(4))).batch(2)
    images = np.concatenate([x.numpy() for x, _ in preprocessor.convert(dataset)])
    np.testing.assert_allclose(images, np.asarray(preprocessor.image_converter(PHOTOS)),
                               atol=1e-5)


def test_labels_are_checked_before_training():
    preprocessor = ImageClassifierPreprocessor(image_size=16)
    with pytest.raises(ValueError, match="labels"):
        preprocessor.check_labels(PHOTOS, np.array([0, 1, 5, 1]), num_classes=3,
                                  sparse=True, where="fit")
    preprocessor.check_labels(PHOTOS, np.array([0, 1, 2, 1]), 3, True, "fit")


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="image_size"):
        ImageClassifierPreprocessor()
    with pytest.raises(ValueError, match="image_converter"):
        ImageClassifierPreprocessor("resize", image_size=16)


def test_a_task_resizes_its_preprocessor_and_keeps_it_in_its_config():
    converter = ImageConverter(24, float_range=(0, 1))
    backbone = VisionTransformerBackbone(**tiny_configs.vit(px=16, num_layers=1))
    model = ImageClassifier(backbone, num_classes=2, compile=False,
                            preprocessor=ImageClassifierPreprocessor(converter))
    assert model.preprocessor.image_size == (16, 16)
    assert model.preprocessor.image_converter.float_range == (0.0, 1.0)
    # Outside the model's graph, so built from the start (else every `fit`
    # would re-trace the model to build it).
    assert model.preprocessor.built and model.preprocessor.image_converter.built
    again = ImageClassifier.from_config(model.get_config())
    assert again.preprocessor.get_config() == model.preprocessor.get_config()
    with pytest.raises(ValueError, match="preprocessor"):
        ImageClassifier(backbone, num_classes=2, preprocessor=converter)


def test_fit_and_predict_take_generators():
    backbone = VisionTransformerBackbone(**tiny_configs.vit(px=16, num_layers=1))
    model = ImageClassifier(backbone, num_classes=2)
    labels = np.array([0, 1, 0, 1])

    def batches():
        while True:
            yield PHOTOS[:2], labels[:2]
            yield PHOTOS[2:], labels[2:]

    model.fit(batches(), steps_per_epoch=2, verbose=0)
    from_generator = model.predict(((PHOTOS[i:i + 2],) for i in (0, 2)), steps=2,
                                   verbose=0)
    np.testing.assert_allclose(from_generator, model.predict(PHOTOS, verbose=0),
                               atol=1e-5)
