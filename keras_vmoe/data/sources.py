"""Data sources: unbatched `tf.data` datasets of `(image, label)`.

Every source yields images with values in [0, 255] (uint8, or float32 for
image folders) and int labels, plus its list of class names.
"""

import os
import re

import numpy as np

from keras_vmoe.data.labels import check_class_ids

DIGITS_SPLITS = {"train": 1437, "test": 360}
_DIGITS_SEED = 20240101
_IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".gif")
_SLICE = re.compile(r"^(?P<name>[A-Za-z0-9_]+)(\[(?P<start>-?\d*%?):(?P<stop>-?\d*%?)\])?$")


def _parse_split(split):
    match = _SLICE.match(str(split).replace(" ", ""))
    if match is None:
        raise ValueError(
            f"Invalid `split` {split!r}: expected NAME or NAME[start:stop] with "
            "integers or percentages, e.g. 'train', 'train[:90%]', 'train[100:]'."
        )
    return match["name"], match["start"] or None, match["stop"] or None


def _slice_index(bound, n):
    if bound is None:
        return None
    if bound.endswith("%"):
        return round(int(bound[:-1]) * n / 100)
    return int(bound)


def slice_arrays(images, labels, start, stop):
    n = len(images)
    sl = slice(_slice_index(start, n), _slice_index(stop, n))
    return images[sl], labels[sl]


def load_digits_arrays(split="train"):
    """scikit-learn's handwritten digits as uint8 RGB `(N, 8, 8, 3)` and labels.

    A fixed permutation (seeded) splits the 1,797 images into `"train"`
    (1,437) and `"test"` (360); `split` also accepts slices such as
    `"train[:90%]"`.
    """
    from sklearn.datasets import load_digits

    name, start, stop = _parse_split(split)
    if name not in DIGITS_SPLITS:
        raise ValueError(
            f"Unknown digits split {name!r}. Valid splits: {sorted(DIGITS_SPLITS)}."
        )
    digits = load_digits()
    order = np.random.default_rng(_DIGITS_SEED).permutation(len(digits.target))
    n_train = DIGITS_SPLITS["train"]
    index = order[:n_train] if name == "train" else order[n_train:]
    # Pixel values are 0..16: scale to 0..255, grey -> RGB.
    images = np.round(digits.images[index] * (255.0 / 16.0)).astype("uint8")
    images = np.repeat(images[..., None], 3, axis=-1)
    labels = digits.target[index].astype("int32")
    return slice_arrays(images, labels, start, stop)


# Most classes `derived_class_names` makes up ("0", "1", ...): more means
# labels that are not class ids (ImageNet-21k has 21,843 classes).
MAX_DERIVED_CLASSES = 100_000


def derived_class_names(labels, where):
    """`["0", ..., str(max label)]` for integer labels without class names.

    Raises:
        ValueError: non-numeric (e.g. string), non-integer, negative or
            non-finite labels, or a largest label above
            `MAX_DERIVED_CLASSES - 1` (a list of that many names would not
            fit in memory; pass `class_names` or relabel to 0..K-1).
    """
    labels = np.asarray(labels)
    if labels.dtype.kind not in "iufb":
        raise ValueError(
            f"{where}: labels must be integer class ids 0..K-1; received dtype "
            f"{labels.dtype} (e.g. {labels.flat[0]!r}). Map names to ids first "
            "and pass the names as `class_names`."
        )
    check_class_ids(labels, None, where)  # NaN / inf
    largest = int(labels.max()) if labels.size else 0
    check_class_ids(labels, max(largest + 1, 1), where)  # integers, >= 0
    if largest >= MAX_DERIVED_CLASSES:
        raise ValueError(
            f"{where}: the largest label is {largest}; without `class_names` the "
            f"classes would be 0..{largest}. At most {MAX_DERIVED_CLASSES} classes "
            "are derived from the labels: pass `class_names`, or relabel the "
            "classes to 0..K-1."
        )
    return [str(i) for i in range(largest + 1)]


