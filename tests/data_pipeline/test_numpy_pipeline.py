"""The TensorFlow-free input pipeline (`load_dataset(..., pipeline="numpy")`).

Same preprocessing as the `tf.data` pipeline (resize, [-1, 1], crop and
flip), every random choice a function of (seed, epoch, example index).
Exact resume through `finetune` (killed part-way through an epoch, resumed,
the weights of an uninterrupted run) is checked with real processes in
`tests/training/test_run_control.py` (the `faults` group).
"""

import os

import keras
import numpy as np
import pytest

from keras_vmoe import data
from keras_vmoe.data import numpy_pipeline
from keras_vmoe.data import sources
from keras_vmoe.data.pipeline import choose_pipeline


def test_embedded_digits_are_scikit_learns():
    sklearn_datasets = pytest.importorskip("sklearn.datasets")
    digits = sklearn_datasets.load_digits()
    images, labels = sources.digits_raw()
    np.testing.assert_array_equal(images, digits.images)
    np.testing.assert_array_equal(labels, digits.target)


@pytest.mark.parametrize("shape, size", [((8, 8, 3), (32, 32)), ((37, 50, 3), (16, 16)),
                                         ((5, 7, 3), (32, 24))])
@pytest.mark.parametrize("antialias", [True, False])
def test_resize_is_tf_image_resize_bilinear(shape, size, antialias):
    tf = pytest.importorskip("tensorflow")
    image = np.random.default_rng(0).uniform(0, 255, shape).astype("float32")
    want = tf.image.resize(image, size, method="bilinear", antialias=antialias).numpy()
    got = numpy_pipeline.resize(image, size, antialias=antialias)
    assert got.shape == (*size, 3)
    np.testing.assert_allclose(got, want, atol=2e-4)


def test_crops_stay_inside_the_image_and_the_area_range():
    rng = np.random.default_rng(1)
    areas = []
    for _ in range(300):
        top, left, h, w = numpy_pipeline.sample_crop(rng, 40, 60, (0.3, 0.9))
        assert 0 <= top and top + h <= 40 and 0 <= left and left + w <= 60
        areas.append(h * w / (40 * 60))
    assert 0.3 <= min(areas) and max(areas) <= 0.9
    assert max(areas) - min(areas) > 0.3  # not a constant box


def test_eval_batches_equal_the_tf_pipeline():
    pytest.importorskip("tensorflow")
    got = data.load_dataset("digits", "test[:40]", image_size=16, batch_size=16,
                            pipeline="numpy")
    want = data.load_dataset("digits", "test[:40]", image_size=16, batch_size=16,
                             pipeline="tf")
    assert len(got) == 3 and got.num_examples == 40
    for (x, y), (tx, ty) in zip(got, want, strict=True):
        np.testing.assert_allclose(x, np.asarray(tx), atol=1e-5)
        np.testing.assert_array_equal(y, np.asarray(ty))


def test_training_batches_are_a_function_of_seed_epoch_and_index():
    kwargs = dict(image_size=8, batch_size=16, training=True, seed=3,
                  crop_area_range=(0.5, 1.0), pipeline="numpy")
    ds = data.load_dataset("digits", "train[:64]", **kwargs)
    assert type(ds).__name__ == "ArrayPipeline" and isinstance(ds, keras.utils.PyDataset)
    assert len(ds) == 4 and ds.exact_resume
    x, y = ds[2]
    assert x.shape == (16, 8, 8, 3) and x.dtype == np.float32 and y.dtype == np.int32
    assert -1.0 <= x.min() and x.max() <= 1.0
    again = data.load_dataset("digits", "train[:64]", **kwargs)
    again[3]  # another batch first: no hidden state
    np.testing.assert_array_equal(again[2][0], x)
    ds.set_epoch(1)
    x1, y1 = ds[2]
    assert not np.array_equal(x1, x)  # a new order and new crops
    assert sorted(np.concatenate([ds[i][1] for i in range(4)])) == sorted(
        sources.load_digits_arrays("train[:64]")[1])
    # `skip` starts part-way through the same epoch (resuming a stopped one).
    np.testing.assert_array_equal(ds.skip(2)[0][0], x1)
    ds.on_epoch_end()  # plain `fit` moves to the next epoch
    assert ds.epoch == 2
    flipped = data.load_dataset("digits", "train[:64]", **{**kwargs, "seed": 4})
    assert not np.array_equal(flipped[2][0], x)


