"""Upstream's training augmentation: MixUp."""

import numpy as np
import pytest

from keras_vmoe.preprocessing import augmentation


def _batch(num=6, classes=6):
    rng = np.random.default_rng(0)
    images = rng.uniform(-1, 1, (num, 4, 4, 3)).astype("float32")
    labels = np.eye(classes, dtype="float32")[np.arange(num) % classes]
    return images, labels


def _check_upstream_mix(images, labels, mixed_images, mixed_labels, devices=1):
    # vmoe/train/trainer.py mixup(): alpha sorted largest first, example i
    # mixed with example i + 1 of its device slice (jnp.roll(x, -1)).
    per_device = images.shape[0] // devices
    for d in range(devices):
        rows = slice(d * per_device, (d + 1) * per_device)
        x, y = images[rows], labels[rows]
        a = mixed_labels[rows][0, np.argmax(y[0])]
        assert 0.5 <= a <= 1.0
        np.testing.assert_allclose(mixed_images[rows], a * x + (1 - a) * np.roll(x, -1, 0),
                                   atol=1e-6)
        np.testing.assert_allclose(mixed_labels[rows], a * y + (1 - a) * np.roll(y, -1, 0),
                                   atol=1e-6)


def test_upstream_mixup_one_sorted_weight_per_batch_partner_is_next():
    images, labels = _batch()
    mixup = augmentation.UpstreamMixUp(0.5, seed=3)
    out = mixup({"images": images, "labels": labels})
    _check_upstream_mix(images, labels, out["images"], out["labels"])
    out = augmentation.UpstreamMixUp(0.5, num_devices=2, seed=1)(
        {"images": images, "labels": labels})
    _check_upstream_mix(images, labels, out["images"], out["labels"], devices=2)


def test_upstream_mixup_weights_follow_the_dirichlet_formula():
    # Dirichlet(c, c) via normalised Gamma(c) draws, then sorted descending.
    mixup = augmentation.UpstreamMixUp(0.2, num_devices=4, seed=7)
    alpha = mixup.weights()
    gamma = np.random.default_rng(7).gamma(0.2, size=(4, 2))
    expected = -np.sort(-(gamma / gamma.sum(-1, keepdims=True)), axis=-1)
    np.testing.assert_allclose(alpha, expected, rtol=1e-12)
    assert np.all(alpha[:, 0] >= 0.5)


def test_upstream_mixup_in_tf_data():
    tf = pytest.importorskip("tensorflow")
    images, labels = _batch()
    mixup = augmentation.UpstreamMixUp(0.5, seed=5)
    ds = tf.data.Dataset.from_tensors((images, labels)).map(
        lambda x, y: tuple(mixup({"images": x, "labels": y}).values()))
    mixed_images, mixed_labels = (v.numpy() for v in next(iter(ds)))
    _check_upstream_mix(images, labels, mixed_images, mixed_labels)


def test_upstream_mixup_is_the_default_and_validates():
    _, mixup = augmentation.batch_augmentation(mixup=0.2)
    assert isinstance(mixup, augmentation.UpstreamMixUp)
    _, keras_mixup = augmentation.batch_augmentation(mixup=0.2, upstream=False)
    assert type(keras_mixup).__name__ == "MixUp"
    with pytest.raises(ValueError, match="concentration"):
        augmentation.UpstreamMixUp(0.0)


def test_inception_crop_resizes_as_upstream():
    # vmoe/data/pp_ops.py inception_crop: sample_distorted_bounding_box with
    # TensorFlow's default aspect ratios (0.75, 1.33), slice, then resize():
    # tf2.image.resize bilinear (no antialias) and tf.cast back to uint8.
    tf = pytest.importorskip("tensorflow")
    image = np.random.default_rng(0).integers(0, 256, (40, 60, 3), "uint8")
    seed = tf.constant([3, 4], "int64")
    crop = augmentation.InceptionCrop(16, seed=0)
    assert crop.aspect_ratio_range == (0.75, 1.33)
    begin, size, _ = tf.image.stateless_sample_distorted_bounding_box(
        tf.shape(image), bounding_boxes=tf.zeros([1, 0, 4]), seed=seed,
        area_range=(0.05, 1.0), aspect_ratio_range=(0.75, 1.33),
        min_object_covered=0.0, use_image_if_no_bounding_boxes=True)
    upstream = tf.cast(tf.image.resize(tf.slice(image, begin, size), (16, 16), "bilinear"),
                       tf.uint8).numpy().astype("float32")
    ours = crop(tf.cast(image, "float32"), seed=seed).numpy()
    np.testing.assert_array_equal(ours, upstream)
    keras_style = augmentation.InceptionCrop(16, upstream=False)(
        tf.cast(image, "float32"), seed=seed).numpy()
    assert not np.array_equal(keras_style, upstream)


