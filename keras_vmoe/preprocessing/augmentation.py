"""Training augmentation (upstream fine-tuning presets) for `tf.data`.

Runs inside `tf.data` on images in [0, 255]. Upstream's RandAugment is
`UpstreamRandAugment` (`randaugment.py`, TensorFlow and NumPy). Keras core
provides RandAugment, MixUp and flips (they run inside `tf.data` under any backend); the
Inception-style random-resized crop is missing from Keras core, so
`InceptionCrop` implements it with TensorFlow ops. TensorFlow is imported
lazily: it is needed by the data pipelines only, never by the models.
"""

import math

import numpy as np

# Most RandAugment operations per image (upstream uses 2): each op is one
# pass over the image, so a huge count would never finish.
from keras_vmoe.preprocessing.randaugment import MAX_NUM_LAYERS as MAX_RANDAUGMENT_OPS  # noqa: F401
from keras_vmoe.preprocessing.randaugment import UpstreamRandAugment
from keras_vmoe.preprocessing.randaugment import _check as check_randaugment
from keras_vmoe.utils.validation import check_bool
from keras_vmoe.utils.validation import check_number


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
    """The augmentation arguments of both pipelines, checked alike.

    `load_dataset` (the `tf.data` and the NumPy pipelines) and
    `training_augmentation` run this one check.

    Args:
        randaugment: `None` or `(num_layers, magnitude)`: an int in
            [0, 100] and a number in [0, 30] (upstream's scale). Keras'
            `RandAugment` (`upstream=False`) has no level beyond 10 and
            refuses a larger magnitude.
        mixup: `None` (or 0: no MixUp) or a finite number > 0, the MixUp
            concentration (`alpha`).
        crop_area_range: `(min, max)` with `0 < min <= max <= 1`.
        upstream: bool, upstream's RandAugment and MixUp (`True`) or Keras'
            layers.

    Returns:
        `(randaugment, mixup, crop_area_range, upstream)`, normalised
        (`None` for no RandAugment or MixUp).
    """

    upstream = check_bool(upstream, "upstream_augmentation")
    if randaugment is not None and randaugment is not False:
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
        if randaugment[0] == 0:
            randaugment = None
    else:
        randaugment = None
    if mixup is not None and mixup is not False:
        mixup = check_number(mixup, "mixup")
        mixup = mixup if mixup > 0 else None
    else:
        mixup = None
    return randaugment, mixup, check_crop_area_range(crop_area_range), upstream


