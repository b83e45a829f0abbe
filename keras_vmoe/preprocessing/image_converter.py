"""`ImageConverter`: raw images -> the backbone's input ([-1, 1], model size)."""

import math

import keras

CROP_MODES = ("resize", "central_crop")


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
    (`crop="resize"`) or centrally cropped to a square and resized
    (`crop="central_crop"`, the evaluation preprocessing of upstream,
    `resize_small|central_crop`). Batches must be `(B, H, W, 3)`.

    Built from Keras' `Resizing` and `Rescaling` layers, so it runs eagerly
    on any backend and inside `tf.data` (`keras_vmoe.data` applies it there).

    Args:
        image_size: int or (int, int), the model resolution.
        crop: `"resize"` or `"central_crop"`.
        float_range: (low, high), the value range of float inputs.
        interpolation: resize interpolation (`"bilinear"`, `"bicubic"`, ...).
        antialias: bool, antialias when downsizing.
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
        if crop not in CROP_MODES:
            raise ValueError(
                f"`crop` must be one of {CROP_MODES}. Received: crop={crop!r}"
            )
        self.image_size = image_size
        self.crop = crop
        self.float_range = check_range(float_range, "float_range")
        self.interpolation = interpolation
        self.antialias = bool(antialias)
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
        x = rescale(images)
        if tuple(shape[1:3]) != self._size:
            x = self._resize(x)
        return x

    def compute_output_shape(self, input_shape):
        return (input_shape[0], *self._size, 3)

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "image_size": self.image_size,
                "crop": self.crop,
                "float_range": list(self.float_range),
                "interpolation": self.interpolation,
                "antialias": self.antialias,
            }
        )
        return config
