"""Evaluation preprocessing as upstream: `resize(size)` and
`resize_small(size·256/224)|central_crop(size)` (vmoe/data/pp_ops.py)."""

import numpy as np
import pytest

from keras_vmoe import data
from keras_vmoe.preprocessing import ImageConverter
from keras_vmoe.preprocessing.image_converter import resize_small_geometry


def _images():
    rng = np.random.default_rng(0)
    return rng.integers(0, 256, (2, 40, 60, 3)).astype("uint8"), np.array([0, 1])


def _pipeline(eval_crop=None):
    images, labels = _images()
    kwargs = {} if eval_crop is None else {"eval_crop": eval_crop}
    ds = data.load_dataset((images, labels), "train", image_size=16, batch_size=2,
                           **kwargs)
    return np.asarray(next(iter(ds))[0])


def test_resize_small_geometry_is_upstreams():
    # pp_ops.py:326-330 short side to 256, round(h·ratio); :83-84 offsets
    # (new - 224) // 2: a 375x500 ImageNet image -> 256x341, crop at (16, 58).
    assert resize_small_geometry(375, 500, (224, 224)) == (256, 341, 16, 58)
    assert resize_small_geometry(500, 375, (384, 384)) == (585, 439, 100, 27)


def test_default_evaluation_is_a_plain_resize():
    # Upstream's fine-tune configs evaluate with `decode|resize(size)`
    # (e.g. vmoe_b16_imagenet21k_randaug_strong_ft_cifar10.py:63): a
    # bilinear squash of the whole image, no crop; pp_ops.py `resize` casts
    # the result back to the decoded uint8 before `value_range(-1, 1)`.
    import tensorflow as tf

    images, _ = _images()
    resized = tf.image.resize(images, (16, 16), "bilinear")
    expected = tf.cast(resized, tf.uint8).numpy() / 127.5 - 1
    np.testing.assert_allclose(_pipeline(), expected, atol=1e-5)
    numpy_batch, _ = data.load_dataset((images, np.array([0, 1])), "train", image_size=16,
                                       batch_size=2, pipeline="numpy")[0]
    np.testing.assert_allclose(numpy_batch, expected, atol=1e-5)


def test_resize_small_central_crop_pipeline_matches_upstream_ops():
    # pretrain_imagenet21k.py:61 `resize_small(256)|central_crop(224)`, scaled
    # to 16 px: short side round(16·256/224) = 18 with an area resize
    # (pp_ops.py:332), then the central 16x16.
    import tensorflow as tf

    images, _ = _images()
    resized = tf.compat.v1.image.resize_area(images, [18, 27]).numpy()
    expected = resized[:, 1:17, 5:21] / 127.5 - 1
    np.testing.assert_allclose(_pipeline("resize_small_central_crop"), expected,
                               atol=1e-5)
    with pytest.raises(ValueError, match="eval_crop"):
        _pipeline("zoom")


def test_converter_resize_small_central_crop_on_arrays():
    from keras_vmoe.preprocessing.image_converter import resize_small_central_crop_tf

    images, _ = _images()
    converter = ImageConverter(16, crop="resize_small_central_crop")
    out = np.asarray(converter(images))
    assert out.shape == (2, 16, 16, 3)
    reference = resize_small_central_crop_tf(images.astype("float32"), (16, 16),
                                             method="bilinear", antialias=True)
    np.testing.assert_allclose(out, reference.numpy() / 127.5 - 1, atol=2e-2)
    restored = ImageConverter.from_config(converter.get_config())
    assert restored.crop == "resize_small_central_crop"
