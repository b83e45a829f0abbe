"""Class labels: the ImageNet-1k class names, and one check of integer
class-id labels shared by the pipelines and the tasks."""

import functools
import os

import numpy as np


@functools.cache
def _imagenet_class_names():
    path = os.path.join(os.path.dirname(__file__), "imagenet2012_labels.txt")
    with open(path, encoding="utf-8") as f:
        return tuple(line.rstrip("\n") for line in f)


def imagenet_class_names():
    """The 1,000 ILSVRC-2012 (ImageNet-1k) class names, in class-id order.

    The classes the released ILSVRC presets predict; shipped in the package
    (see `LABELS_NOTICE.md`), no download.

    Returns:
        A new list of 1,000 strings.

    Examples:
        >>> from keras_vmoe.data import imagenet_class_names
        >>> names = imagenet_class_names()
        >>> len(names), names[0]
        (1000, 'tench, Tinca tinca')
    """
    return list(_imagenet_class_names())


def check_class_ids(labels, num_classes, where, name="labels"):
    """Raises a clear `ValueError` for labels that are not valid class ids.

    Args:
        labels: array-like of labels.
        num_classes: int, or None to check only for NaN/inf (soft labels).
        where: what is being checked, starting the message (e.g. `"fit"`).
        name: how the message calls the labels.

    Raises:
        ValueError: NaN/inf, non-integer or non-numeric values, or values
            outside `[0, num_classes - 1]`.
    """
    labels = np.asarray(labels)
    if labels.dtype.kind == "f" and not np.all(np.isfinite(labels)):
        raise ValueError(f"{where}: the {name} contain NaN or inf values.")
    if not num_classes:
        return
    if labels.dtype.kind == "f" and not np.all(labels == np.round(labels)):
        raise ValueError(f"{where}: {name} must be integer class ids in "
                         f"[0, {num_classes - 1}]; received non-integer values.")
    if labels.dtype.kind not in "iufb":
        raise ValueError(f"{where}: {name} must be integer class ids; received "
                         f"dtype {labels.dtype}.")
    if labels.size and (labels.min() < 0 or labels.max() >= num_classes):
        raise ValueError(
            f"{where}: {name} must be in [0, {num_classes - 1}] ({num_classes} "
            f"classes). Received values in [{labels.min()}, {labels.max()}].")