def test_numpy_pipeline_crop_is_quantized_like_upstream():
    from keras_vmoe.data import numpy_pipeline

    images = np.random.default_rng(0).integers(0, 256, (4, 40, 60, 3), "uint8")
    pipeline = numpy_pipeline.ArrayPipeline(
        numpy_pipeline.array_reader(images), np.arange(4), (16, 16), 4, training=True,
        flip=False)
    batch, _ = pipeline[0]
    pixels = (batch + 1.0) * 127.5
    np.testing.assert_allclose(pixels, np.round(pixels), atol=1e-3)


@pytest.mark.parametrize("arguments, message", [
    ({"upstream_augmentation": "false"}, r"`upstream_augmentation` must be True or False"),
    ({"upstream_augmentation": "no"}, r"`upstream_augmentation` must be True or False"),
    ({"flip": "no"}, r"`flip` must be True or False"),
    ({"mixup": float("nan"), "upstream_augmentation": False}, r"`mixup` must be a finite"),
    ({"mixup": -0.5, "upstream_augmentation": False}, r"`mixup` must be a finite"),
    ({"mixup": -0.5}, r"`mixup` must be a finite"),
    ({"randaugment": (2, 31), "upstream_augmentation": False}, r"magnitude.*\[0, 30\]"),
    ({"randaugment": (2, 31)}, r"magnitude.*\[0, 30\]"),
    ({"randaugment": (2, 20), "upstream_augmentation": False},
     r"no level beyond magnitude 10.*randaugment=\(2, 20\)"),
    ({"crop_area_range": (0.9, 0.1)}, r"`crop_area_range` must be .*\(0.9, 0.1\)"),
    ({"crop_area_range": (float("nan"), 1.0)}, r"`crop_area_range` must be"),
])
@pytest.mark.parametrize("pipeline", ["numpy", "tf"])
def test_both_pipelines_check_the_augmentation_arguments_alike(pipeline, arguments,
                                                               message):
    from keras_vmoe.data import load_dataset

    if pipeline == "tf":
        pytest.importorskip("tensorflow")
    with pytest.raises(ValueError, match=message):
        load_dataset("digits", "train", image_size=16, batch_size=8,
                     pipeline=pipeline, **arguments)


def test_check_augmentation_normalises():
    assert augmentation.check_augmentation((2, 10), 0.2, [0.08, 1], True) == (
        (2, 10.0), 0.2, (0.08, 1.0), True)
    assert augmentation.check_augmentation(None, None, upstream=False) == (
        None, None, (0.05, 1.0), False)
    with pytest.raises(ValueError, match="crop_area_range"):
        augmentation.check_augmentation(crop_area_range=(0.5,))


def test_keras_randaugment_layer_refuses_what_it_cannot_do():
    assert augmentation.randaugment_layer(2, 10).factor == (0, 1.0)
    with pytest.raises(ValueError, match="no level beyond magnitude 10"):
        augmentation.randaugment_layer(2, 20)


@pytest.mark.parametrize("pipeline", ["numpy", "tf"])
def test_mixup_draws_one_weight_per_device_of_the_distribution(pipeline):
    import jax
    import keras

    from keras_vmoe.data import load_dataset

    if pipeline == "tf":
        pytest.importorskip("tensorflow")
    devices = jax.devices()[:4]
    if len(devices) < 4:
        pytest.skip("needs 4 devices (tests/conftest.py sets 8 CPU devices)")

    def mixup_of(**kwargs):
        ds = load_dataset("digits", "train[:64]", image_size=8, batch_size=16,
                          training=True, mixup=0.2, seed=0, pipeline=pipeline, **kwargs)
        if pipeline == "numpy":
            return ds.mixup
        images, labels = next(iter(ds))
        return np.asarray(labels)

    assert augmentation.local_device_count() == 1
    with keras.distribution.DataParallel(devices=devices).scope():
        assert augmentation.local_device_count() == 4
        mixed = mixup_of()
    if pipeline == "numpy":
        assert mixed.num_devices == 4
        return
    # Upstream: one weight per device batch of 16 / 4 = 4 examples. A row's
    # largest label value is that weight (1.0 when the partner has the same
    # class).
    top = np.sort(mixed, axis=-1)[:, -1].reshape(4, 4)
    weights = [np.unique(np.round(row[row < 1 - 1e-6], 5)) for row in top]
    assert all(len(w) <= 1 for w in weights), weights
    assert len(np.unique(np.concatenate(weights))) > 1, weights
