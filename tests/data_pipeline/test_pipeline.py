"""keras_vmoe.data pipelines and keras_vmoe.preprocessing converters."""

import os

import numpy as np
import pytest

from keras_vmoe import data
from keras_vmoe.preprocessing import ImageConverter


def _batches(ds):
    return [(np.asarray(x), np.asarray(y)) for x, y in ds]


def test_digits_eval_pipeline_shapes_range_order():
    ds = data.load_dataset("digits", "test", image_size=16, batch_size=100)
    batches = _batches(ds)
    images = np.concatenate([b[0] for b in batches])
    labels = np.concatenate([b[1] for b in batches])
    assert images.shape == (data.DIGITS_SPLITS["test"], 16, 16, 3)
    assert images.dtype == np.float32 and labels.dtype == np.int32
    assert images.min() >= -1.0 and images.max() <= 1.0 and images.max() > 0.9
    # In order, every example once, same labels as the arrays.
    _, ref_labels = data.load_digits_arrays("test")
    np.testing.assert_array_equal(labels, ref_labels)
    assert data.class_names("digits") == [str(i) for i in range(10)]


def test_training_pipeline_augments_deterministically_with_a_seed():
    arrays = data.load_digits_arrays("train[:64]")
    kwargs = dict(image_size=16, batch_size=32, training=True, seed=3,
                  crop_area_range=(0.3, 1.0))
    first = _batches(data.load_dataset(arrays, **kwargs))
    again = _batches(data.load_dataset(arrays, **kwargs))
    other = _batches(data.load_dataset(arrays, **{**kwargs, "seed": 4}))
    assert len(first) == 2  # drop_remainder in training
    np.testing.assert_array_equal(first[0][0], again[0][0])
    assert not np.array_equal(first[0][0], other[0][0])
    # Augmentation only in training: the eval pipeline of the same
    # (unshuffled) examples is upstream's plain resize (cast back to uint8).
    evaluation = _batches(data.load_dataset(arrays, image_size=16, batch_size=64))
    plain = np.asarray(ImageConverter(16, float_range=(0, 255))(
        arrays[0].astype("float32")))
    np.testing.assert_allclose(evaluation[0][0], plain, atol=1 / 127.5 + 1e-5)
    np.testing.assert_allclose((evaluation[0][0] + 1) * 127.5,
                               np.round((evaluation[0][0] + 1) * 127.5), atol=1e-3)
    assert first[0][0].min() >= -1.0 - 1e-6 and first[0][0].max() <= 1.0 + 1e-6


def test_mixup_gives_soft_one_hot_labels():
    arrays = data.load_digits_arrays("train[:32]")
    (x, y), = _batches(data.load_dataset(arrays, image_size=8, batch_size=32,
                                         training=True, mixup=0.4))
    assert y.shape == (32, 10)
    np.testing.assert_allclose(y.sum(-1), 1.0, atol=1e-5)
    # Upstream's MixUp: one weight a >= 0.5 for the whole batch (rows whose
    # partner has the same class stay one-hot).
    top = y.max(-1)
    assert np.all(top >= 0.5 - 1e-6)
    assert len(np.unique(np.round(top[top < 1 - 1e-6], 5))) <= 1


def test_user_keras_layer_runs_in_the_pipeline():
    import keras

    arrays = data.load_digits_arrays("train[:16]")
    ds = data.load_dataset(arrays, image_size=8, batch_size=16, training=True,
                           preprocessing=[keras.layers.Rescaling(0.0, offset=255.0)])
    (x, _), = _batches(ds)
    np.testing.assert_allclose(x, 1.0)  # the layer set every pixel to 255


def _photo_folder(root):
    from skimage import data as skdata
    from skimage import io

    photos = {"cat": ["chelsea", "astronaut"], "cup": ["coffee", "rocket"]}
    for label, names in photos.items():
        os.makedirs(root / label)
        for i, name in enumerate(names):
            ext = "jpg" if i == 0 else "png"
            io.imsave(str(root / label / f"{name}.{ext}"), getattr(skdata, name)(),
                      check_contrast=False)
    return root


@pytest.mark.heavy
def test_image_folder_pipeline_on_real_photos(tmp_path):
    root = _photo_folder(tmp_path / "photos")
    assert data.class_names(str(root)) == ["cat", "cup"]
    # No train/ and test/ sub-folders: one of each class's two photos is
    # held out as "test" (20 %, at least one), the other is "train".
    (x, y), = _batches(data.load_dataset(str(root), image_size=24, batch_size=8))
    assert x.shape == (2, 24, 24, 3) and sorted(y.tolist()) == [0, 1]
    assert -1.0 <= x.min() < 0 < x.max() <= 1.0
    (xt, yt), = _batches(data.load_dataset(str(root), "test", image_size=24,
                                           batch_size=8, training=True,
                                           drop_remainder=False))
    assert xt.shape == (2, 24, 24, 3) and sorted(yt.tolist()) == [0, 1]
    parts = [_batches(data.load_dataset(str(root), s, image_size=8, batch_size=8))
             for s in ("train[:50%]", "train[50%:]")]
    assert sum(len(p[0][1]) for p in parts) == 2


