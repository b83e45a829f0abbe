"""Upstream's RandAugment (TPU-models `distort_image_with_randaugment`)."""

import numpy as np
import pytest

from keras_vmoe.preprocessing import randaugment as ra
from keras_vmoe.preprocessing.randaugment import UpstreamRandAugment

tf = pytest.importorskip("tensorflow")


def _image(h=12, w=16, seed=0):
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), "uint8")


def _both(image, op, magnitude, sign=1.0, center=(0, 0)):
    """The operation by the NumPy and the TensorFlow implementation."""
    a = ra.apply_op_np(image, op, magnitude, sign, center)
    b = ra.apply_op_tf(tf.constant(image), tf.constant(ra.OPS.index(op)), magnitude,
                       sign, center).numpy()
    return a, b


def _check(image, op, magnitude, expected, sign=1.0, center=(0, 0)):
    for out in _both(image, op, magnitude, sign, center):
        assert out.dtype == np.uint8
        np.testing.assert_array_equal(out, expected)


def test_level_arguments_scale_with_magnitude():
    # autoaugment.py level_to_arg: level = M / 10 of each maximum.
    ten, twenty = ra.level_args(10), ra.level_args(20)
    assert ten == pytest.approx({"rotate": 30.0, "posterize": 4, "solarize": 256,
                                 "solarize_add": 110, "enhance": 1.9, "shear": 0.3,
                                 "translate": 100.0, "cutout": 40})
    assert twenty["rotate"] == 60.0 and twenty["posterize"] == 8
    assert twenty["enhance"] == pytest.approx(3.7) and twenty["translate"] == 200.0
    assert ra.level_args(5)["cutout"] == 20 and ra.level_args(5)["solarize"] == 128


def test_rotate_by_ninety_degrees_is_a_quarter_turn():
    # Rotate at M=30 is 90 degrees: about the centre with nearest sampling,
    # a quarter turn (sign +1 counterclockwise as displayed).
    image = _image(9, 9)
    _check(image, "Rotate", 30, np.rot90(image, 1), sign=1.0)
    _check(image, "Rotate", 30, np.rot90(image, -1), sign=-1.0)


def test_rotate_range_and_fill():
    image = _image(15, 15)
    ten, _ = _both(image, "Rotate", 10, sign=1.0)
    twenty, _ = _both(image, "Rotate", 20, sign=1.0)
    assert not np.array_equal(ten, twenty)
    # The centre stays; the corners leave the image at 30 degrees: fill 128.
    np.testing.assert_array_equal(ten[7, 7], image[7, 7])
    assert (ten[0, 0] == 128).all() and (ten[-1, -1] == 128).all()
    # An independent computation of the 30-degree rotation.
    angle = np.deg2rad(30.0)
    expected = np.full_like(image, 128)
    for y in range(15):
        for x in range(15):
            src_x = np.cos(angle) * (x - 7) - np.sin(angle) * (y - 7) + 7
            src_y = np.sin(angle) * (x - 7) + np.cos(angle) * (y - 7) + 7
            i, j = int(np.floor(src_y + 0.5)), int(np.floor(src_x + 0.5))
            if 0 <= i < 15 and 0 <= j < 15:
                expected[y, x] = image[i, j]
    np.testing.assert_array_equal(ten, expected)


def test_translate_shifts_by_magnitude_pixels_fill_128():
    image = _image(12, 16)
    # M=1: 100 * 1/10 = 10 pixels.
    left = np.full_like(image, 128)
    left[:, :6] = image[:, 10:]
    _check(image, "TranslateX", 1, left, sign=1.0)
    right = np.full_like(image, 128)
    right[:, 10:] = image[:, :6]
    _check(image, "TranslateX", 1, right, sign=-1.0)
    up = np.full_like(image, 128)
    up[:2] = image[10:]
    _check(image, "TranslateY", 1, up, sign=1.0)
    # M=10: 100 pixels, the whole image is fill.
    _check(image, "TranslateY", 10, np.full_like(image, 128), sign=-1.0)


def test_shear_x():
    image = _image(12, 16)
    expected = np.full_like(image, 128)
    for y in range(12):
        for x in range(16):
            j = int(np.floor(x + 0.3 * y + 0.5))
            if j < 16:
                expected[y, x] = image[y, j]
    _check(image, "ShearX", 10, expected, sign=1.0)


