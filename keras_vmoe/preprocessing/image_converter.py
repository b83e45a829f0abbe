"""`ImageConverter`: raw images -> the backbone's input ([-1, 1], model size)."""

import keras

from keras_vmoe.preprocessing.value_range import check_float_range
from keras_vmoe.utils.validation import check_bool
from keras_vmoe.utils.validation import check_one_of

CROP_MODES = ("resize", "central_crop", "resize_small_central_crop")
# Upstream evaluates its 224-px models with `resize_small(256)|central_crop(224)`.
RESIZE_SMALL_RATIO = 256 / 224


def resize_small_geometry(height, width, size):
    """`(new_height, new_width, offset_y, offset_x)` of upstream's
    `resize_small(min(size)·256/224)|central_crop(size)`."""
    size_h, size_w = size
    small = round(min(size_h, size_w) * RESIZE_SMALL_RATIO)
    ratio = small / min(height, width)
    new_h, new_w = max(round(height * ratio), size_h), max(round(width * ratio), size_w)
    return new_h, new_w, (new_h - size_h) // 2, (new_w - size_w) // 2


def resize_small_central_crop_tf(images, size, method="area", antialias=False):
    """`resize_small|central_crop` in TensorFlow, for (B,)H,W,C tensors of any
    size (upstream's evaluation preprocessing with `method="area"`)."""
    import tensorflow as tf

    size_h, size_w = size
    small = float(round(min(size_h, size_w) * RESIZE_SMALL_RATIO))
    shape = tf.shape(images)
    h, w = shape[-3], shape[-2]
    ratio = small / tf.cast(tf.minimum(h, w), tf.float32)
    new_h = tf.maximum(tf.cast(tf.round(tf.cast(h, tf.float32) * ratio), tf.int32), size_h)
    new_w = tf.maximum(tf.cast(tf.round(tf.cast(w, tf.float32) * ratio), tf.int32), size_w)
    resized = tf.image.resize(tf.cast(images, tf.float32), tf.stack([new_h, new_w]),
                              method=method, antialias=antialias)
    dy, dx = (new_h - size_h) // 2, (new_w - size_w) // 2
    return tf.image.crop_to_bounding_box(resized, dy, dx, size_h, size_w)


def _rescaling_args(low, high):
    """Scale and offset of the affine map [low, high] -> [-1, 1]."""
    scale = 2.0 / (high - low)
    return scale, -1.0 - low * scale


