"""A TensorFlow-free input pipeline: NumPy and `keras.utils.PyDataset`.

The `tf.data` pipeline's preprocessing in NumPy; every random choice is a
function of `(seed, epoch, example index)`, so a resumed run (`set_epoch`,
`skip`) draws exactly the batches of an uninterrupted one.
"""

import functools
import math

import keras
import numpy as np

from keras_vmoe.data import images as image_files
from keras_vmoe.preprocessing.augmentation import UpstreamMixUp
from keras_vmoe.preprocessing.augmentation import check_crop_area_range

# Streams of the per-(seed, epoch, example) generators (MixUp's: per batch).
_SHUFFLE, _CROP, _FLIP, _RANDAUG, _MIXUP = 0, 1, 2, 3, 4


def _rng(seed, epoch, index, stream):
    # SeedSequence mixes the words: the draws of (seed, epoch, index) do not
    # depend on how many draws other examples made (order-independent).
    return np.random.default_rng([int(seed) % (1 << 64), int(epoch), int(index), stream])


@functools.lru_cache(maxsize=256)
def resize_weights(n_in, n_out, antialias):
    """`(n_out, n_in)` weights of `tf.image.resize`'s 1-D bilinear resize.

    Half-pixel centres; the triangle kernel is widened by the downscaling
    factor when `antialias`; rows normalised (edges clamp).
    """
    scale = n_out / n_in
    width = max(1.0 / scale, 1.0) if antialias else 1.0
    centres = (np.arange(n_out) + 0.5) / scale - 0.5
    distance = np.abs(np.arange(n_in)[None, :] - centres[:, None]) / width
    weights = np.maximum(0.0, 1.0 - distance)
    weights = (weights / weights.sum(axis=1, keepdims=True)).astype("float32")
    weights.flags.writeable = False  # shared by the cache
    return weights


def resize(image, size, antialias=True):
    """Bilinear resize of one `(H, W, C)` image to `size` (float32)."""
    image = np.asarray(image, "float32")
    height, width = image.shape[:2]
    if (height, width) == tuple(size):
        return image
    rows = resize_weights(height, size[0], antialias)
    cols = resize_weights(width, size[1], antialias)
    image = (rows @ image.reshape(height, -1)).reshape(size[0], width, -1)  # (h', W, C)
    return np.matmul(cols[None], image)  # (h', w', C)


def sample_crop(rng, height, width, area_range=(0.05, 1.0),
                aspect_ratio_range=(0.75, 1.33), max_attempts=100):
    """An Inception-style crop box `(top, left, crop_h, crop_w)`.

    The sampling of `tf.image.sample_distorted_bounding_box` without boxes;
    after `max_attempts` failures, the whole image.
    """
    min_area = area_range[0] * height * width
    max_area = area_range[1] * height * width
    for _ in range(max_attempts):
        ratio = rng.uniform(*aspect_ratio_range)
        min_h = int(round(math.sqrt(min_area / ratio)))
        max_h = int(round(math.sqrt(max_area / ratio)))
        if round(max_h * ratio) > width:
            max_h = int((width + 0.5 - 1e-7) / ratio)
            if round(max_h * ratio) > width:
                max_h -= 1
        max_h = min(max_h, height)
        min_h = min(min_h, max_h)
        crop_h = min_h + (int(rng.integers(max_h - min_h + 1)) if min_h < max_h else 0)
        crop_w = int(round(crop_h * ratio))
        if crop_h * crop_w < min_area:
            crop_h += 1
            crop_w = int(round(crop_h * ratio))
        if crop_h * crop_w > max_area:
            crop_h -= 1
            crop_w = int(round(crop_h * ratio))
        if (min_area <= crop_h * crop_w <= max_area and 0 < crop_w <= width
                and 0 < crop_h <= height):
            top = int(rng.integers(height - crop_h)) if crop_h < height else 0
            left = int(rng.integers(width - crop_w)) if crop_w < width else 0
            return top, left, crop_h, crop_w
    return 0, 0, height, width


