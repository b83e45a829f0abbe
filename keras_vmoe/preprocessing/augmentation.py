"""Training augmentation (upstream's fine-tuning presets) on [0, 255] images.

TensorFlow is imported lazily: only the data pipelines need it.
"""

import math

import numpy as np

from keras_vmoe.preprocessing.randaugment import MAX_NUM_LAYERS as MAX_RANDAUGMENT_OPS  # noqa: F401
from keras_vmoe.preprocessing.randaugment import UpstreamRandAugment
from keras_vmoe.preprocessing.randaugment import _check as check_randaugment
from keras_vmoe.utils.validation import check_bool
from keras_vmoe.utils.validation import check_int
from keras_vmoe.utils.validation import check_number
from keras_vmoe.utils.validation import check_pair


def check_crop_area_range(value, name="crop_area_range"):
    """`(min, max)` area fractions with `0 < min <= max <= 1`, as floats."""
    try:
        low, high = (float(v) for v in value)
    except (TypeError, ValueError):
        low = high = math.nan
    if not 0 < low <= high <= 1 or any(isinstance(v, bool) for v in value or ()):
        raise ValueError(
            f"`{name}` must be a pair (min, max) of area fractions with "
            f"0 < min <= max <= 1. Received: {name}={value!r}")
    return (low, high)


def check_augmentation(randaugment=None, mixup=None, crop_area_range=(0.05, 1.0),
                       upstream=True):
    """The augmentation arguments of both pipelines, checked and normalised.

    Returns `(randaugment, mixup, crop_area_range, upstream)`, with `None`
    for no RandAugment or MixUp; Keras' RandAugment refuses magnitude > 10.
    """
    upstream = check_bool(upstream, "upstream_augmentation")
    if randaugment is False:
        randaugment = None
    if randaugment is not None:
        if not (isinstance(randaugment, (list, tuple)) and len(randaugment) == 2):
            raise ValueError(
                "`randaugment` must be a pair (num_layers, magnitude), e.g. (2, 10). "
                f"Received: randaugment={randaugment!r}")
        given, randaugment = randaugment, check_randaugment(*randaugment)
        if not upstream and randaugment[1] > 10:
            raise ValueError(
                "Keras' RandAugment (upstream_augmentation=False) has no level "
                "beyond magnitude 10 (its factor 1.0). Use upstream_augmentation="
                f"True for magnitudes up to 30. Received: randaugment={given!r}")
        randaugment = randaugment if randaugment[0] else None
    # 0 and False: no MixUp.
    mixup = None if mixup in (None, False) else check_number(mixup, "mixup") or None
    return randaugment, mixup, check_crop_area_range(crop_area_range), upstream


class InceptionCrop:
    """Inception-style random-resized crop of one image (`tf.data` map).

    Samples a box covering `area_range` of the image with an aspect ratio in
    `aspect_ratio_range`, crops it and resizes it to `image_size`.

    Args:
        image_size: int or (int, int), the output size.
        area_range: (min, max) fraction of the image area.
        aspect_ratio_range: (min, max) width / height ratio.
        seed: int or None, random seed.
        upstream: bool, resize as upstream (bilinear without antialiasing,
            floored as uint8; returned as float32) or antialiased in float.

    Examples:

    ```python
    import numpy as np
    import tensorflow as tf
    import keras_vmoe

    images = np.random.default_rng(0).integers(0, 256, (4, 300, 400, 3), "uint8")
    ds = tf.data.Dataset.from_tensor_slices((images, np.arange(4)))
    crop = keras_vmoe.preprocessing.InceptionCrop(224)
    ds = ds.map(lambda image, label: (crop(image), label))
    image, label = next(iter(ds))   # image: (224, 224, 3)
    ```
    """

    def __init__(self, image_size, area_range=(0.05, 1.0),
                 aspect_ratio_range=(0.75, 1.33), seed=None, upstream=True):
        self.size = check_pair(image_size, "image_size")
        if min(self.size) < 1:
            raise ValueError(
                f"`image_size` must be positive. Received: image_size={image_size!r}")
        self.area_range = check_crop_area_range(area_range, "area_range")
        self.aspect_ratio_range = tuple(float(r) for r in aspect_ratio_range)
        self.seed = seed
        self.upstream = bool(upstream)

    def __call__(self, image, seed=None):
        """Crops `image` (H, W, C); `seed`: optional (2,) stateless seed."""
        import tensorflow as tf

        image = tf.convert_to_tensor(image)
        box = dict(bounding_boxes=tf.zeros([1, 0, 4]), area_range=self.area_range,
                   aspect_ratio_range=self.aspect_ratio_range, min_object_covered=0.0,
                   use_image_if_no_bounding_boxes=True)
        if seed is not None:
            begin, crop_size, _ = tf.image.stateless_sample_distorted_bounding_box(
                tf.shape(image), seed=seed, **box)
        else:
            begin, crop_size, _ = tf.image.sample_distorted_bounding_box(
                tf.shape(image), seed=0 if self.seed is None else self.seed, **box)
        crop = tf.cast(tf.slice(image, begin, crop_size), "float32")
        crop = tf.image.resize(crop, self.size, method="bilinear",
                               antialias=not self.upstream)
        if self.upstream:
            # tf.cast(..., uint8) truncates; bilinear keeps [0, 255].
            crop = tf.floor(crop)
        return tf.ensure_shape(crop, (*self.size, image.shape[-1]))


