"""`ImageClassifierPreprocessor`: images and labels in any form -> a task's input.

A task's graph takes float32 images in [-1, 1] at its backbone's size; its
`fit`, `evaluate` and `predict` first hand arrays, lists of raw images, `tf.data`
datasets, generators and `PyDataset`s to the preprocessor, which also checks
the labels.
"""

import keras
import numpy as np

from keras_vmoe.data.labels import check_class_ids
from keras_vmoe.preprocessing import ImageConverter
from keras_vmoe.preprocessing.value_range import check_pixel_values
from keras_vmoe.utils.validation import check_pair


def is_tf_dataset(x):
    """A `tf.data.Dataset`, told by class name (TensorFlow is not imported)."""
    return any(
        c.__module__.startswith("tensorflow") and c.__name__ == "DatasetV2"
        for c in type(x).__mro__
    )


def is_array(x):
    """A NumPy/JAX/backend array (not a dataset, dict, list or tuple)."""
    return isinstance(x, np.ndarray) or (
        hasattr(x, "shape") and hasattr(x, "dtype") and not is_tf_dataset(x)
        and not isinstance(x, (dict, list, tuple))
    )


def _is_image_list(x):
    """A non-empty list/tuple of arrays (or PIL-like images): raw images."""
    return (
        isinstance(x, (list, tuple))
        and len(x) > 0
        and all(
            is_array(item) or hasattr(item, "__array_interface__")
            or hasattr(item, "__array__")
            for item in x
        )
        and not all(np.ndim(item) == 0 for item in x)
    )


def passes_unchanged(images, converter):
    """Whether float `(B, H, W, C)` images need no conversion by `converter`."""
    return ("float" in str(images.dtype) and tuple(converter.float_range) == (-1.0, 1.0)
            and len(images.shape) == 4
            and tuple(images.shape[1:3]) == tuple(converter._size))


class _MappedPyDataset(keras.utils.PyDataset):
    """A `PyDataset` whose batches' images go through `convert`."""

    def __init__(self, dataset, convert):
        super().__init__(workers=dataset.workers, use_multiprocessing=(
            dataset.use_multiprocessing), max_queue_size=dataset.max_queue_size)
        self._dataset = dataset
        self._convert = convert

    def __len__(self):
        return len(self._dataset)

    @property
    def num_batches(self):
        return self._dataset.num_batches

    def __getitem__(self, index):
        return _map_images(self._dataset[index], self._convert)

    def on_epoch_begin(self):
        self._dataset.on_epoch_begin()

    def on_epoch_end(self):
        self._dataset.on_epoch_end()


def _map_images(batch, convert):
    """`convert` applied to the images of a batch `x` or `(x, y[, w])`."""
    if isinstance(batch, tuple):
        return (convert(batch[0]), *batch[1:])
    return convert(batch)