def array_source(images, labels, class_names=None):
    """`(images, labels)` NumPy arrays -> (dataset, class names)."""
    import tensorflow as tf

    images = np.asarray(images)
    labels = np.asarray(labels)
    if images.ndim == 3:
        images = images[..., None]
    if images.ndim != 4 or images.shape[-1] not in (1, 3):
        raise ValueError(
            "Array images must have shape (N, H, W, 3) or (N, H, W) / (N, H, W, 1) "
            f"(grayscale). Received: shape={images.shape}."
        )
    if labels.shape[:1] != images.shape[:1] or labels.ndim != 1:
        raise ValueError(
            f"`labels` must have shape (N,) with N = {len(images)} images. "
            f"Received: shape={labels.shape}."
        )
    if len(images) == 0:
        raise ValueError("The (images, labels) arrays are empty.")
    if class_names is None:
        class_names = derived_class_names(labels, "load_dataset((images, labels))")
    check_class_ids(labels, len(class_names), "load_dataset((images, labels))")
    if images.shape[-1] == 1:
        images = np.repeat(images, 3, axis=-1)
    ds = tf.data.Dataset.from_tensor_slices((images, labels.astype("int32")))
    return ds, list(class_names)


def tfds_builder(name, data_dir=None):
    """The TFDS builder of `name` and its class names (clear errors)."""
    try:
        import tensorflow_datasets as tfds
    except ImportError as error:  # pragma: no cover - optional dependency
        raise ValueError(
            f"Dataset 'tfds:{name}' needs tensorflow-datasets: "
            "pip install 'keras-vmoe[data]'."
        ) from error
    try:
        builder = tfds.builder(name, data_dir=data_dir)
    except Exception as error:  # tfds raises DatasetNotFoundError and others
        raise ValueError(
            f"Unknown TFDS dataset {name!r} (spec 'tfds:{name}'): {error}"
        ) from None
    try:
        names = list(builder.info.features["label"].names)
    except (KeyError, AttributeError, TypeError):
        raise ValueError(
            f"TFDS dataset {name!r} has no ClassLabel 'label' feature.") from None
    return builder, names


def tfds_source(name, split, shuffle_files=False, data_dir=None):
    """`tfds:NAME` -> (dataset, class names), with TFDS split slicing."""
    import tensorflow_datasets as tfds

    _, names = tfds_builder(name, data_dir)
    ds = tfds.load(name, split=split, as_supervised=True,
                   shuffle_files=shuffle_files, data_dir=data_dir)
    return ds, names


def _class_dirs(root):
    return sorted(
        d for d in os.listdir(root)
        if os.path.isdir(os.path.join(root, d)) and not d.startswith(".")
    )


def _has_images(folder):
    for _, _, files in os.walk(folder):
        if any(f.lower().endswith(_IMAGE_EXTENSIONS) for f in files):
            return True
    return False


def folder_root(path, split):
    """The class-folder root for `split` (a `split/` sub-folder if present)."""
    if not os.path.isdir(path):
        raise FileNotFoundError(f"Image folder {path!r} does not exist.")
    name, start, stop = _parse_split(split)
    split_dir = os.path.join(path, name)
    root = path
    if os.path.isdir(split_dir) and _class_dirs(split_dir):
        # root/<split>/<class>/*.jpg (e.g. train/ and test/ folders).
        root = split_dir
    classes = _class_dirs(root)
    if not classes or not _has_images(root):
        raise ValueError(
            f"Image folder {root!r} has no class sub-folders with images "
            f"({', '.join(_IMAGE_EXTENSIONS)}). Expected {root}/<class>/<image>."
        )
    return root, classes, (start, stop)


def folder_source(path, split, image_size, seed):
    """Image folder -> (dataset of float [0, 255] images, class names).

    Uses `keras.utils.image_dataset_from_directory` (decoding, class
    inference). Without `split/` sub-folders, `split` slices with a
    seeded shuffle of the files: `"train[:80%]"` / `"train[80%:]"`.
    """
    import keras

    root, classes, (start, stop) = folder_root(path, split)
    subset = fraction = None
    if start or stop:
        if start is None and stop and stop.endswith("%"):
            subset, fraction = "training", 1 - int(stop[:-1]) / 100
        elif stop is None and start and start.endswith("%"):
            subset, fraction = "validation", 1 - int(start[:-1]) / 100
        else:
            raise ValueError(
                f"Image folders support the slices NAME[:P%] and NAME[P%:] only "
                f"(P% of the files, seeded shuffle). Received: split={split!r}"
            )
        if not 0 < fraction < 1:
            raise ValueError(f"Slice percentage out of (0, 100): split={split!r}")
    size = image_size if isinstance(image_size, (list, tuple)) else (
        image_size, image_size)
    ds = keras.utils.image_dataset_from_directory(
        root, labels="inferred", label_mode="int", class_names=classes,
        color_mode="rgb", batch_size=None, image_size=tuple(size),
        shuffle=bool(subset), seed=seed, validation_split=fraction,
        subset=subset, crop_to_aspect_ratio=True, verbose=False,
    )
    return ds, classes
