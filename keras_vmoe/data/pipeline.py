"""`load_dataset`: a source, per-image preprocessing, batching, augmentation."""

import os

from keras_vmoe.data import sources
from keras_vmoe.utils.extras import available
from keras_vmoe.utils.extras import require
from keras_vmoe.utils.validation import check_bool
from keras_vmoe.utils.validation import check_int
from keras_vmoe.utils.validation import check_one_of

DEFAULT_SPEC = "digits"


def _spec_kind(spec):
    if isinstance(spec, tuple):
        if len(spec) != 2:
            raise ValueError("An array dataset spec must be a pair (images, labels). "
                             f"Received a tuple of length {len(spec)}.")
        return "arrays"
    if not isinstance(spec, (str, os.PathLike)):
        raise ValueError(
            "`spec` must be 'digits', 'tfds:NAME', an image folder path or a "
            f"tuple (images, labels). Received: {type(spec).__name__}.")
    spec = os.fspath(spec)
    if spec == "digits":
        return "digits"
    if spec.startswith("tfds:"):
        if not spec[5:]:
            raise ValueError("Empty TFDS name in spec 'tfds:'. Example: 'tfds:cifar10'.")
        return "tfds"
    if os.path.isdir(spec):
        return "folder"
    raise ValueError(
        f"Unknown dataset {spec!r}: not 'digits', not 'tfds:NAME' and not an "
        "existing folder (one sub-folder of images per class).")


def class_names(spec, **kwargs):
    """The class names of a dataset spec (see `load_dataset`).

    Args:
        spec: `"digits"`, `"tfds:NAME"`, a folder path or `(images, labels)`.
        **kwargs: `class_names=` for arrays, `data_dir=` for TFDS.

    Returns:
        list of str, indexed by label.
    """
    kind = _spec_kind(spec)
    if kind == "digits":
        return [str(i) for i in range(10)]
    if kind == "arrays":
        return sources.array_source(*spec, class_names=kwargs.get("class_names"))[1]
    if kind == "tfds":
        return sources.tfds_builder(spec[5:], kwargs.get("data_dir"))[1]
    return sources.folder_root(os.fspath(spec), kwargs.get("split", "train"))[1]


def _source(spec, kind, split, float_range, kwargs):
    """(dataset, class names, number of examples or None, note or None)."""
    if kind == "digits":
        images, labels = sources.load_digits_arrays(split)
        return (*sources.array_source(images, labels), len(labels), None)
    if kind == "arrays":
        images, labels = sources.split_arrays(spec, split, float_range)
        ds, names = sources.array_source(images, labels, kwargs.get("class_names"))
        return ds, names, len(labels), None
    if kind == "tfds":
        ds, names = sources.tfds_source(spec[5:], split, data_dir=kwargs.get("data_dir"),
                                        download=kwargs.get("download", False))
        return ds, names, None, None
    ds, names, note = sources.folder_source(os.fspath(spec), split)
    return ds, names, int(ds.cardinality()), note


def _digest(values):
    import hashlib

    digest = hashlib.sha256()
    for value in values:
        digest.update(str(value).encode("utf-8", "backslashreplace") + b"\0")
    return digest.hexdigest()[:16]


def _array_digest(*arrays):
    """A hash of in-memory arrays' dtypes, shapes and contents."""
    import hashlib

    import numpy as np

    digest = hashlib.sha256()
    for array in arrays:
        array = np.ascontiguousarray(np.asarray(array))
        digest.update(f"{array.dtype.str} {array.shape}\0".encode())
        if array.dtype.hasobject:
            digest.update(repr(array.tolist()).encode("utf-8", "backslashreplace"))
        else:
            digest.update(array.reshape(-1).view(np.uint8))
    return digest.hexdigest()[:16]