def local_device_count():
    """Devices of the active Keras distribution that this process feeds (>= 1)."""
    import keras

    distribution = keras.distribution.distribution()
    if distribution is None:
        return 1
    devices = list(np.asarray(distribution.device_mesh.devices).reshape(-1))
    if keras.backend.backend() == "jax":
        import jax

        jax_devices = {str(d): d for d in jax.devices()}
        process = jax.process_index()
        devices = [d for d in devices if getattr(
            jax_devices.get(str(d), d), "process_index", process) == process]
    return max(1, len(devices))


class UpstreamMixUp:
    """MixUp as upstream: one Dirichlet weight per batch, partner = next.

    Each device batch draws one sorted pair `(a, 1 - a)`, `a >= 0.5`, from
    `Dirichlet(concentration, concentration)`: `x_i' = a·x_i + (1 - a)·x_{i+1}`
    (the last with the first), labels alike. Called on `{"images", "labels"}`
    (`tf.data` tensors, or NumPy arrays with an optional `rng`).

    Args:
        concentration: float > 0, the Dirichlet concentration.
        num_devices: int >= 1, equal batch slices with their own weight.
        seed: int or None.
    """

    def __init__(self, concentration, num_devices=1, seed=None):
        self.concentration = check_number(concentration, "concentration",
                                          inclusive=False)
        self.num_devices = check_int(num_devices, "num_devices")
        self.seed = seed
        self._rng = None

    def weights(self, num_draws=None, rng=None):
        """`(num_devices, 2)` sorted Dirichlet weights, largest first."""
        if rng is None:
            if self._rng is None:
                self._rng = np.random.default_rng(self.seed)
            rng = self._rng
        gamma = rng.gamma(self.concentration, size=(num_draws or self.num_devices, 2))
        alpha = gamma / gamma.sum(axis=-1, keepdims=True)
        return -np.sort(-alpha, axis=-1)

    def mix(self, array, alpha):
        """Mixes `array` (B, ...) with `alpha` (num_devices, 2), slice by slice."""
        array = np.asarray(array)
        devices = alpha.shape[0]
        if array.shape[0] % devices:
            raise ValueError(
                f"The batch ({array.shape[0]}) must split into num_devices="
                f"{devices} equal slices.")
        x = array.reshape((devices, -1) + array.shape[1:]).astype("float32")
        a = alpha.astype("float32").reshape((devices, 2) + (1,) * (x.ndim - 1))
        mixed = a[:, 0] * x + a[:, 1] * np.roll(x, -1, axis=1)
        return mixed.reshape(array.shape)

    def __call__(self, data, rng=None):
        images, labels = data["images"], data["labels"]
        if type(images).__module__.startswith("tensorflow"):
            return self._call_tf(images, labels)
        alpha = self.weights(rng=rng)
        return {"images": self.mix(images, alpha), "labels": self.mix(labels, alpha)}

    def _call_tf(self, images, labels):
        import tensorflow as tf

        devices = self.num_devices
        gamma = tf.random.gamma((devices, 2), self.concentration, seed=self.seed)
        alpha = gamma / tf.reduce_sum(gamma, axis=-1, keepdims=True)
        alpha = -tf.sort(-alpha, axis=-1)

        def mix_tf(x):
            x = tf.cast(x, "float32")
            shape = tf.shape(x)
            grouped = tf.reshape(x, tf.concat([[devices, -1], shape[1:]], 0))
            a = tf.reshape(alpha, tf.concat([[devices, 2], tf.ones_like(shape)], 0))
            mixed = a[:, 0] * grouped + a[:, 1] * tf.roll(grouped, -1, axis=1)
            return tf.reshape(mixed, shape)

        return {"images": mix_tf(images), "labels": mix_tf(labels)}