@keras.saving.register_keras_serializable(package="keras_vmoe")
class ImageConverter(keras.layers.Layer):
    """Maps raw images to the model's input: float32 in [-1, 1] at `image_size`.

    Integer images are read as [0, 255], float images as `float_range`
    (default (-1, 1), so converted inputs pass through unchanged). Batches
    must be `(B, H, W, 3)`; runs on any backend and inside `tf.data`.

    Args:
        image_size: int or (int, int), the model resolution.
        crop: `"resize"` (upstream's `resize(size)`),
            `"resize_small_central_crop"` (short side to `size·256/224`, then
            the central crop) or `"central_crop"` (largest central square).
        float_range: (low, high), the value range of float inputs.
        interpolation: resize interpolation (`"bilinear"`, `"bicubic"`, ...).
        antialias: bool, antialias when downsizing (ignored with
            `upstream_resize`).
        upstream_resize: bool, with `crop="resize"`, resize as upstream's
            evaluation: integer images bilinear without antialiasing, floored
            to uint8 before the value range; floats without antialiasing.
        **kwargs: `keras.layers.Layer` arguments.

    Examples:

    ```python
    import numpy as np
    import keras_vmoe

    converter = keras_vmoe.preprocessing.ImageConverter(64, float_range=(0, 1))
    x = converter(np.random.rand(2, 100, 80, 3))     # (2, 64, 64, 3) in [-1, 1]
    ```
    """

    def __init__(self, image_size, crop="resize", float_range=(-1.0, 1.0),
                 interpolation="bilinear", antialias=True, upstream_resize=False,
                 **kwargs):
        kwargs.setdefault("dtype", "float32")
        super().__init__(**kwargs)
        size = tuple(image_size) if isinstance(image_size, (list, tuple)) else (
            image_size, image_size)
        if len(size) != 2 or not all(
                isinstance(s, int) and not isinstance(s, bool) and s > 0 for s in size):
            raise ValueError("`image_size` must be a positive int or a pair of them. "
                             f"Received: image_size={image_size!r}")
        self.image_size = image_size
        self.crop = check_one_of(crop, "crop", CROP_MODES)
        self.float_range = check_float_range(float_range)
        self.interpolation = interpolation
        self.upstream_resize = check_bool(upstream_resize, "upstream_resize")
        self.antialias = bool(antialias) and not self.upstream_resize
        self._size = size
        self._resize = keras.layers.Resizing(
            *size, interpolation=interpolation, antialias=self.antialias,
            crop_to_aspect_ratio=crop == "central_crop", dtype="float32", name="resize")
        self._int_rescale = keras.layers.Rescaling(
            *_rescaling_args(0.0, 255.0), dtype="float32", name="int_rescale")
        self._float_rescale = keras.layers.Rescaling(
            *_rescaling_args(*self.float_range), dtype="float32", name="float_rescale")
        # Built now: an unbuilt layer would make `fit` read an extra batch to
        # build it, shifting a resumed run's data.
        self.build()

    def build(self, input_shape=None):
        # No weights: the converter and its stateless sublayers are built.
        for layer in (self._resize, self._int_rescale, self._float_rescale):
            layer.built = True
        self.built = True

    def check_images(self, shape, dtype):
        """Raises a clear `ValueError` unless `shape` is `(B, H, W, 3)`."""
        if len(shape) != 4:
            hint = " For one image, add a batch axis (`images[None]`)."
            raise ValueError(
                "Images must be a batch of shape (batch, height, width, 3). "
                f"Received: shape={tuple(shape)} (rank {len(shape)})."
                + (hint if len(shape) == 3 else ""))
        if shape[-1] != 3:
            raise ValueError(
                "Images must have 3 (RGB) channels. Received: shape="
                f"{tuple(shape)} with {shape[-1]} channels. Convert grayscale "
                "with `np.repeat(images, 3, axis=-1)` and drop an alpha channel "
                "with `images[..., :3]`.")
        if "int" not in str(dtype) and "float" not in str(dtype):
            raise ValueError(
                "Images must be integers in [0, 255] or floats. "
                f"Received: dtype={dtype}")

    def call(self, images):
        dtype = str(getattr(images, "dtype", "float32"))
        shape = tuple(images.shape)
        self.check_images(shape, dtype)
        if (self.upstream_resize and "int" in dtype and self.crop == "resize"
                and tuple(shape[1:3]) != self._size):
            # Upstream's `resize(size)` on uint8: bilinear, floored, then rescaled.
            if "tensorflow" in type(images).__module__:  # inside tf.data / a tf graph
                import tensorflow as tf

                x = tf.image.resize(tf.cast(images, "float32"), self._size,
                                    method=self.interpolation, antialias=False)
                x = tf.floor(tf.clip_by_value(x, 0.0, 255.0))
            else:
                x = self._resize(keras.ops.cast(images, "float32"))
                x = keras.ops.floor(keras.ops.clip(x, 0.0, 255.0))
            return self._int_rescale(x)
        x = (self._int_rescale if "int" in dtype else self._float_rescale)(images)
        if self.crop == "resize_small_central_crop":
            return self._resize_small_central_crop(x)
        if tuple(shape[1:3]) != self._size:
            x = self._resize(x)
        return x

    def _resize_small_central_crop(self, x):
        if "tensorflow" in type(x).__module__ or None in tuple(x.shape[1:3]):
            return resize_small_central_crop_tf(
                x, self._size, method=self.interpolation, antialias=self.antialias)
        new_h, new_w, dy, dx = resize_small_geometry(*x.shape[1:3], self._size)
        if (new_h, new_w) != tuple(x.shape[1:3]):
            x = keras.ops.image.resize(x, (new_h, new_w), interpolation=self.interpolation,
                                       antialias=self.antialias)
        return x[:, dy:dy + self._size[0], dx:dx + self._size[1]]

    def compute_output_shape(self, input_shape):
        return (input_shape[0], *self._size, 3)

    def get_config(self):
        config = super().get_config()
        # A pair as a list, as a loaded config holds it (JSON).
        size = self.image_size
        config.update({"image_size": list(size) if isinstance(size, (list, tuple)) else size,
                       "crop": self.crop, "float_range": list(self.float_range),
                       "interpolation": self.interpolation, "antialias": self.antialias,
                       "upstream_resize": self.upstream_resize})
        return config