def stream_fingerprint(spec, kind, split, names, *, pipeline, seed, training,
                       batch_size, image_size, flip, inception, kwargs):
    """What determines a dataset's stream of batches, as a JSON-able dict.

    `finetune` records it in the checkpoints and refuses to resume on other data.
    """
    source = kind if kind in ("digits", "arrays") else os.fspath(spec)
    files = None
    if kind == "folder":
        source = os.path.abspath(source)
        listed, labels, _, _ = sources.folder_files(os.fspath(spec), split)
        root = os.path.abspath(os.fspath(spec))
        files = f"{len(listed)} files, sha256 " + _digest(
            f"{os.path.relpath(f, root)}:{label}" for f, label in zip(listed, labels,
                                                                       strict=True))
    elif kind == "arrays":
        images, labels = spec
        files = (f"arrays {tuple(getattr(images, 'shape', ()))}, sha256 "
                 f"{_array_digest(images, labels)}")

    def plain(value):
        if isinstance(value, (list, tuple)):
            return [plain(v) for v in value]
        return value if value is None or isinstance(value, (bool, int, float, str)) \
            else repr(value)

    return {
        "source": source,
        "split": str(split),
        "classes": f"{len(names)} classes, sha256 " + _digest(names),
        # The names themselves, so that a refusal can say which changed.
        "class_names": [str(name) for name in names],
        "files": files,
        "pipeline": pipeline,
        "seed": plain(seed),
        "training": bool(training),
        "batch_size": plain(batch_size),
        "image_size": plain(image_size),
        "flip": bool(flip) if training else None,
        "inception_crop": bool(inception) if training else None,
        "crop_area_range": plain(kwargs.get("crop_area_range", (0.05, 1.0)))
        if training else None,
        "randaugment": plain(kwargs.get("randaugment")) if training else None,
        "mixup": plain(kwargs.get("mixup")) if training else None,
        "upstream_augmentation": bool(kwargs.get("upstream_augmentation", True))
        if training else None,
        "shuffle_buffer": plain(kwargs.get("shuffle_buffer", 10000))
        if pipeline == "tf" and training else None,
        "augmentations": len(kwargs.get("augmentations") or ()) if training else None,
    }


PIPELINES = ("numpy", "tf")


def choose_pipeline(pipeline, kind):
    """`"numpy"` or `"tf"` for `load_dataset(pipeline=...)` and a spec kind.

    `None` picks NumPy for the digits (the same result with or without
    TensorFlow), `tf.data` for TFDS and under a multi-process
    `keras.distribution` (sharded per process), else `tf.data` when
    TensorFlow is installed.
    """
    check_one_of(pipeline, "pipeline", (None, *PIPELINES))  # None: automatic
    if kind == "tfds":
        if pipeline == "numpy":
            raise ValueError("TFDS datasets ('tfds:NAME') need pipeline='tf' "
                             "(TensorFlow Datasets yields tf.data).")
        return "tf"
    if _multi_process():
        # Only tf.data is sharded per process (`distribute_dataset`).
        if pipeline == "numpy":
            raise ValueError(
                "pipeline='numpy' does not shard the data per process; with a "
                "keras.distribution over several processes use pipeline='tf' "
                "(pip install 'keras-vmoe[tensorflow]').")
        return "tf"
    if pipeline is not None:
        return pipeline
    if kind == "digits":
        return "numpy"
    return "tf" if available("tensorflow") else "numpy"


def _multi_process():
    import keras

    if keras.distribution.distribution() is None or keras.backend.backend() != "jax":
        return False
    import jax

    return jax.process_count() > 1


