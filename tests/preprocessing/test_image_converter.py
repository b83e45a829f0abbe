"""`ImageConverter`: upstream's evaluation resize and the antialiased one."""

import numpy as np
import pytest
import testing
import tiny_configs

from keras_vmoe.preprocessing import ImageConverter

tf = pytest.importorskip("tensorflow")


def _photo():
    skdata = pytest.importorskip("skimage.data")
    return skdata.chelsea()[:300, :400]  # a 300x400 uint8 photo


def _upstream(image, size):
    # vmoe/data/pp_ops.py: decode (uint8) | resize(size) | value_range(-1, 1);
    # `resize` is tf.image.resize (bilinear) cast back to the uint8 dtype.
    resized = tf.cast(tf.image.resize(image, (size, size)), tf.uint8)
    return tf.cast(resized, tf.float32).numpy() / 127.5 - 1.0


@pytest.mark.parametrize("size", [128, 224])
def test_upstream_resize_equals_upstreams_evaluation_preprocessing(size):
    image = _photo()
    expected = _upstream(image, size)
    converter = ImageConverter(size, upstream_resize=True)
    actual = np.asarray(converter(image[None]))[0]
    np.testing.assert_allclose(actual, expected, rtol=0, atol=1e-6)
    # The antialiased resize (the class default) is further away.
    antialiased = np.asarray(ImageConverter(size)(image[None]))[0]
    assert np.abs(antialiased - expected).max() > 0.1


def test_the_classifiers_default_converter_is_upstreams_and_round_trips():
    from keras_vmoe.models import ImageClassifier
    from keras_vmoe.models import VisionTransformerBackbone

    backbone = VisionTransformerBackbone(**tiny_configs.vit(px=16, num_layers=1))
    model = ImageClassifier(backbone, num_classes=2)
    converter = model.preprocessor.image_converter
    assert converter.upstream_resize and not converter.antialias
    config = converter.get_config()
    assert ImageConverter.from_config(config).upstream_resize is True
    with pytest.raises(ValueError, match="upstream_resize"):
        ImageConverter(16, upstream_resize="yes")


def test_upstream_resize_runs_inside_tf_data():
    image = _photo()
    converter = ImageConverter(64, upstream_resize=True)
    # As the classifiers and pipelines map it: `call` on tf tensors.
    ds = tf.data.Dataset.from_tensors(image[None]).map(converter.call)
    (mapped,) = [np.asarray(x) for x in ds]
    np.testing.assert_allclose(mapped[0], _upstream(image, 64), rtol=0, atol=1e-6)
    np.testing.assert_allclose(mapped, np.asarray(converter(image[None])), atol=1e-6)


def test_image_converter_through_the_shared_base():
    images = np.random.default_rng(0).uniform(0, 255, size=(2, 24, 20, 3)).astype("float32")
    testing.run_layer_test(ImageConverter, dict(image_size=16), images, (2, 16, 16, 3))
