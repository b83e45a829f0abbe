"""`load_dataset(..., pipeline="numpy")`: digits, arrays and folders (Pillow)."""

import os

import keras
import numpy as np

from keras_vmoe.data import numpy_pipeline
from keras_vmoe.data import sources
from keras_vmoe.preprocessing import augmentation


def _image_size(image_size):
    return tuple(image_size) if isinstance(image_size, (list, tuple)) else (
        image_size, image_size)


def _source(spec, kind, split, float_range, kwargs):
    """`(reader, labels, class names, note)`."""
    if kind == "digits":
        images, labels = sources.load_digits_arrays(split)
        images, labels, names = sources.check_arrays(images, labels)
        return numpy_pipeline.array_reader(images), labels, names, None
    if kind == "arrays":
        images, labels = sources.split_arrays(spec, split, float_range)
        images, labels, names = sources.check_arrays(images, labels,
                                                     kwargs.get("class_names"))
        return numpy_pipeline.array_reader(images, float_range), labels, names, None
    files, labels, names, note = sources.folder_files(os.fspath(spec), split)
    return numpy_pipeline.file_reader(files), labels, names, note


def numpy_dataset(spec, kind, split, *, image_size, batch_size, training, seed,
                  shuffle, drop_remainder, inception, flip, extra_layers, converter,
                  float_range, kwargs):
    """The `ArrayPipeline` of `load_dataset` (arguments checked there)."""
    size = _image_size(image_size)
    read, labels, names, note = _source(spec, kind, split, float_range, kwargs)
    per_batch, mixup, randaug = [], None, None
    upstream = kwargs.get("upstream_augmentation", True)
    if training:
        per_batch, mixup = augmentation.batch_augmentation(
            kwargs.get("randaugment"), kwargs.get("mixup"), extra_layers, seed,
            upstream=upstream)
        if upstream:
            randaug = augmentation.upstream_randaugment(kwargs.get("randaugment"), seed)

    def eval_convert(images):
        # As the tf.data pipeline: integer images get upstream's `resize(size)`
        # (bilinear, no antialias, floor), others the converter's `eval_crop`.
        if converter.crop == "resize" and np.array_equal(images, np.floor(images)):
            resized = np.stack([np.floor(numpy_pipeline.resize(image, size, antialias=False))
                                for image in images])
            return (resized * (2.0 / 255.0) - 1.0).astype("float32")
        return keras.ops.convert_to_numpy(converter.call(images))

    ds = numpy_pipeline.ArrayPipeline(
        read, labels, size, batch_size, training=training, shuffle=shuffle,
        drop_remainder=drop_remainder, seed=seed, inception_crop=inception,
        crop_area_range=kwargs.get("crop_area_range", (0.05, 1.0)), flip=flip,
        per_batch=per_batch, mixup=mixup, num_classes=len(names),
        eval_convert=eval_convert, randaugment=randaug)
    ds.class_names = list(names)
    ds.num_examples = len(labels)
    ds.split_note = note
    # Keras' batch layers and MixUp draw from random state of their own.
    keras_mixup = mixup is not None and not isinstance(mixup, augmentation.UpstreamMixUp)
    ds.exact_resume = not (training and (per_batch or keras_mixup))
    return ds