def test_tfds_pipeline_with_mock_data():
    import tensorflow_datasets as tfds

    with tfds.testing.mock_data(num_examples=12):
        # (mock_data serves num_examples whatever the split slice says, so
        # slicing itself is TFDS's and is not checked here.)
        ds = data.load_dataset("tfds:cifar10", "train", image_size=16,
                               batch_size=4)
        batches = _batches(ds)
        names = data.class_names("tfds:cifar10")
    assert len(names) == 10  # mock_data keeps the ClassLabel size
    assert sum(len(b[1]) for b in batches) == 12
    assert batches[0][0].shape == (4, 16, 16, 3)


@pytest.mark.parametrize("spec, error", [
    ("tfds:not_a_dataset_xyz", "Unknown TFDS dataset"),
    ("no/such/folder", "Unknown dataset"),
    (42, "`spec` must be"),
])
def test_clear_errors_for_unknown_datasets(spec, error):
    with pytest.raises(ValueError, match=error):
        data.load_dataset(spec, image_size=8, batch_size=2)


def test_clear_errors_for_bad_folders_arrays_and_arguments(tmp_path):
    (tmp_path / "empty" / "a").mkdir(parents=True)
    with pytest.raises(ValueError, match="no class sub-folders with images"):
        data.load_dataset(str(tmp_path / "empty"), image_size=8, batch_size=2)
    images = np.zeros((4, 8, 8, 4), "uint8")
    with pytest.raises(ValueError, match="Received: shape=\\(4, 8, 8, 4\\)"):
        data.load_dataset((images, np.zeros(4)), image_size=8, batch_size=2)
    rgb = np.zeros((3, 8, 8, 3), "uint8")
    with pytest.raises(ValueError, match=r"labels must be in \[0, 1\]"):
        data.load_dataset((rgb, np.array([0, 1, 5])), image_size=8, batch_size=2,
                          class_names=["a", "b"])
    with pytest.raises(ValueError, match="NaN"):
        data.load_dataset((rgb, np.array([0.0, np.nan, 1.0])), image_size=8,
                          batch_size=2)
    with pytest.raises(ValueError, match="batch_size"):
        data.load_dataset("digits", image_size=8, batch_size=0)
    with pytest.raises(ValueError, match="Unknown load_dataset arguments"):
        data.load_dataset("digits", image_size=8, batch_size=2, mixpu=0.2)
    with pytest.raises(ValueError, match="split"):
        data.load_dataset("digits", "validation", image_size=8, batch_size=2)


def test_image_converter_ranges_sizes_and_errors():
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, (2, 20, 30, 3)).astype("uint8")
    converter = ImageConverter(16, crop="central_crop")
    from_uint8 = np.asarray(converter(raw))
    assert from_uint8.shape == (2, 16, 16, 3)
    np.testing.assert_allclose(
        np.asarray(converter(raw / 127.5 - 1.0)), from_uint8, atol=1e-5)
    unit = ImageConverter(16, crop="central_crop", float_range=(0, 1))
    np.testing.assert_allclose(np.asarray(unit(raw / 255.0)), from_uint8, atol=1e-5)
    same_size = np.asarray(ImageConverter(4)(np.full((1, 4, 4, 3), 255, "uint8")))
    np.testing.assert_allclose(same_size, 1.0)
    restored = ImageConverter.from_config(unit.get_config())
    assert restored.float_range == (0.0, 1.0) and restored.crop == "central_crop"
    with pytest.raises(ValueError, match="3 \\(RGB\\) channels"):
        converter(np.zeros((1, 8, 8, 1), "uint8"))
    with pytest.raises(ValueError, match="add a batch axis"):
        converter(np.zeros((8, 8, 3), "uint8"))
    with pytest.raises(ValueError, match="float_range"):
        ImageConverter(16, float_range=(1, 1))
    with pytest.raises(ValueError, match="crop"):
        ImageConverter(16, crop="zoom")