class InceptionCrop:
    """Inception-style random-resized crop of one image (`tf.data` map).

    Samples a box covering `area_range` of the image with an aspect ratio in
    `aspect_ratio_range` (`tf.image.sample_distorted_bounding_box`, as
    upstream's `inception_crop`), crops it and resizes it to `image_size`.

    With `upstream=True` (default) the resize is upstream's
    (`vmoe/data/pp_ops.py` `inception_crop` -> `resize`): bilinear without
    antialiasing, then cast back to the decoded image's `uint8` (values in
    [0, 255] floored; returned as float32). `upstream=False`: antialiased
    bilinear, kept in float.

    Args:
        image_size: int or (int, int), the output size.
        area_range: (min, max) fraction of the image area.
        aspect_ratio_range: (min, max) width / height ratio (upstream passes
            none: TensorFlow's default (0.75, 1.33)).
        seed: int or None, random seed.
        upstream: bool, see above.

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
        size = tuple(image_size) if isinstance(image_size, (list, tuple)) else (
            image_size, image_size)
        if len(size) != 2 or not all(isinstance(s, int) and s > 0 for s in size):
            raise ValueError(
                f"`image_size` must be a positive int or a pair of them. "
                f"Received: image_size={image_size!r}")
        self.size = size
        self.area_range = check_crop_area_range(area_range, "area_range")
        self.aspect_ratio_range = tuple(float(r) for r in aspect_ratio_range)
        self.seed = seed
        self.upstream = bool(upstream)

    def __call__(self, image, seed=None):
        """Crops `image` (H, W, C); `seed`: optional (2,) int tensor, for
        stateless (order-independent, reproducible) sampling."""
        import tensorflow as tf

        image = tf.convert_to_tensor(image)
        box = {
            "bounding_boxes": tf.zeros([1, 0, 4]),
            "area_range": self.area_range,
            "aspect_ratio_range": self.aspect_ratio_range,
            "min_object_covered": 0.0,
            "use_image_if_no_bounding_boxes": True,
        }
        if seed is not None:
            begin, crop_size, _ = tf.image.stateless_sample_distorted_bounding_box(
                tf.shape(image), seed=seed, **box)
        else:
            begin, crop_size, _ = tf.image.sample_distorted_bounding_box(
                tf.shape(image), seed=0 if self.seed is None else self.seed, **box)
        crop = tf.slice(image, begin, crop_size)
        crop = tf.image.resize(tf.cast(crop, "float32"), self.size,
                               method="bilinear", antialias=not self.upstream)
        if self.upstream:
            # tf.cast(..., uint8) truncates; bilinear keeps [0, 255].
            crop = tf.floor(crop)
        return tf.ensure_shape(crop, (*self.size, image.shape[-1]))


def local_device_count():
    """Devices of the active Keras distribution that this process feeds.

    Upstream (`vmoe/train/trainer.py`) splits the global batch into
    `jax.device_count()` device batches and draws one MixUp weight for
    each. A pipeline mixes the batch of its own process, whose slices are
    the process's devices in the mesh; without a distribution, one device.
    """
    import keras

    distribution = keras.distribution.distribution()
    if distribution is None:
        return 1
    devices = list(np.asarray(distribution.device_mesh.devices).reshape(-1))
    if keras.backend.backend() == "jax":
        import jax

        jax_devices = {str(d): d for d in jax.devices()}
        process = jax.process_index()
        local = [d for d in devices
                 if getattr(jax_devices.get(str(d), d), "process_index", process) == process]
        return max(1, len(local))
    return max(1, len(devices))


class UpstreamMixUp:
    """MixUp as upstream: one Dirichlet weight per batch, partner = next.

    Upstream (`vmoe/train/trainer.py`, `mixup` and
    `wrap_train_step_with_mixup` with the configs' `granularity='device'`
    and `size=2`) draws one weight pair `(a, 1 - a)` from
    `Dirichlet(concentration, concentration)` per device batch, sorts it so
    that `a >= 0.5`, and mixes every example with the next one in the
    batch (the last with the first): `x_i' = a·x_i + (1 - a)·x_{i+1}`, the
    labels alike. Every example keeps at least half of itself. (Keras'
    `MixUp` draws a Beta weight per example and a random partner.) On one
    device the device batch is the whole batch; with `num_devices`, the
    batch is split into that many equal slices, each with its own weight.

    Called on `{"images": (B, ...), "labels": (B, C)}` (`tf.data` tensors
    or numpy arrays), returns the same dict mixed. On numpy arrays an
    optional `rng` (numpy `Generator`) draws the weights instead of the
    layer's own generator.

    Args:
        concentration: float > 0, the Dirichlet concentration (upstream's
            `mixup.concentration`, e.g. 0.2 for light1, 0.5 for the
            ImageNet-21k pre-training).
        num_devices: int >= 1, device batches with their own weight.
        seed: int or None.
    """

    def __init__(self, concentration, num_devices=1, seed=None):
        concentration = float(concentration)
        if not (math.isfinite(concentration) and concentration > 0):
            raise ValueError(
                "MixUp `concentration` must be a number > 0. Received: "
                f"concentration={concentration!r}")
        if not (isinstance(num_devices, int) and num_devices >= 1):
            raise ValueError(
                f"`num_devices` must be an int >= 1. Received: num_devices={num_devices!r}")
        self.concentration = concentration
        self.num_devices = num_devices
        self.seed = seed
        self._rng = None

    def weights(self, num_draws=None, rng=None):
        """`(num_devices, 2)` sorted Dirichlet weights, largest first (numpy),
        drawn from `rng` (a numpy `Generator`) or the layer's own generator."""
        import numpy as np

        if rng is None:
            if self._rng is None:
                self._rng = np.random.default_rng(self.seed)
            rng = self._rng
        gamma = rng.gamma(self.concentration, size=(num_draws or self.num_devices, 2))
        alpha = gamma / gamma.sum(axis=-1, keepdims=True)
        return -np.sort(-alpha, axis=-1)

    def mix(self, array, alpha):
        """Mixes `array` (B, ...) with `alpha` (num_devices, 2): each device
        slice `x` becomes `alpha[d, 0]·x + alpha[d, 1]·roll(x, -1)`."""
        import numpy as np

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
    """Keras `RandAugment` on [0, 255] images with upstream's `randaug(N, M)`.

    `magnitude` uses upstream's level scale (10 = the strongest listed
    level) and maps linearly to Keras' `factor = magnitude / 10`; Keras has
    no level beyond 10, so a larger magnitude is refused.
    """
    import keras

    num_ops, magnitude = check_augmentation((num_ops, magnitude), upstream=False)[0] or (
        0, float(magnitude))
    return keras.layers.RandAugment(
        value_range=(0, 255), num_ops=num_ops,
        factor=magnitude / 10.0, seed=seed, name="randaugment")


