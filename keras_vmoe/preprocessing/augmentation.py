"""Training augmentation (upstream fine-tuning presets) for `tf.data`.

Runs inside `tf.data` on images in [0, 255]. Keras core provides RandAugment,
MixUp and flips (they run inside `tf.data` under any backend); the
Inception-style random-resized crop is missing from Keras core, so
`InceptionCrop` implements it with TensorFlow ops. TensorFlow is imported
lazily: it is needed by the data pipelines only, never by the models.
"""

import math


class InceptionCrop:
    """Inception-style random-resized crop of one image (`tf.data` map).

    Samples a box covering `area_range` of the image with an aspect ratio in
    `aspect_ratio_range` (`tf.image.sample_distorted_bounding_box`, as
    upstream's `inception_crop`), crops it and resizes it to `image_size`.

    Args:
        image_size: int or (int, int), the output size.
        area_range: (min, max) fraction of the image area.
        aspect_ratio_range: (min, max) width / height ratio.
        seed: int or None, random seed.

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
                 aspect_ratio_range=(3 / 4, 4 / 3), seed=None):
        size = tuple(image_size) if isinstance(image_size, (list, tuple)) else (
            image_size, image_size)
        if len(size) != 2 or not all(isinstance(s, int) and s > 0 for s in size):
            raise ValueError(
                f"`image_size` must be a positive int or a pair of them. "
                f"Received: image_size={image_size!r}")
        low, high = area_range
        if not 0 < low <= high <= 1:
            raise ValueError(
                "`area_range` must satisfy 0 < min <= max <= 1. "
                f"Received: area_range={area_range!r}")
        self.size = size
        self.area_range = (float(low), float(high))
        self.aspect_ratio_range = tuple(float(r) for r in aspect_ratio_range)
        self.seed = seed

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
                               method="bilinear", antialias=True)
        return tf.ensure_shape(crop, (*self.size, image.shape[-1]))


# Most RandAugment operations per image: upstream uses 2; each op costs one
# pass over the batch, so a huge count never finishes.
MAX_RANDAUGMENT_OPS = 16


def randaugment_layer(num_ops, magnitude, seed=None):
    """Keras `RandAugment` on [0, 255] images with upstream's `randaug(N, M)`.

    `magnitude` uses upstream's level scale (10 = the strongest listed
    level) and maps linearly to Keras' `factor = magnitude / 10` (capped
    at 1).
    """
    import keras

    if not (isinstance(num_ops, int) and 0 <= num_ops <= MAX_RANDAUGMENT_OPS):
        raise ValueError(
            f"RandAugment `num_ops` must be an int in [0, {MAX_RANDAUGMENT_OPS}] "
            f"(upstream uses 2). Received: {num_ops!r}")
    if not (math.isfinite(float(magnitude)) and magnitude >= 0):
        raise ValueError(
            f"RandAugment `magnitude` must be a number >= 0. Received: {magnitude!r}")
    return keras.layers.RandAugment(
        value_range=(0, 255), num_ops=num_ops,
        factor=min(1.0, float(magnitude) / 10.0), seed=seed, name="randaugment")


def training_augmentation(image_size, *, inception_crop=True, flip=True,
                          randaugment=None, mixup=None, layers=(), seed=None,
                          crop_area_range=(0.05, 1.0)):
    """The upstream fine-tuning augmentation as `(per_image, per_batch)` steps.

    Args:
        image_size: int or (int, int), the model resolution.
        inception_crop: bool, random-resized crop (else a plain resize).
        crop_area_range: (min, max) area fraction of the Inception crop.
        flip: bool, random horizontal flip.
        randaugment: `(num_ops, magnitude)` or None.
        mixup: MixUp `alpha` (e.g. 0.2) or None; labels become one-hot.
        layers: extra Keras (or keras-cv style) layers applied to each
            batch of [0, 255] float images after RandAugment.
        seed: int or None.

    Returns:
        A dict with `per_image` (callable on one image and an optional
        (2,) stateless seed, returns a float [0, 255] image at `image_size`), `per_batch` (list of callables on
        a batch of [0, 255] images) and `mixup` (a Keras `MixUp` or None).
    """
    import tensorflow as tf

    size = image_size if isinstance(image_size, (list, tuple)) else (
        image_size, image_size)
    crop = InceptionCrop(size, area_range=crop_area_range, seed=seed) if inception_crop else None

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
        return image

    per_batch, mixup_layer = batch_augmentation(randaugment, mixup, layers, seed)
    return {"per_image": per_image, "per_batch": per_batch, "mixup": mixup_layer}


def batch_augmentation(randaugment=None, mixup=None, layers=(), seed=None):
    """The batch steps of the augmentation (no TensorFlow needed).

    Returns:
        `(per_batch, mixup)`: a list of callables on a batch of [0, 255]
        images (RandAugment, then `layers`), and a Keras `MixUp` or None.
    """
    import keras

    per_batch = []
    if randaugment:
        per_batch.append(randaugment_layer(*randaugment, seed=seed))
    for layer in layers or ():
        if not callable(layer):
            raise ValueError(
                f"Augmentation layers must be callables (Keras layers). "
                f"Received: {layer!r}")
        per_batch.append(layer)
    mixup_layer = None
    if mixup:
        mixup_layer = keras.layers.MixUp(alpha=float(mixup), seed=seed,
                                         name="mixup")
    return per_batch, mixup_layer