def load_dataset(spec=DEFAULT_SPEC, split="train", *, image_size, batch_size,
                 training=False, preprocessing="default", seed=0, shuffle=None,
                 drop_remainder=None, pipeline=None, **kwargs):
    """A batched dataset of `(images, labels)` for a model.

    Images come out float32 in [-1, 1] at `image_size`, labels int32 `(B,)`
    (float32 one-hot `(B, C)` with MixUp). Training pipelines shuffle, augment
    and drop the last partial batch; evaluation pipelines resize (`eval_crop`)
    and keep every example in order. The `tf.data` and NumPy pipelines
    preprocess alike but draw different random numbers; each is reproducible
    from `seed` and resumes exactly. Set a `keras.distribution` first: the
    `tf.data` pipeline is sharded per process, and upstream MixUp draws one
    weight per device batch of the distribution in effect.

    Args:
        spec: `"digits"` (default), `"tfds:NAME"`, a folder of class folders,
            or `(images, labels)` arrays (integers in [0, 255], floats in
            `float_range`).
        split: split name, optionally sliced: `"train"`, `"test"`,
            `"train[:90%]"`, `"train[90%:]"`.
        image_size: int or (int, int), the model resolution.
        batch_size: int.
        training: bool, training pipeline (shuffle + augmentation).
        preprocessing: `"default"` (training: Inception crop and flip, plus the
            kwargs' augmentation), `None` (resize only), or layers applied to
            each training batch of [0, 255] images after the crop and flip.
        seed: int, seed of shuffling and augmentation.
        shuffle: bool, default `training`.
        drop_remainder: bool, default `training`.
        pipeline: `None` (automatic, see `choose_pipeline`), `"numpy"` or `"tf"`.
        **kwargs: `randaugment=(num_ops, magnitude)`, `mixup=alpha`, `flip=`
            (default True), `crop_area_range=` (default (0.05, 1.0)),
            `augmentations=[layers]`, `upstream_augmentation=` (default True:
            upstream's per-image RandAugment and MixUp; False: Keras' layers
            per batch), `shuffle_buffer=` (default 10000), `class_names=` and
            `float_range=` (arrays, default (-1, 1)), `data_dir=` (TFDS),
            `cache=` (default True for digits and arrays), `eval_crop=`
            (`"resize"`, the default; `"resize_small_central_crop"`, upstream's
            for its 224-px models; `"central_crop"`).

    Returns:
        A `tf.data.Dataset` or a `keras.utils.PyDataset`, with
        `class_names`, `num_examples`, `split_note` and `exact_resume`.

    Examples:

    ```python
    import keras_vmoe

    train = keras_vmoe.data.load_dataset(
        "digits", "train", image_size=32, batch_size=64, training=True)
    test = keras_vmoe.data.load_dataset("digits", "test", image_size=32,
                                        batch_size=64)
    images, labels = next(iter(test))  # (64, 32, 32, 3) in [-1, 1], (64,) int
    ```
    """
    from keras_vmoe.preprocessing import augmentation  # lazy: data needs no Keras
    from keras_vmoe.preprocessing import image_converter  # lazy: data needs no Keras
    from keras_vmoe.preprocessing import value_range  # lazy: data needs no Keras

    check_int(batch_size, "batch_size")
    kwargs = _checked_kwargs(kwargs, augmentation)
    inception, flip, extra_layers = _augmentation_choice(preprocessing, kwargs)
    eval_crop = kwargs.get("eval_crop", "resize")
    check_one_of(eval_crop, "eval_crop", image_converter.CROP_MODES)
    # Upstream's `resize(size)` is `tf.image.resize` (bilinear, no antialias).
    converter = image_converter.ImageConverter(
        image_size, crop=eval_crop, float_range=(0.0, 255.0),
        antialias=eval_crop != "resize", name="image_converter")
    float_range = value_range.check_float_range(kwargs.get("float_range", (-1.0, 1.0)))
    kind = _spec_kind(spec)
    stream = {
        "image_size": image_size, "batch_size": batch_size, "training": training,
        "seed": seed, "shuffle": training if shuffle is None else bool(shuffle),
        "drop_remainder": training if drop_remainder is None else bool(drop_remainder),
        "inception": inception, "flip": flip, "extra_layers": extra_layers,
        "converter": converter, "float_range": float_range, "kwargs": kwargs,
    }
    pipeline = choose_pipeline(pipeline, kind)
    if pipeline == "numpy":
        from keras_vmoe.data import numpy_source  # lazy: data needs no Keras

        ds = numpy_source.numpy_dataset(spec, kind, split, **stream)
    else:
        ds = _tf_dataset(spec, kind, split, **stream)
    ds.data_fingerprint = stream_fingerprint(
        spec, kind, split, ds.class_names, pipeline=pipeline, seed=seed,
        training=training, batch_size=batch_size, image_size=image_size, flip=flip,
        inception=inception, kwargs=kwargs)
    return ds


def _checked_kwargs(kwargs, augmentation):
    """`load_dataset`'s keyword arguments, checked once for both pipelines."""
    allowed = {"randaugment", "mixup", "augmentations", "shuffle_buffer",
               "class_names", "float_range", "data_dir", "cache", "flip",
               "crop_area_range", "download", "eval_crop", "upstream_augmentation"}
    unknown = sorted(set(kwargs) - allowed)
    if unknown:
        raise ValueError(f"Unknown load_dataset arguments {unknown}. Valid: {sorted(allowed)}.")
    kwargs = dict(kwargs)
    (kwargs["randaugment"], kwargs["mixup"], kwargs["crop_area_range"],
     kwargs["upstream_augmentation"]) = augmentation.check_augmentation(
        kwargs.get("randaugment"), kwargs.get("mixup"),
        kwargs.get("crop_area_range", (0.05, 1.0)),
        kwargs.get("upstream_augmentation", True))
    if "flip" in kwargs:
        kwargs["flip"] = check_bool(kwargs["flip"], "flip")
    return kwargs


def _augmentation_choice(preprocessing, kwargs):
    """`(inception crop, flip, extra layers)` of training batches."""
    augmentations = list(kwargs.get("augmentations") or ())
    if preprocessing is None:
        return False, False, augmentations
    if isinstance(preprocessing, str) and preprocessing != "default":
        raise ValueError("`preprocessing` must be 'default', None or a list of layers. "
                         f"Received: preprocessing={preprocessing!r}")
    layers = [] if isinstance(preprocessing, str) else list(preprocessing)
    return True, bool(kwargs.get("flip", True)), layers + augmentations


