"""Batches of `(images, labels)` from arrays or from an iterable of batches."""

import numpy as np

from keras_vmoe.utils.validation import check_int


def get_backbone(model_or_backbone):
    """The `VisionTransformerBackbone` of a task (or the backbone itself)."""
    backbone = getattr(model_or_backbone, "backbone", model_or_backbone)
    if not hasattr(backbone, "get_moe_layers"):
        raise ValueError(
            "Expected a keras_vmoe task (ImageClassifier, EnsembleImageClassifier) "
            "or a VisionTransformerBackbone. Received: "
            f"{type(model_or_backbone).__name__}"
        )
    return backbone


def _as_array(value):
    if hasattr(value, "numpy"):
        value = value.numpy()
    return np.asarray(value)


def iterate_batches(images, labels=None, batch_size=32):
    """Yields `(images, labels_or_None)` NumPy batches of an array or iterable."""
    batch_size = check_int(batch_size, "batch_size")
    if isinstance(images, np.ndarray) or (
            hasattr(images, "__array__") and not hasattr(images, "as_numpy_iterator")):
        images = np.asarray(images)
        if images.ndim != 4:
            raise ValueError(
                "`images` must be a (batch, height, width, channels) array. "
                f"Received shape {images.shape}."
            )
        if labels is not None:
            labels = np.asarray(labels).reshape(-1)
            if labels.shape[0] != images.shape[0]:
                raise ValueError(
                    f"`labels` has {labels.shape[0]} entries for {images.shape[0]} images."
                )
        for start in range(0, images.shape[0], batch_size):
            stop = start + batch_size
            yield images[start:stop], None if labels is None else labels[start:stop]
        return
    if labels is not None:
        raise ValueError(
            "`labels` must be None when `images` is an iterable of batches; "
            "yield (images, labels) pairs instead."
        )
    if hasattr(images, "as_numpy_iterator"):
        images = images.as_numpy_iterator()
    for batch in images:
        if isinstance(batch, dict):
            batch = (batch["images"], batch.get("labels"))
        if not isinstance(batch, (tuple, list)):
            batch = (batch,)
        y = None if len(batch) < 2 or batch[1] is None else _as_array(batch[1])
        if y is not None and y.ndim == 2 and y.shape[-1] > 1:
            y = y.argmax(-1)  # one-hot or soft (MixUp) labels
        yield _as_array(batch[0]), None if y is None else y.reshape(-1)


def collect(images, labels=None, batch_size=32):
    """All batches concatenated: `(images, labels_or_None)` arrays."""
    batches = list(iterate_batches(images, labels, batch_size))
    if not batches:
        raise ValueError("The evaluation data is empty.")
    xs, ys = zip(*batches, strict=True)
    has_labels = all(y is not None for y in ys)
    return np.concatenate(xs), np.concatenate(ys) if has_labels else None