def training_augmentation(image_size, *, inception_crop=True, flip=True,
                          randaugment=None, mixup=None, layers=(), seed=None,
                          crop_area_range=(0.05, 1.0), upstream=True):
    """The upstream fine-tuning augmentation as `(per_image, per_batch)` steps.

    With `upstream=True` (default) RandAugment is upstream's
    (`UpstreamRandAugment`, on each uint8 image after the crop and flip,
    drawn from the example's stateless seed) and MixUp is `UpstreamMixUp`;
    `upstream=False`: Keras' `RandAugment` and `MixUp` layers on batches.

    Args:
        image_size: int or (int, int), the model resolution.
        inception_crop: bool, random-resized crop (else a plain resize).
        crop_area_range: (min, max) area fraction of the Inception crop.
        flip: bool, random horizontal flip.
        randaugment: `(num_ops, magnitude)` or None.
        mixup: MixUp `alpha` (e.g. 0.2) or None; labels become one-hot.
            Upstream MixUp's `num_devices` is read now, from the
            `keras.distribution` in effect (`local_device_count`), and
            kept: set the distribution first.
        layers: extra Keras (or keras-cv style) layers applied to each
            batch of [0, 255] float images after RandAugment.
        seed: int or None.
        upstream: bool, see above.

    Returns:
        A dict with `per_image` (callable on one image and an optional
        (2,) stateless seed, returns a float [0, 255] image at
        `image_size`), `per_batch` (list of callables on
        a batch of [0, 255] images) and `mixup` (an `UpstreamMixUp`, a
        Keras `MixUp` or None).
    """
    import tensorflow as tf

    randaugment, mixup, crop_area_range, upstream = check_augmentation(
        randaugment, mixup, crop_area_range, upstream)
    size = image_size if isinstance(image_size, (list, tuple)) else (
        image_size, image_size)
    crop = InceptionCrop(size, area_range=crop_area_range, seed=seed) if inception_crop else None
    randaug = upstream_randaugment(randaugment, seed) if upstream else None

    def per_image(image, seed=None):
        crop_seed = flip_seed = None
        if seed is not None:
            # Two independent stateless streams from the example's seed: the
            # crop and the flip depend on the example alone, so a resumed run
            # draws them again exactly (no random state outside the seeds).
            crop_seed, flip_seed = tf.unstack(
                tf.random.experimental.stateless_split(seed, 2))
        if crop is not None:
            image = crop(image, seed=crop_seed)
        else:
            image = tf.image.resize(tf.cast(image, "float32"), size, antialias=True)
        if flip:
            if flip_seed is not None:
                image = tf.image.stateless_random_flip_left_right(image, flip_seed)
            else:
                image = tf.image.random_flip_left_right(image, seed=seed)
        if randaug is not None:
            # Its own stream, folded from the example's seed: the crop and
            # flip draws stay those of a pipeline without RandAugment.
            randaug_seed = (None if seed is None else
                            tf.random.experimental.stateless_fold_in(seed, 3))
            image = randaug(image, seed=randaug_seed)
        return image

    per_batch, mixup_layer = batch_augmentation(randaugment, mixup, layers, seed,
                                                upstream=upstream)
    return {"per_image": per_image, "per_batch": per_batch, "mixup": mixup_layer}


def upstream_randaugment(randaugment, seed=None):
    """`UpstreamRandAugment(*randaugment, seed)`, or None for no RandAugment.

    Args:
        randaugment: `(num_layers, magnitude)` or None.
        seed: int or None.
    """

    if not randaugment:
        return None
    if not (isinstance(randaugment, (list, tuple)) and len(randaugment) == 2):
        raise ValueError(
            "`randaugment` must be a pair (num_layers, magnitude), e.g. (2, 10). "
            f"Received: randaugment={randaugment!r}")
    return UpstreamRandAugment(*randaugment, seed=seed)


def batch_augmentation(randaugment=None, mixup=None, layers=(), seed=None,
                       upstream=True):
    """The batch steps of the augmentation (no TensorFlow needed).

    Args:
        randaugment: `(num_ops, magnitude)` or None.
        mixup: MixUp concentration or None. `UpstreamMixUp`'s
            `num_devices` comes from the `keras.distribution` in effect
            now (`local_device_count`) and does not follow a later one.
        layers: extra callables on a batch.
        seed: int or None.
        upstream: bool, MixUp as upstream (`UpstreamMixUp`, the default)
            instead of Keras' `MixUp` layer; RandAugment as upstream too,
            which runs per image (`upstream_randaugment`), so it is left out
            of the batch steps (`upstream=False`: Keras' `RandAugment`
            layer, the first batch step).

    Returns:
        `(per_batch, mixup)`: a list of callables on a batch of [0, 255]
        images (Keras' RandAugment when `upstream=False`, then `layers`),
        and an `UpstreamMixUp` (or a Keras `MixUp`) or None.
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
    mixup_layer = None
    if mixup:
        if upstream:
            mixup_layer = UpstreamMixUp(float(mixup), num_devices=local_device_count(),
                                        seed=seed)
        else:
            mixup_layer = keras.layers.MixUp(alpha=float(mixup), seed=seed,
                                             name="mixup")
    return per_batch, mixup_layer
