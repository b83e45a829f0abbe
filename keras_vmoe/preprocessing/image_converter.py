"""`ImageConverter`: raw images -> the backbone's input ([-1, 1], model size)."""

import math

import keras

from keras_vmoe.utils.validation import check_bool
from keras_vmoe.utils.validation import check_one_of

CROP_MODES = ("resize", "central_crop", "resize_small_central_crop")
# Upstream evaluates its 224-px models with `resize_small(256)|central_crop(224)`.
RESIZE_SMALL_RATIO = 256 / 224


def resize_small_geometry(height, width, size):
    """Upstream's `resize_small(S·256/224)|central_crop(size)` geometry.

    Returns `(new_height, new_width, offset_y, offset_x)`: the short side
    is resized to `round(min(size)·256/224)` keeping the aspect ratio
    (`vmoe/data/pp_ops.py:311-332`, rounding as there), then the central
    `size` window is kept (`pp_ops.py:66-87`, offsets `(new - size) // 2`).
    """
    size_h, size_w = size
    small = round(min(size_h, size_w) * RESIZE_SMALL_RATIO)
    ratio = small / min(height, width)
    new_h, new_w = round(height * ratio), round(width * ratio)
    new_h, new_w = max(new_h, size_h), max(new_w, size_w)
    return new_h, new_w, (new_h - size_h) // 2, (new_w - size_w) // 2


def resize_small_central_crop_tf(images, size, method="area", antialias=False):
    """`resize_small|central_crop` in TensorFlow, for (B,)H,W,C tensors.

    Exactly upstream's evaluation preprocessing with `method="area"`
    (`tf.image.resize` of the short side to `round(min(size)·256/224)`,
    then the central `size` crop); works on images of unknown size inside
    `tf.data`.
    """
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


def check_range(value_range, name):
    """`(low, high)` floats of a finite value range with high > low, or a
    `ValueError` naming the argument."""
    try:
        low, high = (float(v) for v in value_range)
    except (TypeError, ValueError):
        low = high = math.nan
    if not (math.isfinite(low) and math.isfinite(high) and high > low):
        raise ValueError(
            f"`{name}` must be a pair (low, high) of finite numbers with "
            f"high > low, e.g. (0, 1) or (0, 255). Received: {name}={value_range!r}"
        )
    return (low, high)


def _rescaling_args(low, high):
    """Scale and offset of the affine map [low, high] -> [-1, 1]."""
    scale = 2.0 / (high - low)
    return scale, -1.0 - low * scale