def test_class_id_check_is_shared_and_names_the_problem():
    from keras_vmoe.data.labels import check_class_ids

    check_class_ids(np.array([0, 2, 1]), 3, "fit")
    check_class_ids(np.array([[0.2, 0.8]]), None, "fit")  # soft labels: finite only
    with pytest.raises(ValueError, match=r"fit: labels must be integer class ids in \[0, 2\]"):
        check_class_ids(np.array([0.0, 1.5]), 3, "fit")
    with pytest.raises(ValueError, match="received dtype <U1"):
        check_class_ids(np.array(["a"]), 3, "fit")
    with pytest.raises(ValueError, match=r"the targets contain NaN"):
        check_class_ids(np.array([np.inf]), None, "fit", name="targets")
    with pytest.raises(ValueError, match=r"Received values in \[0, 3\]"):
        check_class_ids(np.array([0, 3]), 3, "fit")


def _fingerprint(images, labels, pipeline="numpy", **kwargs):
    return data.load_dataset((images, labels), "train", image_size=8, batch_size=4,
                             training=True, seed=0, pipeline=pipeline,
                             **kwargs).data_fingerprint


def test_the_data_fingerprint_covers_array_contents_and_augmentation():
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (8, 8, 8, 3), "uint8")
    labels = np.arange(8) % 2
    reference = _fingerprint(images, labels)
    assert reference == _fingerprint(images.copy(), labels.copy())
    other = images.copy()
    other[0, 0, 0, 0] ^= 1  # the same shape, one pixel changed
    assert _fingerprint(other, labels)["files"] != reference["files"]
    assert _fingerprint(images, labels[::-1].copy())["files"] != reference["files"]
    keras_path = _fingerprint(images, labels, upstream_augmentation=False)
    assert (reference["upstream_augmentation"], keras_path["upstream_augmentation"]) == (
        True, False)
    assert reference["class_names"] == ["0", "1"]


def test_the_data_fingerprint_covers_the_tf_shuffle_buffer():
    pytest.importorskip("tensorflow")
    images = np.zeros((8, 8, 8, 3), "uint8")
    labels = np.arange(8) % 2
    small = _fingerprint(images, labels, pipeline="tf", shuffle_buffer=4)
    large = _fingerprint(images, labels, pipeline="tf", shuffle_buffer=10000)
    assert (small["shuffle_buffer"], large["shuffle_buffer"]) == (4, 10000)


@pytest.mark.parametrize("pipeline", ["numpy", "tf"])
def test_image_folders_are_resized_from_the_decoded_image(tmp_path, pipeline):
    tf = pytest.importorskip("tensorflow")
    from skimage import data as skdata
    from skimage import io

    photo = skdata.chelsea()[:300, :400]  # 300x400: not square
    for label in ("cat", "dog"):
        os.makedirs(tmp_path / "test" / label)
        io.imsave(str(tmp_path / "test" / label / "a.png"), photo, check_contrast=False)
    (x, _), = _batches(data.load_dataset(str(tmp_path), "test", image_size=32,
                                         batch_size=8, pipeline=pipeline))
    # Upstream: decode | resize(32) (bilinear, cast to uint8) | value_range(-1, 1),
    # on the whole decoded image (no central crop first).
    expected = tf.cast(tf.cast(tf.image.resize(photo, (32, 32)), tf.uint8),
                       tf.float32).numpy() / 127.5 - 1.0
    np.testing.assert_allclose(x[0], expected, rtol=0, atol=1e-5)
    # Training crops the decoded image too: the crop box covers up to the
    # whole 300x400 photo, so with the full area range the output keeps
    # the photo's aspect (left and right borders come from its sides).
    (t, _), = _batches(data.load_dataset(str(tmp_path), "test", image_size=32,
                                         batch_size=2, training=True, flip=False,
                                         crop_area_range=(1.0, 1.0), pipeline=pipeline,
                                         drop_remainder=False))
    np.testing.assert_allclose(t[0], expected, rtol=0, atol=1e-5)


def test_empty_float_range_is_refused():
    images = np.zeros((2, 8, 8, 3), "float32")
    with pytest.raises(ValueError, match=r"`float_range`.*low < high.*\(1, 1\)"):
        data.load_dataset((images, np.array([0, 1])), image_size=8, batch_size=2,
                          float_range=(1, 1))


@pytest.mark.parametrize("largest", [10**9, 2**40])
def test_one_huge_label_does_not_build_a_giant_name_list(largest):
    images = np.zeros((2, 8, 8, 3), "uint8")
    with pytest.raises(ValueError) as info:
        data.load_dataset((images, np.array([0, largest])), image_size=8,
                          batch_size=2)
    message = str(info.value)
    assert f"largest label is {largest}" in message and "class_names" in message


def test_string_labels_are_a_clear_error():
    images = np.zeros((2, 8, 8, 3), "uint8")
    with pytest.raises(ValueError, match="integer class ids.*dtype <U3.*'cat'"):
        data.load_dataset((images, np.array(["cat", "dog"])), image_size=8,
                          batch_size=2)