class ArrayPipeline(keras.utils.PyDataset):
    """Batches of float32 `(images, labels)` in [-1, 1], without TensorFlow.

    Built by `load_dataset(..., pipeline="numpy")`. `read` maps an index to
    an `(H, W, 3)` image in [0, 255]; `per_batch` are Keras layers on each
    training batch; `randaugment` an `UpstreamRandAugment` per image; `mixup`
    an `UpstreamMixUp` (drawn per `(seed, epoch, batch)`) or a Keras `MixUp`
    (one-hot labels); `eval_convert` maps a [0, 255] batch to [-1, 1] at
    `image_size`.
    """

    shuffles_itself = True

    def __init__(self, read, labels, image_size, batch_size, *, training=False,
                 shuffle=False, drop_remainder=False, seed=0, inception_crop=True,
                 crop_area_range=(0.05, 1.0), flip=True, per_batch=(), mixup=None,
                 num_classes=None, eval_convert=None, one_hot=False, randaugment=None):
        super().__init__()
        self._read = read
        self.labels = np.asarray(labels, "int32")
        self.size = tuple(image_size)
        self.batch_size = int(batch_size)
        self.training = bool(training)
        self.shuffle = bool(shuffle)
        self.drop_remainder = bool(drop_remainder)
        self.seed = int(seed)
        self.inception_crop = bool(inception_crop)
        self.crop_area_range = check_crop_area_range(crop_area_range)
        self.flip = bool(flip)
        self.per_batch = list(per_batch)
        self.randaugment = randaugment
        self.mixup = mixup
        self.num_classes = num_classes
        self.eval_convert = eval_convert
        self.one_hot = bool(one_hot or mixup is not None)
        self.epoch = 0
        self.offset = 0
        self.dense_labels = self.one_hot

    def set_epoch(self, epoch):
        """The epoch whose order and augmentation the next batches follow."""
        self.epoch = int(epoch)

    def on_epoch_end(self):
        # Plain `model.fit` (without `finetune`) gets a new epoch each time;
        # `finetune` sets the epoch Keras runs explicitly (`set_epoch`).
        self.epoch += 1

    def skip(self, batches):
        """A view starting `batches` batches into the current epoch."""
        view = object.__new__(type(self))
        view.__dict__.update(self.__dict__)
        view.offset = self.offset + int(batches)
        return view

    def with_one_hot(self, num_classes):
        """The same pipeline with float32 one-hot labels."""
        view = self.skip(0)
        view.num_classes, view.one_hot, view.dense_labels = num_classes, True, True
        return view

    def __len__(self):
        n = len(self.labels)
        batches = n // self.batch_size if self.drop_remainder else math.ceil(
            n / self.batch_size)
        return max(0, batches - self.offset)

    def order(self, epoch=None):
        """The example order of `epoch` (default: the current one)."""
        epoch = self.epoch if epoch is None else epoch
        if not self.shuffle:
            return np.arange(len(self.labels))
        return _rng(self.seed, epoch, 0, _SHUFFLE).permutation(len(self.labels))

    def _augment(self, image, index):
        if self.inception_crop:
            top, left, h, w = sample_crop(_rng(self.seed, self.epoch, index, _CROP),
                                          *image.shape[:2], self.crop_area_range)
            # Upstream's inception_crop: bilinear without antialiasing, then
            # the cast back to uint8 (floor of values in [0, 255]).
            image = np.floor(resize(image[top:top + h, left:left + w], self.size,
                                    antialias=False))
        else:
            image = resize(image, self.size, antialias=True)
        if self.flip and _rng(self.seed, self.epoch, index, _FLIP).random() < 0.5:
            image = image[:, ::-1]
        if self.randaugment is not None:
            image = self.randaugment(image, rng=_rng(self.seed, self.epoch, index, _RANDAUG))
        return image

    def __getitem__(self, batch):
        if not 0 <= batch < len(self):
            raise IndexError(f"Batch {batch} out of range (0..{len(self) - 1}).")
        start = (batch + self.offset) * self.batch_size
        indices = self.order()[start:start + self.batch_size]
        labels = self.labels[indices]
        if self.training:
            images = np.stack([self._augment(self._read(i), i) for i in indices])
            for layer in self.per_batch:
                images = keras.ops.convert_to_numpy(layer(images)).astype("float32")
            images = images * (2.0 / 255.0) - 1.0
        else:
            read = [self._read(i) for i in indices]
            if len({image.shape for image in read}) == 1:
                images = self.eval_convert(np.stack(read))
            else:  # image files of several sizes: each resized on its own
                images = np.concatenate([self.eval_convert(image[None])
                                         for image in read])
        if self.one_hot:
            labels = np.eye(self.num_classes, dtype="float32")[labels]
            if self.mixup is not None and self.training:
                data = {"images": images, "labels": labels}
                if isinstance(self.mixup, UpstreamMixUp):
                    # A generator of (seed, epoch, batch): a resumed or
                    # skipped pipeline mixes each batch as an unbroken one.
                    rng = _rng(self.seed, self.epoch, batch + self.offset, _MIXUP)
                    mixed = self.mixup(data, rng=rng)
                else:
                    mixed = self.mixup(data)
                return (keras.ops.convert_to_numpy(mixed["images"]).astype("float32"),
                        keras.ops.convert_to_numpy(mixed["labels"]).astype("float32"))
        return images.astype("float32"), labels


def array_reader(images, float_range=None):
    """`index -> float32 [0, 255] image` for `(N, H, W, 3)` arrays."""
    images = np.asarray(images)
    if np.issubdtype(images.dtype, np.integer) or float_range is None:
        return lambda i: images[i].astype("float32")
    low, high = float_range
    return lambda i: (images[i].astype("float32") - low) * (255.0 / (high - low))


def file_reader(files):
    """`index -> uint8 image` at the file's own resolution (as upstream)."""
    return lambda i: image_files.read_image(files[i])