@keras.saving.register_keras_serializable(package="keras_vmoe")
class ImageConverter(keras.layers.Layer):
    """Maps raw images to the model's input: float32 in [-1, 1] at `image_size`.

    Integer images (`uint8`, ...) are read as [0, 255]. Float images are
    read as `float_range`, which defaults to (-1, 1), the models' native
    range (so already-converted inputs pass through unchanged and the
    conversion is idempotent); pass `float_range=(0, 1)` for images from
    `keras.utils.load_img(...) / 255` or `(0, 255)` for unscaled floats.
    Images whose height and width differ from `image_size` are resized
    (`crop="resize"`: upstream's `resize(size)`, its evaluation of the
    fine-tuned 384-px and CIFAR models), resized so that the short side is
    `image_size·256/224` then centrally cropped (`"resize_small_central_
    crop"`: upstream's `resize_small(256)|central_crop(224)`, its evaluation
    of the 224-px models), or cropped to the largest central square and
    resized (`"central_crop"`). Batches must be `(B, H, W, 3)`.

    Built from Keras' `Resizing` and `Rescaling` layers, so it runs eagerly
    on any backend and inside `tf.data` (`keras_vmoe.data` applies it there).

    Args:
        image_size: int or (int, int), the model resolution.
        crop: `"resize"`, `"resize_small_central_crop"` or
            `"central_crop"`.
        float_range: (low, high), the value range of float inputs.
        interpolation: resize interpolation (`"bilinear"`, `"bicubic"`, ...).
        antialias: bool, antialias when downsizing (ignored with
            `upstream_resize`).
        upstream_resize: bool, resize as upstream's evaluation
            `decode|resize(size)|value_range(-1, 1)`: integer images are
            resized bilinear without antialiasing in [0, 255] and cast back
            to uint8 (floored) before the value range; float images are
            resized without antialiasing. The default converter of the
            classifiers (and so of the converted presets) uses it. It
            equals upstream's input to 1e-6 on TensorFlow; on JAX, whose
            bilinear rounds differently before the floor, about 1 value
            in 10⁴ is one uint8 level (1/127.5) off. Without
            it, a uint8 photo resized with antialiasing differs from
            upstream's input by up to 0.30 (mean 0.024) on the [-1, 1]
            scale at 128 px, 0.21 (mean 0.011) at 224 px (scikit-image's
            300×400 `chelsea` crop).
            Applies to `crop="resize"`; the other crop modes resize in
            float.
        **kwargs: `keras.layers.Layer` arguments.

    Examples:

    ```python
    import numpy as np
    import keras_vmoe

    converter = keras_vmoe.preprocessing.ImageConverter(64, float_range=(0, 1))
    x = converter(np.random.rand(2, 100, 80, 3))     # (2, 64, 64, 3) in [-1, 1]
    ```
    """

    def __init__(
        self,
        image_size,
        crop="resize",
        float_range=(-1.0, 1.0),
        interpolation="bilinear",
        antialias=True,
        upstream_resize=False,
        **kwargs,
    ):
        kwargs.setdefault("dtype", "float32")
        super().__init__(**kwargs)
        if isinstance(image_size, (list, tuple)):
            size = tuple(image_size)
        else:
            size = (image_size, image_size)
        if len(size) != 2 or not all(
            isinstance(s, int) and not isinstance(s, bool) and s > 0 for s in size
        ):
            raise ValueError(
                "`image_size` must be a positive int or a pair of them. "
                f"Received: image_size={image_size!r}"
            )
        check_one_of(crop, "crop", CROP_MODES)
        self.image_size = image_size
        self.crop = crop
        self.float_range = check_range(float_range, "float_range")
        self.interpolation = interpolation
        self.upstream_resize = check_bool(upstream_resize, "upstream_resize")
        # Upstream's resize has no antialiasing.
        self.antialias = bool(antialias) and not self.upstream_resize
        self._size = size
        self._resize = keras.layers.Resizing(
            *size,
            interpolation=interpolation,
            crop_to_aspect_ratio=crop == "central_crop",
            antialias=self.antialias,
            dtype="float32",
            name="resize",
        )
        self._int_rescale = keras.layers.Rescaling(
            *_rescaling_args(0.0, 255.0), dtype="float32", name="int_rescale"
        )
        self._float_rescale = keras.layers.Rescaling(
            *_rescaling_args(*self.float_range), dtype="float32", name="float_rescale"
        )
        # Built from the start: the converter often runs outside the model's
        # graph (in `tf.data`), and an unbuilt layer would make every `fit`
        # read an extra batch to build it, shifting a resumed run's data.
        self.build()

    def build(self, input_shape=None):
        # No weights: the converter and its stateless sublayers are built.
        for layer in (self._resize, self._int_rescale, self._float_rescale):
            layer.built = True
        self.built = True

    def check_images(self, shape, dtype):
        """Raises a clear `ValueError` unless `shape` is `(B, H, W, 3)`."""
        if len(shape) != 4:
            hint = (
                " For one image, add a batch axis (`images[None]`)."
                if len(shape) == 3
                else ""
            )
            raise ValueError(
                "Images must be a batch of shape (batch, height, width, 3). "
                f"Received: shape={tuple(shape)} (rank {len(shape)}).{hint}"
            )
        if shape[-1] != 3:
            raise ValueError(
                "Images must have 3 (RGB) channels. Received: shape="
                f"{tuple(shape)} with {shape[-1]} channels. Convert grayscale "
                "with `np.repeat(images, 3, axis=-1)` and drop an alpha channel "
                "with `images[..., :3]`."
            )
        if "int" not in str(dtype) and "float" not in str(dtype):
            raise ValueError(
                "Images must be integers in [0, 255] or floats. Received: "
                f"dtype={dtype}"
            )

    def call(self, images):
        dtype = str(getattr(images, "dtype", "float32"))
        shape = tuple(images.shape)
        self.check_images(shape, dtype)
        rescale = self._int_rescale if "int" in dtype else self._float_rescale
        if (self.upstream_resize and "int" in dtype and self.crop == "resize"
                and tuple(shape[1:3]) != self._size):
            # Upstream's `resize(size)` on the decoded uint8 image: bilinear
            # in [0, 255], cast back to uint8 (floor), then the value range.
            if "tensorflow" in type(images).__module__:  # inside tf.data / a tf graph
                import tensorflow as tf

                x = tf.image.resize(tf.cast(images, "float32"), self._size,
                                    method=self.interpolation, antialias=False)
                x = tf.floor(tf.clip_by_value(x, 0.0, 255.0))
            else:
                x = self._resize(keras.ops.cast(images, "float32"))
                x = keras.ops.floor(keras.ops.clip(x, 0.0, 255.0))
            return self._int_rescale(x)
        x = rescale(images)
        if self.crop == "resize_small_central_crop":
            return self._resize_small_central_crop(x)
        if tuple(shape[1:3]) != self._size:
            x = self._resize(x)
        return x

    def _resize_small_central_crop(self, x):
        if "tensorflow" in type(x).__module__ or None in tuple(x.shape[1:3]):
            # Inside tf.data (e.g. `dataset.map`): TensorFlow ops.
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