@keras.saving.register_keras_serializable(package="keras_vmoe")
class ImageClassifierPreprocessor(keras.layers.Layer):
    """Converts images (and checks labels) for an image classifier.

    Applies the task's `image_converter` wherever a task takes data; calling
    the layer on a tensor converts it in the graph.

    Args:
        image_converter: a `keras_vmoe.preprocessing.ImageConverter`, or
            `None` for `ImageConverter(image_size, upstream_resize=True)`.
        image_size: int or `(height, width)`, the backbone's input size;
            required with the default converter, and a given converter is
            resized to it.
        **kwargs: `keras.layers.Layer` arguments (`name`).

    Examples:

    ```python
    import numpy as np
    import keras_vmoe

    preprocessor = keras_vmoe.models.ImageClassifierPreprocessor(image_size=32)
    images = preprocessor.convert([np.zeros((40, 60, 3), "uint8"),
                                   np.zeros((20, 20, 3), "uint8")])
    print(images.shape, images.dtype)  # (2, 32, 32, 3) float32
    ```
    """

    CHUNK = 256

    def __init__(self, image_converter=None, image_size=None, **kwargs):
        kwargs.setdefault("name", "preprocessor")
        super().__init__(**kwargs)
        if isinstance(image_converter, dict):
            image_converter = keras.layers.deserialize(image_converter)
        if image_converter is None:
            if image_size is None:
                raise ValueError(
                    "`image_size` is required with the default image converter "
                    "(image_converter=None). Received: image_size=None")
            image_converter = ImageConverter(image_size, upstream_resize=True,
                                             name="image_converter")
        elif not isinstance(image_converter, ImageConverter):
            raise ValueError(
                "`image_converter` must be None or a "
                "keras_vmoe.preprocessing.ImageConverter. Received: "
                f"image_converter={image_converter!r}"
            )
        elif image_size is not None and tuple(image_converter._size) != check_pair(
                image_size, "image_size"):
            config = image_converter.get_config()
            config["image_size"] = image_size
            image_converter = ImageConverter.from_config(config)
        self.image_converter = image_converter
        # No weights: built, or every `fit` would re-trace the model to build it.
        self.built = True

    @property
    def image_size(self):
        """`(height, width)` of the converted images."""
        return tuple(self.image_converter._size)

    def resized(self, image_size):
        """This preprocessor for another input size (itself when it fits)."""
        if self.image_size == check_pair(image_size, "image_size"):
            return self
        return type(self).from_config({**self.get_config(), "image_size": image_size})

    def call(self, x, y=None, sample_weight=None):
        """Converts a batch of images in the graph; packs `(x, y, w)` as Keras."""
        x = self.image_converter(x)
        return keras.utils.pack_x_y_sample_weight(x, y, sample_weight)

    def _convert_list(self, images):
        """Raw images `(H, W, 3)` or batches `(b, H, W, 3)` -> one batch."""
        batches = []
        for index, image in enumerate(images):
            image = np.asarray(image)
            if image.ndim == 2:
                raise ValueError(
                    f"Image {index} of the list has shape {image.shape}: a grayscale "
                    "image. Each item must be an RGB image (height, width, 3) or a "
                    "batch (batch, height, width, 3); convert it with "
                    "`np.repeat(image[..., None], 3, axis=-1)`.")
            if image.ndim == 3:
                image = image[None]
            try:
                self.image_converter.check_images(tuple(image.shape), image.dtype)
            except ValueError as error:
                raise ValueError(f"Image {index} of the list: {error}") from None
            if not passes_unchanged(image, self.image_converter):
                image = np.asarray(self.image_converter(image))
            batches.append(np.asarray(image, dtype="float32"))
        return np.concatenate(batches)

    def _convert_array(self, x):
        converter = self.image_converter
        converter.check_images(tuple(x.shape), x.dtype)
        check_pixel_values(x, tuple(converter.float_range))
        if passes_unchanged(x, converter):
            return x
        chunks = [np.asarray(converter(x[i:i + self.CHUNK]))
                  for i in range(0, len(x), self.CHUNK)]
        return np.concatenate(chunks) if chunks else x

    def convert(self, x):
        """`x` (an array, a list of raw images, a `tf.data` dataset, a generator
        or a `PyDataset` of images or `(x, y[, w])` batches) with its images
        converted as the task's graph takes them; anything else unchanged."""
        if _is_image_list(x):
            return self._convert_list(x)
        if is_tf_dataset(x):
            converter = self.image_converter
            return x.map(lambda images, *rest: (converter.call(images), *rest))
        if isinstance(x, keras.utils.PyDataset):
            return _MappedPyDataset(x, self.convert)
        if hasattr(x, "__next__") and hasattr(x, "__iter__") and not is_array(x):
            return (_map_images(batch, self.convert) for batch in x)
        if not is_array(x):
            return x
        return self._convert_array(x)

    def check_labels(self, x, y, num_classes, sparse, where):
        """Checks labels `y` (or those of a `tf.data` dataset `x`, as they
        stream): class ids (`sparse`) below `num_classes`, finite values.
        Returns `x` (a dataset with the checks mapped in); `where` names the
        call in messages."""
        if y is not None and is_array(y):
            check_class_ids(y, num_classes if sparse else None, where,
                            name="labels `y`")
            return x
        if y is None and is_tf_dataset(x) and num_classes:
            return x.map(_streaming_label_check(num_classes, sparse, where))
        return x

    def get_config(self):
        config = super().get_config()
        config["image_converter"] = keras.layers.serialize(self.image_converter)
        return config


def _streaming_label_check(num_classes, sparse, where):
    import tensorflow as tf

    def check(images, labels, *rest):
        checks = []
        if labels.dtype.is_floating:
            checks.append(tf.debugging.assert_all_finite(
                labels, f"{where}: the labels contain NaN or inf values"))
        if sparse:
            message = (f"{where}: labels must be integer class ids in "
                       f"[0, {num_classes - 1}] ({num_classes} classes)")
            checks.append(tf.debugging.assert_non_negative(labels, message=message))
            checks.append(tf.debugging.assert_less(
                tf.cast(labels, "float32"), float(num_classes), message=message))
        with tf.control_dependencies(checks):
            labels = tf.identity(labels)
        return (images, labels, *rest)

    return check
