"""Data sources: unbatched `tf.data` datasets of `(image, label)`.

Every source yields images with values in [0, 255] (uint8, or float32 for
image folders) and int labels, plus its list of class names.
"""

import functools
import hashlib
import os
import re

import numpy as np

from keras_vmoe.data import images as image_files
from keras_vmoe.data.labels import check_class_ids
from keras_vmoe.utils.extras import require

DIGITS_SPLITS = {"train": 1437, "test": 360}
_DIGITS_SEED = 20240101
_IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".gif")  # tf.io.decode_image
_SLICE = re.compile(r"^(?P<name>[A-Za-z0-9_]+)(\[(?P<start>-?\d*%?):(?P<stop>-?\d*%?)\])?$")


def _parse_split(split):
    match = _SLICE.match(str(split).replace(" ", ""))
    if match is None:
        raise ValueError(
            f"Invalid `split` {split!r}: expected NAME or NAME[start:stop] with "
            "integers or percentages, e.g. 'train', 'train[:90%]', 'train[100:]'.")
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


def split_arrays(spec, split, float_range):
    """The `split` slice of `spec = (images, labels)`, pixel values checked."""
    from keras_vmoe.preprocessing import value_range  # lazy: data needs no Keras

    images, labels = slice_arrays(*spec, *_parse_split(split)[1:])
    value_range.check_pixel_values(
        images, float_range, declare="float_range=({low}, {high})")
    return images, labels


def digits_raw():
    """scikit-learn's `load_digits()` from `digits.npz` (see `DIGITS_NOTICE.md`).

    Returns `(images (1797, 8, 8) float64 in 0..16, labels (1797,) int64)`.
    """
    path = os.path.join(os.path.dirname(__file__), "digits.npz")
    with np.load(path) as f:
        return f["images"].astype("float64"), f["labels"].astype("int64")


def load_digits_arrays(split="train"):
    """The embedded digits as uint8 RGB `(N, 8, 8, 3)` and int32 labels.

    A fixed permutation splits the 1,797 images into `"train"` (1,437) and
    `"test"` (360); `split` also accepts slices such as `"train[:90%]"`.
    """
    name, start, stop = _parse_split(split)
    if name not in DIGITS_SPLITS:
        raise ValueError(
            f"Unknown digits split {name!r}. Valid splits: {sorted(DIGITS_SPLITS)}.")
    all_images, all_labels = digits_raw()
    order = np.random.default_rng(_DIGITS_SEED).permutation(len(all_labels))
    n_train = DIGITS_SPLITS["train"]
    index = order[:n_train] if name == "train" else order[n_train:]
    # Pixel values are 0..16: scale to 0..255, grey -> RGB.
    images = np.round(all_images[index] * (255.0 / 16.0)).astype("uint8")
    images = np.repeat(images[..., None], 3, axis=-1)
    labels = all_labels[index].astype("int32")
    return slice_arrays(images, labels, start, stop)


# Most classes `derived_class_names` makes up ("0", "1", ...): more means
# labels that are not class ids (ImageNet-21k has 21,843 classes).
MAX_DERIVED_CLASSES = 100_000


def derived_class_names(labels, where):
    """`["0", ..., str(max label)]` for integer labels without class names.

    Raises:
        ValueError: non-numeric, non-integer, negative or non-finite labels, or
            a largest label of `MAX_DERIVED_CLASSES` or more.
    """
    labels = np.asarray(labels)
    if labels.dtype.kind not in "iufb":
        raise ValueError(
            f"{where}: labels must be integer class ids 0..K-1; received dtype "
            f"{labels.dtype} (e.g. {labels.flat[0]!r}). Map names to ids first "
            "and pass the names as `class_names`.")
    check_class_ids(labels, None, where)  # NaN / inf
    largest = int(labels.max()) if labels.size else 0
    check_class_ids(labels, max(largest + 1, 1), where)  # integers, >= 0
    if largest >= MAX_DERIVED_CLASSES:
        raise ValueError(
            f"{where}: the largest label is {largest}; without `class_names` the "
            f"classes would be 0..{largest}. At most {MAX_DERIVED_CLASSES} classes "
            "are derived from the labels: pass `class_names`, or relabel the "
            "classes to 0..K-1.")
    return [str(i) for i in range(largest + 1)]