def test_posterize_keeps_magnitude_bits():
    image = _image()
    _check(image, "Posterize", 10, image & 0xF0)   # int(4 * 10/10) = 4 bits
    _check(image, "Posterize", 5, image & 0xC0)    # 2 bits
    _check(image, "Posterize", 0, image & 0x80)    # shift 8 clamped to 7
    _check(image, "Posterize", 20, image)          # 8 bits
    _check(image, "Posterize", 22.4, image)        # int(8.96) = 8 bits
    # Over 8 bits (M >= 22.5) the shift 8 - bits is negative; as uint8 it wraps
    # past 7 and TensorFlow clamps it to 7: only the top bit is kept.
    pixels = np.array([[[0, 77, 200]]], "uint8")
    for magnitude in (22.5, 25, 30):
        _check(pixels, "Posterize", magnitude, np.array([[[0, 0, 128]]], "uint8"))


def test_solarize_threshold_and_solarize_add():
    image = _image()
    _check(image, "Solarize", 5, np.where(image < 128, image, 255 - image))
    # Threshold int(256·M/10) compared as uint8: 256 and 512 wrap to 0 (every
    # pixel inverted), 384 to 128.
    _check(image, "Solarize", 10, 255 - image)
    _check(image, "Solarize", 20, 255 - image)
    _check(image, "Solarize", 15, np.where(image < 128, image, 255 - image))
    added = np.minimum(image.astype(int) + 110, 255).astype("uint8")
    _check(image, "SolarizeAdd", 10, np.where(image < 128, added, image))


def _upstream_posterize(image, bits):
    # tensorflow/tpu models/official/efficientnet/autoaugment.py `posterize`.
    shift = 8 - bits
    return tf.bitwise.left_shift(tf.bitwise.right_shift(image, shift), shift)


def _upstream_solarize(image, threshold=128):
    # tensorflow/tpu models/official/efficientnet/autoaugment.py `solarize`.
    return tf.where(image < threshold, image, 255 - image)


@pytest.mark.parametrize("magnitude", [0, 1, 2.5, 5, 7.5, 10, 12.5, 15, 17.5, 20, 22.5,
                                       25, 27.5, 30])
def test_posterize_and_solarize_equal_upstreams_tensorflow_code(magnitude):
    # Upstream's levels: int(level·4) bits and int(level·256), level = M / 10,
    # applied by upstream's own functions on the uint8 image.
    image = np.arange(256, dtype="uint8").reshape(16, 16, 1).repeat(3, -1)
    level = magnitude / 10.0
    posterized = _upstream_posterize(tf.constant(image), int(level * 4)).numpy()
    solarized = _upstream_solarize(tf.constant(image), int(level * 256)).numpy()
    _check(image, "Posterize", magnitude, posterized)
    _check(image, "Solarize", magnitude, solarized)


def test_cutout_square_of_magnitude_size():
    image = _image(12, 16)
    expected = image.copy()
    expected[1:9, 2:10] = 128   # M=1: pad int(40/10) = 4 around (5, 6)
    _check(image, "Cutout", 1, expected, center=(5, 6))
    expected = image.copy()
    expected[0:4, 0:4] = 128
    _check(image, "Cutout", 1, expected, center=(0, 0))


def test_color_operations():
    image = _image(16, 16)
    _check(image, "Invert", 10, 255 - image)
    bright = np.clip(image.astype("float32") * np.float32(1.9), 0, 255).astype("uint8")
    _check(image, "Brightness", 10, bright)
    # Upstream's Contrast blends towards (pixel count / 256) = 1 here.
    contrast = np.clip(1 + np.float32(1.9) * (image.astype("float32") - 1), 0, 255)
    _check(image, "Contrast", 10, contrast.astype("uint8"))
    auto, _ = _both(image, "AutoContrast", 10)
    assert (auto.reshape(-1, 3).min(0) == 0).all() and (auto.reshape(-1, 3).max(0) == 255).all()
    # At factor 1 (M = 50/9) enhance operations are the identity.
    flat = np.full((8, 8, 3), 77, "uint8")
    _check(flat, "Equalize", 10, flat)


def test_numpy_and_tensorflow_agree_on_every_operation():
    image = _image(13, 17, seed=1)
    for magnitude in (0, 3, 10, 20, 30):
        for op in ra.OPS:
            for sign in (1.0, -1.0):
                a, b = _both(image, op, magnitude, sign, (3, 5))
                np.testing.assert_array_equal(a, b, err_msg=f"{op} M={magnitude} {sign}")