def randaugment_layer(num_ops, magnitude, seed=None):
    """Keras `RandAugment` on [0, 255] images, `factor = magnitude / 10` (<= 1)."""
    import keras

    num_ops, magnitude = check_augmentation((num_ops, magnitude), upstream=False)[0] or (
        0, float(magnitude))
    return keras.layers.RandAugment(value_range=(0, 255), num_ops=num_ops,
                                    factor=magnitude / 10.0, seed=seed,
                                    name="randaugment")


def training_augmentation(image_size, *, inception_crop=True, flip=True,
                          randaugment=None, mixup=None, layers=(), seed=None,
                          crop_area_range=(0.05, 1.0), upstream=True):
    """The upstream fine-tuning augmentation as `(per_image, per_batch)` steps.

    `upstream=True`: `UpstreamRandAugment` per image (after the crop and
    flip) and `UpstreamMixUp`; `False`: Keras' `RandAugment` and `MixUp`.

    Args:
        image_size: int or (int, int), the model resolution.
        inception_crop: bool, random-resized crop (else a plain resize).
        crop_area_range: (min, max) area fraction of the Inception crop.
        flip: bool, random horizontal flip.
        randaugment: `(num_ops, magnitude)` or None.
        mixup: MixUp `alpha` (e.g. 0.2) or None; labels become one-hot.
            Its `num_devices` comes from the `keras.distribution` in effect.
        layers: extra Keras layers applied to each batch after RandAugment.
        seed: int or None.
        upstream: bool, see above.

    Returns:
        A dict: `per_image` (callable on one image and an optional (2,)
        stateless seed), `per_batch` (callables on a batch of [0, 255]
        images) and `mixup` (`UpstreamMixUp`, Keras `MixUp` or None).
    """
    import tensorflow as tf

    randaugment, mixup, crop_area_range, upstream = check_augmentation(
        randaugment, mixup, crop_area_range, upstream)
    size = check_pair(image_size, "image_size")
    crop = InceptionCrop(size, area_range=crop_area_range, seed=seed) if inception_crop else None
    randaug = upstream_randaugment(randaugment, seed) if upstream else None

    def per_image(image, seed=None):
        crop_seed = flip_seed = None
        if seed is not None:
            # The crop and flip depend on the example's seed alone (exact resume).
            crop_seed, flip_seed = tf.unstack(
                tf.random.experimental.stateless_split(seed, 2))
        if crop is not None:
            image = crop(image, seed=crop_seed)
        else:
            image = tf.image.resize(tf.cast(image, "float32"), size, antialias=True)
        if flip and flip_seed is not None:
            image = tf.image.stateless_random_flip_left_right(image, flip_seed)
        elif flip:
            image = tf.image.random_flip_left_right(image, seed=seed)
        if randaug is not None:
            # Its own stream: the crop and flip draws stay those without it.
            randaug_seed = (None if seed is None else
                            tf.random.experimental.stateless_fold_in(seed, 3))
            image = randaug(image, seed=randaug_seed)
        return image

    per_batch, mixup_layer = batch_augmentation(randaugment, mixup, layers, seed,
                                                upstream=upstream)
    return {"per_image": per_image, "per_batch": per_batch, "mixup": mixup_layer}


def upstream_randaugment(randaugment, seed=None):
    """`UpstreamRandAugment(*randaugment, seed)`, or None for no RandAugment."""
    randaugment = check_augmentation(randaugment)[0]
    return None if randaugment is None else UpstreamRandAugment(*randaugment, seed=seed)


def batch_augmentation(randaugment=None, mixup=None, layers=(), seed=None,
                       upstream=True):
    """The batch steps of the augmentation (no TensorFlow needed).

    Returns `(per_batch, mixup)`: callables on a batch (Keras' RandAugment
    when `upstream=False`, then `layers`) and the MixUp layer or None;
    upstream's RandAugment runs per image, outside these steps.
    """
    import keras

    randaugment, mixup, _, upstream = check_augmentation(randaugment, mixup,
                                                         upstream=upstream)
    per_batch = []
    if randaugment and not upstream:
        per_batch.append(randaugment_layer(*randaugment, seed=seed))
    for layer in layers or ():
        if not callable(layer):
            raise ValueError(
                f"Augmentation layers must be callables (Keras layers). "
                f"Received: {layer!r}")
        per_batch.append(layer)
    if not mixup:
        return per_batch, None
    if upstream:
        return per_batch, UpstreamMixUp(mixup, num_devices=local_device_count(),
                                        seed=seed)
    return per_batch, keras.layers.MixUp(alpha=float(mixup), seed=seed, name="mixup")