def _tf_dataset(spec, kind, split, *, image_size, batch_size, training, seed, shuffle,
                drop_remainder, inception, flip, extra_layers, converter, float_range,
                kwargs):
    """The `tf.data` pipeline of `load_dataset` (arguments checked there)."""
    import keras

    from keras_vmoe.preprocessing import augmentation  # lazy: data needs no Keras
    from keras_vmoe.preprocessing import image_converter  # lazy: data needs no Keras

    tf = require("tensorflow", "The tf.data pipeline (load_dataset(pipeline='tf'))")
    ds, names, num_examples, note = _source(spec, kind, split, float_range, kwargs)
    low, high = float_range

    def to_0_255(image):
        # Float arrays are in `float_range`; integers and folders in [0, 255].
        if image.dtype.is_integer or kind == "folder":
            return tf.cast(image, "float32")
        return (tf.cast(image, "float32") - low) * (255.0 / (high - low))

    def check_image(image):
        rank = image.shape.rank
        if rank is not None and (rank != 3 or image.shape[-1] not in (1, 3, None)):
            raise ValueError(
                "Dataset images must be (H, W, 3) or grayscale (H, W, 1). "
                f"Received: shape={image.shape}")
        if image.shape[-1] == 1:
            image = tf.image.grayscale_to_rgb(image)
        return to_0_255(image)

    if kwargs.get("cache", kind in ("digits", "arrays")):
        ds = ds.cache()
    if shuffle:
        ds = ds.shuffle(kwargs.get("shuffle_buffer", 10000), seed=seed,
                        reshuffle_each_iteration=True)
    aug = None
    if training:
        aug = augmentation.training_augmentation(
            image_size, inception_crop=inception, flip=flip,
            randaugment=kwargs.get("randaugment"), mixup=kwargs.get("mixup"),
            layers=extra_layers, seed=seed,
            crop_area_range=kwargs.get("crop_area_range", (0.05, 1.0)),
            upstream=kwargs.get("upstream_augmentation", True))
        ds = _tf_training_batches(tf, ds, aug, check_image, len(names), seed, batch_size,
                                  drop_remainder)
    else:
        ds = _tf_evaluation_batches(
            tf, ds, check_image, converter, kwargs.get("eval_crop", "resize"), batch_size,
            drop_remainder, image_converter.resize_small_central_crop_tf)
    ds = ds.prefetch(tf.data.AUTOTUNE)
    distribution = keras.distribution.distribution()
    if distribution is not None:
        ds = distribution.distribute_dataset(ds)
    ds.class_names = list(names)
    ds.num_examples = num_examples
    ds.split_note = note
    # Keras' batch layers and MixUp draw from random state of their own.
    ds.exact_resume = not (training and (aug["per_batch"] or aug["mixup"]))
    return ds


def _tf_training_batches(tf, ds, aug, to_image, num_classes, seed, batch_size,
                         drop_remainder):
    """Augmented training batches in [-1, 1] (one-hot labels with MixUp)."""

    def per_image(example, element_seed):
        image, label = example
        return aug["per_image"](to_image(image), element_seed), label

    def per_batch(images, labels):
        for layer in aug["per_batch"]:
            images = layer(images)
        images = images * (2.0 / 255.0) - 1.0
        if aug["mixup"] is not None:
            onehot = tf.one_hot(tf.cast(labels, "int32"), num_classes)
            mixed = aug["mixup"]({"images": images, "labels": onehot})
            return mixed["images"], mixed["labels"]
        return images, tf.cast(labels, "int32")

    # One stateless seed per example: the crops do not depend on the
    # order in which parallel map calls run (reproducible with `seed`).
    seeds = tf.data.Dataset.random(seed=seed, rerandomize_each_iteration=True)
    ds = tf.data.Dataset.zip((ds, seeds.batch(2)))
    ds = ds.map(per_image, num_parallel_calls=tf.data.AUTOTUNE)
    ds = ds.batch(batch_size, drop_remainder=drop_remainder)
    # Sequential: Keras' random layers draw from a seed generator state.
    return ds.map(per_batch)


def _tf_evaluation_batches(tf, ds, to_image, converter, eval_crop, batch_size,
                           drop_remainder, resize_small_central_crop_tf):
    """Evaluation batches in [-1, 1], resized as `eval_crop` says."""

    def eval_image(image, label):
        integer = image.dtype.is_integer
        image = to_image(image)
        if eval_crop == "resize_small_central_crop":
            # Upstream's area resize of the short side, then the crop.
            image = resize_small_central_crop_tf(image, converter._size)
        elif eval_crop == "resize" and integer:
            # Upstream's `resize(size)` (pp_ops.py): bilinear without
            # antialiasing, cast back to the decoded uint8 (floor).
            image = tf.floor(tf.image.resize(image, converter._size, "bilinear"))
        else:
            return converter.call(image[None])[0], tf.cast(label, "int32")
        return image * (2.0 / 255.0) - 1.0, tf.cast(label, "int32")

    ds = ds.map(eval_image, num_parallel_calls=tf.data.AUTOTUNE)
    return ds.batch(batch_size, drop_remainder=drop_remainder)