@pytest.mark.heavy
def test_plans_apply_identically_and_seeds_are_deterministic():
    augment = UpstreamRandAugment(3, 10)
    image = _image()
    plan = augment.plan_np(np.random.default_rng(4), 12, 16)
    np.testing.assert_array_equal(augment.apply_plan_np(image, plan),
                                  augment.apply_plan_tf(tf.constant(image), plan).numpy())
    # Every operation can be drawn, uniformly.
    ops = UpstreamRandAugment(100, 10).plan_np(np.random.default_rng(0), 8, 8)[0]
    assert set(ops) <= set(range(16)) and len(set(ops)) > 12
    out = [UpstreamRandAugment(2, 10, seed=5)(image) for _ in range(2)]
    np.testing.assert_array_equal(*out)
    assert out[0].dtype == np.float32
    batch = np.stack([_image(seed=s) for s in range(6)])
    first = UpstreamRandAugment(2, 20, seed=5)(batch)
    assert not np.array_equal(first, UpstreamRandAugment(2, 20, seed=6)(batch))
    seed = tf.constant([1, 2])
    a = augment(tf.constant(image), seed=seed).numpy()
    np.testing.assert_array_equal(a, augment(tf.constant(image), seed=seed).numpy())
    assert augment(tf.constant(batch), seed=seed).shape == batch.shape
    assert UpstreamRandAugment(0, 10)(image.astype("float32")).tolist() == image.tolist()


@pytest.mark.parametrize("kwargs, match", [
    ({"num_layers": 101, "magnitude": 10}, "num_layers"),
    ({"num_layers": -1, "magnitude": 10}, "num_layers"),
    ({"num_layers": 2.0, "magnitude": 10}, "num_layers"),
    ({"num_layers": True, "magnitude": 10}, "num_layers"),
    ({"num_layers": 2, "magnitude": 31}, "magnitude"),
    ({"num_layers": 2, "magnitude": -1}, "magnitude"),
    ({"num_layers": 2, "magnitude": float("nan")}, "magnitude"),
    ({"num_layers": 2, "magnitude": "strong"}, "magnitude"),
])
def test_bounds(kwargs, match):
    with pytest.raises(ValueError, match=match):
        UpstreamRandAugment(**kwargs)


@pytest.mark.heavy
def test_pipelines_use_upstream_randaugment_by_default():
    import keras

    from keras_vmoe.data import load_dataset
    from keras_vmoe.preprocessing import augmentation

    per_batch, _ = augmentation.batch_augmentation((2, 10))
    assert per_batch == []
    per_batch, _ = augmentation.batch_augmentation((2, 10), upstream=False)
    assert isinstance(per_batch[0], keras.layers.RandAugment)
    with pytest.raises(ValueError, match="num_layers"):
        augmentation.training_augmentation(8, randaugment=(101, 10))

    images = np.random.default_rng(0).integers(0, 256, (8, 12, 12, 3), "uint8")
    labels = np.arange(8) % 2
    for pipeline in ("numpy", "tf"):
        common = dict(image_size=12, batch_size=4, training=True, pipeline=pipeline,
                      shuffle=False, preprocessing=None)
        plain = load_dataset((images, labels), **common)
        augmented = load_dataset((images, labels), randaugment=(2, 10), **common)
        assert augmented.exact_resume
        first = np.asarray(next(iter(augmented))[0])
        again = np.asarray(next(iter(load_dataset((images, labels), randaugment=(2, 10),
                                                  **common)))[0])
        np.testing.assert_array_equal(first, again)
        assert not np.array_equal(first, np.asarray(next(iter(plain))[0]))
        # Upstream RandAugment returns integer [0, 255] values.
        np.testing.assert_allclose((first + 1) * 127.5, np.round((first + 1) * 127.5),
                                   atol=1e-3)
    # Keras' RandAugment stays available (a batch layer with its own state).
    keras_ra = load_dataset((images, labels), randaugment=(2, 10),
                            upstream_augmentation=False, **{**common, "pipeline": "numpy"})
    assert isinstance(keras_ra.per_batch[0], keras.layers.RandAugment)
    assert keras_ra.randaugment is None and not keras_ra.exact_resume