def test_mixup_batches_are_a_function_of_seed_epoch_and_index():
    kwargs = dict(image_size=8, batch_size=16, training=True, seed=5, mixup=0.2,
                  pipeline="numpy")
    ds = data.load_dataset("digits", "train[:64]", **kwargs)
    x, y = ds[2]
    again = data.load_dataset("digits", "train[:64]", **kwargs)
    again[0], again[3]  # other batches first: the weights keep no hidden state
    np.testing.assert_array_equal(again[2][1], y)
    np.testing.assert_array_equal(again[2][0], x)
    np.testing.assert_array_equal(ds.skip(2)[0][1], y)  # a resumed epoch
    assert not np.array_equal(ds[1][1], y)
    ds.set_epoch(1)
    assert not np.array_equal(ds[2][1], y)
    assert ds.exact_resume
    # Keras' MixUp layer keeps random state of its own: not resumable.
    keras_mixup = data.load_dataset("digits", "train[:64]", **kwargs,
                                    upstream_augmentation=False)
    assert not keras_mixup.exact_resume


def test_automatic_choice_and_errors():
    assert choose_pipeline(None, "digits") == "numpy"
    assert choose_pipeline(None, "tfds") == "tf"
    assert choose_pipeline("tf", "digits") == "tf"
    with pytest.raises(ValueError, match="pipeline='tf'"):
        choose_pipeline("numpy", "tfds")
    with pytest.raises(ValueError, match="Received: pipeline='torch'"):
        data.load_dataset("digits", image_size=8, batch_size=2, pipeline="torch")


def test_image_folder_through_the_numpy_pipeline(tmp_path):
    from PIL import Image

    rng = np.random.default_rng(0)
    for cls in ("cat", "dog"):
        os.makedirs(tmp_path / cls)
        for i in range(3):
            image = rng.integers(0, 256, (12 + i, 20, 3), dtype="uint8")
            Image.fromarray(image).save(tmp_path / cls / f"{i}.png")
    ds = data.load_dataset(str(tmp_path), "train", image_size=8, batch_size=2,
                           training=True, pipeline="numpy")
    assert ds.class_names == ["cat", "dog"] and ds.num_examples == 4
    x, y = ds[0]
    assert x.shape == (2, 8, 8, 3) and -1.0 <= x.min() and x.max() <= 1.0
    test = data.load_dataset(str(tmp_path), "test", image_size=8, batch_size=4,
                             pipeline="numpy")
    assert test.num_examples == 2 and test[0][0].shape == (2, 8, 8, 3)


def test_mixup_and_user_layers_in_the_numpy_pipeline():
    arrays = data.load_digits_arrays("train[:32]")
    mixed = data.load_dataset(arrays, image_size=8, batch_size=32, training=True,
                              mixup=0.4, pipeline="numpy")
    x, y = mixed[0]
    # Upstream's MixUp draws its weight from (seed, epoch, batch): resumable.
    assert y.shape == (32, 10) and mixed.dense_labels and mixed.exact_resume
    np.testing.assert_allclose(y.sum(-1), 1.0, atol=1e-5)
    # Upstream's MixUp: one weight a >= 0.5 for the whole batch (rows whose
    # partner has the same class stay one-hot).
    top = y.max(-1)
    assert np.all(top >= 0.5 - 1e-6)
    assert len(np.unique(np.round(top[top < 1 - 1e-6], 5))) <= 1
    layered = data.load_dataset(arrays, image_size=8, batch_size=16, training=True,
                                preprocessing=[keras.layers.Rescaling(0.0, offset=255.0)],
                                pipeline="numpy")
    np.testing.assert_allclose(layered[0][0], 1.0)  # the layer set every pixel to 255