def array_source(images, labels, class_names=None):
    """`(images, labels)` NumPy arrays -> (dataset, class names)."""
    tf = require("tensorflow", "The tf.data pipeline (pipeline='tf')")
    images, labels, class_names = check_arrays(images, labels, class_names)
    return tf.data.Dataset.from_tensor_slices((images, labels)), class_names


def check_arrays(images, labels, class_names=None):
    """Checked `(images (N, H, W, 3), int32 labels (N,), class names)`.

    Grayscale `(N, H, W)` / `(N, H, W, 1)` images become RGB.
    """
    images = np.asarray(images)
    labels = np.asarray(labels)
    if images.ndim == 3:
        images = images[..., None]
    if images.ndim != 4 or images.shape[-1] not in (1, 3):
        raise ValueError(
            "Array images must have shape (N, H, W, 3) or (N, H, W) / (N, H, W, 1) "
            f"(grayscale). Received: shape={images.shape}.")
    if labels.shape[:1] != images.shape[:1] or labels.ndim != 1:
        raise ValueError(
            f"`labels` must have shape (N,) with N = {len(images)} images. "
            f"Received: shape={labels.shape}.")
    if len(images) == 0:
        raise ValueError("The (images, labels) arrays are empty.")
    if class_names is None:
        class_names = derived_class_names(labels, "load_dataset((images, labels))")
    check_class_ids(labels, len(class_names), "load_dataset((images, labels))")
    if images.shape[-1] == 1:
        images = np.repeat(images, 3, axis=-1)
    return images, labels.astype("int32"), list(class_names)


def tfds_builder(name, data_dir=None):
    """The TFDS builder of `name` and its class names (clear errors)."""
    try:
        import tensorflow_datasets as tfds
    except ImportError as error:
        raise ValueError(
            f"Dataset 'tfds:{name}' needs tensorflow-datasets and what it imports "
            f"({type(error).__name__}: {error}): pip install 'keras-vmoe[data]'."
        ) from error
    try:
        builder = tfds.builder(name, data_dir=data_dir)
    except Exception as error:  # tfds raises DatasetNotFoundError and others
        raise ValueError(
            f"Unknown TFDS dataset {name!r} (spec 'tfds:{name}'): {error}") from None
    try:
        names = list(builder.info.features["label"].names)
    except (KeyError, AttributeError, TypeError):
        raise ValueError(
            f"TFDS dataset {name!r} has no ClassLabel 'label' feature.") from None
    return builder, names


def tfds_source(name, split, shuffle_files=False, data_dir=None, download=False):
    """`tfds:NAME` -> (dataset, class names); prepared already unless `download`."""
    import tensorflow_datasets as tfds

    builder, names = tfds_builder(name, data_dir)
    try:
        ds = tfds.load(name, split=split, as_supervised=True,
                       shuffle_files=shuffle_files, data_dir=data_dir,
                       download=download)
    except AssertionError as error:  # TFDS: "could not find data in ..."
        if download or "download_and_prepare" not in str(error):
            raise
        raise ValueError(
            f"TFDS dataset {name!r} is not prepared in {builder.data_dir!r}, and "
            "downloading it is off. On a machine with network access run "
            f"`tfds build {name}` (with --data_dir to choose the folder; pass the "
            "same folder as data_dir here), or allow the download with "
            "download=True (`keras-vmoe finetune --download`).") from None
    except (OSError, ConnectionError) as error:
        raise ValueError(
            f"Could not download TFDS dataset {name!r} ({type(error).__name__}: "
            f"{error}). Without network access, run `tfds build {name}` on a "
            "connected machine and copy its data_dir here.") from None
    return ds, names


def _hidden(name):
    # Dot folders (.git, .ipynb_checkpoints) and archivers' metadata
    # (__MACOSX) are never classes.
    return name.startswith(".") or (name.startswith("__") and name.endswith("__")) \
        or name == "__MACOSX"


def _class_dirs(root):
    return sorted(d for d in os.listdir(root)
                  if os.path.isdir(os.path.join(root, d)) and not _hidden(d))


def _image_files(folder):
    found = []
    for parent, dirs, files in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if not _hidden(d))
        found += [os.path.join(parent, f) for f in sorted(files)
                  if f.lower().endswith(_IMAGE_EXTENSIONS) and not f.startswith(".")]
    return found


# A folder without split sub-folders: this fraction of each class's images
# (at least one when a class has two or more) is held out as "test".
HOLDOUT_FRACTION = 0.2
_HOLDOUT_SPLITS = ("train", "test")
_SPLIT_NAMES = ("train", "training", "test", "testing", "val", "valid", "validation",
                "eval", "evaluation")


def _holdout_key(root, path):
    # A hash of the relative path: the hold-out depends on no seed, machine
    # or listing order.
    relative = os.path.relpath(path, root).replace(os.sep, "/")
    return hashlib.sha256(relative.encode("utf-8")).hexdigest()


def folder_root(path, split):
    """The class-folder root for `split` (a `split/` sub-folder if present).

    Returns:
        `(root, classes, (start, stop), held_out)`; `held_out`: no split
        sub-folders, the split is the hold-out's "train" or "test" part.
    """
    if not os.path.isdir(path):
        raise FileNotFoundError(f"Image folder {path!r} does not exist.")
    name, start, stop = _parse_split(split)
    split_dir = os.path.join(path, name)
    root, held_out = path, False
    if os.path.isdir(split_dir) and _class_dirs(split_dir):
        # root/<split>/<class>/*.jpg (e.g. train/ and test/ folders).
        root = split_dir
    else:
        splits = [d for d in _class_dirs(path) if d.lower() in _SPLIT_NAMES
                  and _class_dirs(os.path.join(path, d))]
        if splits:
            raise ValueError(
                f"Image folder {path!r} has split sub-folders {splits} but no "
                f"{name!r}: use one of them as the split.")
        if name not in _HOLDOUT_SPLITS:
            raise ValueError(
                f"Image folder {path!r} has no split sub-folders, so its splits are "
                f"'train' ({100 - HOLDOUT_FRACTION * 100:.0f}% of each class) and "
                f"'test' (the other {HOLDOUT_FRACTION * 100:.0f}%, chosen by a hash "
                f"of the file names). Received: split={split!r}")
        held_out = True
    classes = _class_dirs(root)
    if root != path:
        # train/{a,b} with test/{a,c}: the same id would mean b and c.
        for other in _class_dirs(path):
            other_dir = os.path.join(path, other)
            if other.lower() not in _SPLIT_NAMES or other_dir == root:
                continue
            others = _class_dirs(other_dir)
            if others and others != classes:
                only_here = sorted(set(classes) - set(others))
                only_there = sorted(set(others) - set(classes))
                raise ValueError(
                    f"Image folder {path!r}: split {name!r} has classes {classes} but "
                    f"{other!r} has {others} (only in {name!r}: {only_here}; only in "
                    f"{other!r}: {only_there}); a class id would mean different "
                    "classes in the two splits. Give every split the same class "
                    "folders (an empty one is refused too).")
    if not classes or not _image_files(root):
        raise ValueError(
            f"Image folder {root!r} has no class sub-folders with images "
            f"({', '.join(_IMAGE_EXTENSIONS)}). Expected {root}/<class>/<image>.")
    return root, classes, (start, stop), held_out


def folder_files(path, split, check=True, decode_limit=2000):
    """`_folder_files`, cached until the folder changes (a run lists it often)."""
    path = os.path.abspath(os.fspath(path))
    files, labels, classes, note = _folder_files(
        path, str(split), check, decode_limit, _listing_stamp(path))
    return list(files), np.asarray(labels, "int32"), list(classes), note


def _listing_stamp(path):
    """Modification times of the folders a listing reads (a cache key)."""
    stamp = []
    for parent, dirs, _ in os.walk(path):
        dirs[:] = sorted(d for d in dirs if not _hidden(d))
        try:
            stamp.append((parent, os.stat(parent).st_mtime_ns))
        except OSError:
            stamp.append((parent, None))
    return tuple(stamp)


@functools.lru_cache(maxsize=32)
def _folder_files(path, split, check=True, decode_limit=2000, stamp=None):
    """`(files, labels, classes, note)` of a folder split, unusable files skipped.

    Each file is checked (`inspect_image`, decoded when the split has at most
    `decode_limit` files); a skipped one gets a warning line. `note` says how
    a folder without split sub-folders was split, else None.
    """
    root, classes, (start, stop), held_out = folder_root(path, split)
    name = _parse_split(split)[0]
    files, labels = [], []
    for label, cls in enumerate(classes):
        found = _image_files(os.path.join(root, cls))
        if held_out:
            found.sort(key=lambda f: _holdout_key(root, f))
            n_test = 0 if len(found) < 2 else max(1, round(HOLDOUT_FRACTION * len(found)))
            found = sorted(found[:n_test] if name == "test" else found[n_test:])
        files += found
        labels += [label] * len(found)
    if start or stop:
        order = sorted(range(len(files)), key=lambda i: _holdout_key(root, files[i]))
        n = len(order)
        keep = sorted(order[slice(_slice_index(start, n), _slice_index(stop, n))])
        files, labels = [files[i] for i in keep], [labels[i] for i in keep]
    if check:
        decode = len(files) <= decode_limit
        good = []
        for i, f in enumerate(files):
            reason = image_files.inspect_image(f, image_files.PIPELINE_FORMATS, decode)
            if reason is None:
                good.append(i)
            else:
                image_files.warn_skipped(f, reason)
        files, labels = [files[i] for i in good], [labels[i] for i in good]
    present = set(labels)
    empty = [cls for label, cls in enumerate(classes) if label not in present]
    # Slices and a small class's held-out part may leave a class out.
    if files and empty and not (start or stop) and not (held_out and name == "test"):
        raise ValueError(
            f"Image folder {path!r}, split {split!r}: class folder(s) {empty} hold no "
            f"usable images ({', '.join(_IMAGE_EXTENSIONS)}; see the warnings above "
            "for skipped files). Add images, or remove the folder(s) so that they "
            "are not classes.")
    if not files:
        raise ValueError(
            f"Image folder {path!r}, split {split!r}: no usable images "
            f"({', '.join(_IMAGE_EXTENSIONS)}).")
    note = None
    if held_out:
        note = (f"{path} has no split sub-folders: split {name!r} is "
                + ("the held-out " if name == "test" else "all but the held-out ")
                + f"{HOLDOUT_FRACTION * 100:.0f}% of each class's images (chosen by a "
                "hash of the file names)")
    return tuple(files), tuple(labels), tuple(classes), note


def exif_orientation(path):
    """The EXIF orientation tag of an image file (1, upright, when absent)."""
    from PIL import Image

    try:
        with Image.open(path) as image:
            value = image.getexif().get(0x0112, 1)
    except (OSError, SyntaxError, ValueError):
        return 1
    return value if isinstance(value, int) and 1 <= value <= 8 else 1


def orient(image, orientation):
    """Applies an EXIF orientation (1-8) to an `(H, W, C)` image tensor.

    The transposition of `PIL.ImageOps.exif_transpose` (NumPy pipeline, `predict`).
    """
    import tensorflow as tf

    return tf.switch_case(tf.clip_by_value(orientation, 1, 8) - 1, [
        lambda: image,  # 1: upright
        lambda: tf.reverse(image, [1]),
        lambda: tf.image.rot90(image, 2),
        lambda: tf.reverse(image, [0]),
        lambda: tf.transpose(image, [1, 0, 2]),
        lambda: tf.image.rot90(image, 3),
        lambda: tf.image.rot90(tf.transpose(image, [1, 0, 2]), 2),
        lambda: tf.image.rot90(image, 1),
    ])


def folder_source(path, split):
    """Image folder -> (dataset of [0, 255] images at their own size, classes, note).

    Files are checked (`folder_files`), then decoded with `tf.io.decode_image`:
    as upstream, the crop and the evaluation resize work on the decoded image.
    """
    import tensorflow as tf

    files, labels, classes, note = folder_files(path, split)
    orientations = np.asarray([exif_orientation(f) for f in files], "int32")

    def load(file, label, orientation):
        image = tf.io.decode_image(tf.io.read_file(file), channels=3,
                                   expand_animations=False)
        return orient(image, orientation), label

    ds = tf.data.Dataset.from_tensor_slices((files, labels, orientations)).map(
        load, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    return ds, classes, note
