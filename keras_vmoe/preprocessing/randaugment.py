"""RandAugment as upstream's `randaug(N, M)` (`distort_image_with_randaugment`).

The operations and their arguments are tabulated in the fine-tuning guide.
TensorFlow (for `tf.data`) and NumPy implement the same formulas: each draws
a *plan* (operation, sign and Cutout centre per layer), and a plan applied by
either gives the same image.
"""

import math

import numpy as np

from keras_vmoe.utils.validation import check_int

OPS = ("AutoContrast", "Equalize", "Invert", "Rotate", "Posterize", "Solarize",
       "Color", "Contrast", "Brightness", "Sharpness", "ShearX", "ShearY",
       "TranslateX", "TranslateY", "Cutout", "SolarizeAdd")
MAX_LEVEL = 10.0
FILL = 128
TRANSLATE_CONST = 100.0
CUTOUT_CONST = 40
MAX_NUM_LAYERS = 100
MAX_MAGNITUDE = 30.0
# The grayscale weights of `tf.image.rgb_to_grayscale`.
_GRAY = np.array([0.2989, 0.587, 0.114], "float32")
# The entry of the identity transform that each shear or translation sets.
_AFFINE_INDEX = {"ShearX": 1, "ShearY": 3, "TranslateX": 2, "TranslateY": 5}


def level_args(magnitude):
    """The (unsigned) arguments of the operations at `magnitude`."""
    level = float(magnitude) / MAX_LEVEL
    return {
        "rotate": level * 30.0,
        "posterize": int(level * 4),
        "solarize": int(level * 256),
        "solarize_add": int(level * 110),
        "enhance": level * 1.8 + 0.1,
        "shear": level * 0.3,
        "translate": level * TRANSLATE_CONST,
        "cutout": int(level * CUTOUT_CONST),
    }


def rotate_transform(degrees, height, width):
    """The float32 projective transform (output -> input) of a rotation about
    the centre (TensorFlow's `angles_to_projective_transforms`)."""
    f32 = np.float32
    radians = f32(degrees) * f32(math.pi / 180.0)
    cos, sin = np.cos(radians), np.sin(radians)
    w, h = f32(width - 1), f32(height - 1)
    x_offset = (w - (cos * w - sin * h)) / f32(2.0)
    y_offset = (h - (sin * w + cos * h)) / f32(2.0)
    return [cos, -sin, x_offset, sin, cos, y_offset, f32(0.0), f32(0.0)]


def posterize_shift(bits):
    """The shift of upstream's Posterize: `8 - bits` as uint8, clamped to 0..7."""
    return min(7, (8 - int(bits)) % 256)


def solarize_threshold(threshold):
    """The threshold of upstream's Solarize, wrapped to uint8 as TensorFlow does."""
    return int(threshold) % 256


def op_transform(op, value, height, width):
    """The transform of geometric operation `op` with signed argument `value`."""
    if op == "Rotate":
        return rotate_transform(value, height, width)
    if op not in _AFFINE_INDEX:
        raise ValueError(f"Not a geometric operation: {op!r}")
    transform = [1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0]
    transform[_AFFINE_INDEX[op]] = value
    return transform


def _check(num_layers, magnitude):
    check_int(num_layers, "num_layers", minimum=0, maximum=MAX_NUM_LAYERS)
    try:
        value = float(magnitude)
    except (TypeError, ValueError):
        value = float("nan")
    if isinstance(magnitude, bool) or not 0.0 <= value <= MAX_MAGNITUDE:
        raise ValueError(
            f"RandAugment `magnitude` must be a number in [0, {MAX_MAGNITUDE:g}] "
            f"(upstream's scale: 10 = each operation's listed maximum). "
            f"Received: magnitude={magnitude!r}")
    return int(num_layers), value


def _blend_np(degenerate, image, factor):
    # Upstream's `blend`: float32 `d + factor·(image - d)`, clipped when
    # extrapolating, truncated to uint8.
    if factor == 0.0:
        return degenerate.astype("uint8")
    if factor == 1.0:
        return image.astype("uint8")
    d = degenerate.astype("float32")
    temp = d + np.float32(factor) * (image.astype("float32") - d)
    return np.clip(temp, 0.0, 255.0).astype("uint8")


def _gray_np(image):
    # `tf.image.rgb_to_grayscale` on uint8: to [0, 1] float32, weighted sum,
    # back to uint8 by truncating `x·255.5`.
    x = image.astype("float32") * np.float32(1.0 / 255.0)
    gray = (x * _GRAY).sum(axis=-1, dtype="float32")
    return (gray * np.float32(255.5)).astype("uint8")


def _autocontrast_np(image):
    out = image.copy()
    for c in range(image.shape[-1]):
        channel = image[..., c]
        lo, hi = np.float32(channel.min()), np.float32(channel.max())
        if hi > lo:
            scale = np.float32(255.0) / (hi - lo)
            scaled = channel.astype("float32") * scale + (-lo * scale)
            out[..., c] = np.clip(scaled, 0.0, 255.0).astype("uint8")
    return out


def _equalize_np(image):
    out = image.copy()
    for c in range(image.shape[-1]):
        channel = image[..., c].astype("int64")
        histo = np.bincount(channel.ravel(), minlength=256)
        nonzero = histo[histo != 0]
        step = (nonzero.sum() - nonzero[-1]) // 255
        if step == 0:
            continue
        lut = (np.cumsum(histo) + step // 2) // step
        lut = np.clip(np.concatenate([[0], lut[:-1]]), 0, 255)
        out[..., c] = lut[channel].astype("uint8")
    return out


def _sharpness_np(image, factor):
    x = image.astype("float32")
    kernel = np.array([[1, 1, 1], [1, 5, 1], [1, 1, 1]], "float32") / np.float32(13.0)
    h, w = image.shape[:2]
    if h < 3 or w < 3:
        return _blend_np(image, image, factor)
    smooth = np.zeros((h - 2, w - 2, image.shape[-1]), "float32")
    for dy in range(3):
        for dx in range(3):
            smooth += kernel[dy, dx] * x[dy:dy + h - 2, dx:dx + w - 2]
    degenerate = image.copy()
    degenerate[1:-1, 1:-1] = np.clip(smooth, 0.0, 255.0).astype("uint8")
    return _blend_np(degenerate, image, factor)


def transform_np(image, transform, fill=FILL):
    """Nearest-neighbour projective transform of a uint8 `(H, W, C)` image
    (rounded half away from zero; outside: `fill`)."""
    h, w = image.shape[:2]
    t = np.asarray(transform, "float32")
    y, x = np.meshgrid(np.arange(h, dtype="float32"), np.arange(w, dtype="float32"),
                       indexing="ij")
    in_x = t[0] * x + t[1] * y + t[2]
    in_y = t[3] * x + t[4] * y + t[5]
    in_x = np.sign(in_x) * np.floor(np.abs(in_x) + np.float32(0.5))
    in_y = np.sign(in_y) * np.floor(np.abs(in_y) + np.float32(0.5))
    inside = (in_x >= 0) & (in_x < w) & (in_y >= 0) & (in_y < h)
    xi = np.clip(in_x, 0, w - 1).astype("int64")
    yi = np.clip(in_y, 0, h - 1).astype("int64")
    out = image[yi, xi]
    out[~inside] = fill
    return out


def cutout_np(image, center, pad_size, fill=FILL):
    """Upstream's Cutout: the `2·pad_size` square at `center` set to `fill`."""
    h, w = image.shape[:2]
    cy, cx = int(center[0]), int(center[1])
    out = image.copy()
    out[max(0, cy - pad_size):min(h, cy + pad_size),
        max(0, cx - pad_size):min(w, cx + pad_size)] = fill
    return out


def apply_op_np(image, op, magnitude, sign=1.0, center=(0, 0)):
    """Upstream's operation `op` (in `OPS`) on a uint8 `(H, W, 3)` image;
    `sign` (±1) negates Rotate, Shear and Translate; `center`: Cutout's."""
    args = level_args(magnitude)
    image = np.asarray(image, "uint8")
    if op == "AutoContrast":
        return _autocontrast_np(image)
    if op == "Equalize":
        return _equalize_np(image)
    if op == "Invert":
        return 255 - image
    if op in ("Rotate", "ShearX", "ShearY", "TranslateX", "TranslateY"):
        key = {"Rotate": "rotate", "ShearX": "shear", "ShearY": "shear"}.get(op, "translate")
        return transform_np(image, op_transform(op, sign * args[key], *image.shape[:2]))
    if op == "Posterize":
        shift = posterize_shift(args["posterize"])
        return ((image >> shift) << shift).astype("uint8")
    if op == "Solarize":
        threshold = solarize_threshold(args["solarize"])
        return np.where(image < threshold, image, 255 - image).astype("uint8")
    if op == "SolarizeAdd":
        added = np.clip(image.astype("int64") + args["solarize_add"], 0, 255).astype("uint8")
        return np.where(image < 128, added, image)
    factor = args["enhance"]
    if op == "Color":
        gray = _gray_np(image)[..., None].repeat(image.shape[-1], -1)
        return _blend_np(gray, image, factor)
    if op == "Contrast":
        # Upstream's mean: sum of the 256-bin histogram (the pixel count) / 256.
        mean = np.float32(image.shape[0] * image.shape[1]) / np.float32(256.0)
        degenerate = np.full(image.shape, min(mean, np.float32(255.0)), "float32")
        return _blend_np(degenerate.astype("uint8"), image, factor)
    if op == "Brightness":
        return _blend_np(np.zeros_like(image), image, factor)
    if op == "Sharpness":
        return _sharpness_np(image, factor)
    if op == "Cutout":
        return cutout_np(image, center, args["cutout"])
    raise ValueError(f"Unknown RandAugment operation {op!r}. Valid: {OPS}.")


def _tf():
    import tensorflow as tf

    return tf


def _blend_tf(degenerate, image, factor):
    tf = _tf()
    if factor == 0.0:
        return tf.cast(degenerate, "uint8")
    if factor == 1.0:
        return tf.cast(image, "uint8")
    d = tf.cast(degenerate, "float32")
    temp = d + tf.constant(factor, "float32") * (tf.cast(image, "float32") - d)
    return tf.cast(tf.clip_by_value(temp, 0.0, 255.0), "uint8")


def _autocontrast_tf(image):
    tf = _tf()

    def channel(im):
        lo = tf.cast(tf.reduce_min(im), "float32")
        hi = tf.cast(tf.reduce_max(im), "float32")
        safe = tf.maximum(hi - lo, 1.0)
        scale = 255.0 / safe
        scaled = tf.cast(im, "float32") * scale + (-lo * scale)
        scaled = tf.cast(tf.clip_by_value(scaled, 0.0, 255.0), "uint8")
        return tf.where(hi > lo, scaled, im)

    return tf.stack([channel(image[..., c]) for c in range(3)], -1)


def _equalize_tf(image):
    tf = _tf()

    def channel(im):
        im = tf.cast(im, "int32")
        histo = tf.math.bincount(tf.reshape(im, [-1]), minlength=256, maxlength=256)
        nonzero = tf.boolean_mask(histo, histo != 0)
        step = (tf.reduce_sum(nonzero) - nonzero[-1]) // 255
        safe = tf.maximum(step, 1)
        lut = (tf.cumsum(histo) + safe // 2) // safe
        lut = tf.clip_by_value(tf.concat([[0], lut[:-1]], 0), 0, 255)
        return tf.cast(tf.where(step == 0, im, tf.gather(lut, im)), "uint8")

    return tf.stack([channel(image[..., c]) for c in range(3)], -1)


def _sharpness_tf(image, factor):
    tf = _tf()
    # Upstream's 3x3 smoothing (PIL's SMOOTH kernel / 13, valid), summed
    # term by term in `_sharpness_np`'s order so both agree to the bit.
    x = tf.cast(image, "float32")
    shape = tf.shape(image)
    h, w = shape[0], shape[1]
    smooth = tf.zeros([h - 2, w - 2, 3], "float32")
    for dy in range(3):
        for dx in range(3):
            weight = np.float32(5.0 if (dy, dx) == (1, 1) else 1.0) / np.float32(13.0)
            smooth += weight * x[dy:dy + h - 2, dx:dx + w - 2]
    smooth = tf.cast(tf.clip_by_value(smooth, 0.0, 255.0), "uint8")
    mask = tf.pad(tf.ones_like(smooth), [[1, 1], [1, 1], [0, 0]])
    degenerate = tf.where(mask == 1, tf.pad(smooth, [[1, 1], [1, 1], [0, 0]]), image)
    return _blend_tf(degenerate, image, factor)


def transform_tf(image, transform, fill=FILL):
    """`transform_np` with TensorFlow's `ImageProjectiveTransformV3`."""
    tf = _tf()
    out = tf.raw_ops.ImageProjectiveTransformV3(
        images=image[None], transforms=tf.cast(tf.reshape(transform, [1, 8]), "float32"),
        output_shape=tf.shape(image)[:2], fill_value=float(fill),
        interpolation="NEAREST", fill_mode="CONSTANT")
    return out[0]


def _rotate_transform_tf(degrees, height, width):
    tf = _tf()
    radians = tf.cast(degrees, "float32") * (math.pi / 180.0)
    cos, sin = tf.cos(radians), tf.sin(radians)
    w, h = tf.cast(width - 1, "float32"), tf.cast(height - 1, "float32")
    x_offset = (w - (cos * w - sin * h)) / 2.0
    y_offset = (h - (sin * w + cos * h)) / 2.0
    return tf.stack([cos, -sin, x_offset, sin, cos, y_offset, 0.0, 0.0])


def cutout_tf(image, center, pad_size, fill=FILL):
    tf = _tf()
    shape = tf.shape(image)
    rows = tf.range(shape[0])[:, None, None]
    cols = tf.range(shape[1])[None, :, None]
    inside = ((rows >= center[0] - pad_size) & (rows < center[0] + pad_size)
              & (cols >= center[1] - pad_size) & (cols < center[1] + pad_size))
    return tf.where(inside, tf.constant(fill, image.dtype), image)


def apply_op_tf(image, op_index, magnitude, sign=1.0, center=(0, 0)):
    """`apply_op_np` with TensorFlow ops; `op_index` (int or tensor) indexes `OPS`."""
    tf = _tf()
    args = level_args(magnitude)
    image = tf.cast(image, "uint8")
    sign = tf.cast(sign, "float32")
    shape = tf.shape(image)
    factor = args["enhance"]
    center = tf.cast(center, "int32")

    def geometric(name, value):
        if name == "Rotate":
            transform = _rotate_transform_tf(value, shape[0], shape[1])
        else:
            transform = tf.constant(op_transform(name, 1.0, 2, 2), "float32")
            transform = tf.tensor_scatter_nd_update(
                transform, [[_AFFINE_INDEX[name]]], [value])
        return lambda: transform_tf(image, transform)

    def gray():
        g = tf.image.rgb_to_grayscale(image)
        return tf.image.grayscale_to_rgb(g)

    def contrast():
        pixels = tf.cast(shape[0] * shape[1], "float32")
        mean = tf.minimum(pixels / 256.0, 255.0)
        return _blend_tf(tf.cast(tf.fill(tf.shape(image), mean), "uint8"), image, factor)

    shift = posterize_shift(args["posterize"])
    branches = {
        "AutoContrast": lambda: _autocontrast_tf(image),
        "Equalize": lambda: _equalize_tf(image),
        "Invert": lambda: 255 - image,
        "Rotate": geometric("Rotate", sign * args["rotate"]),
        "Posterize": lambda: tf.bitwise.left_shift(
            tf.bitwise.right_shift(image, tf.constant(shift, "uint8")),
            tf.constant(shift, "uint8")),
        "Solarize": lambda: tf.where(
            image < tf.constant(solarize_threshold(args["solarize"]), "uint8"),
            image, 255 - image),
        "Color": lambda: _blend_tf(gray(), image, factor),
        "Contrast": contrast,
        "Brightness": lambda: _blend_tf(tf.zeros_like(image), image, factor),
        "Sharpness": lambda: _sharpness_tf(image, factor),
        "ShearX": geometric("ShearX", sign * args["shear"]),
        "ShearY": geometric("ShearY", sign * args["shear"]),
        "TranslateX": geometric("TranslateX", sign * args["translate"]),
        "TranslateY": geometric("TranslateY", sign * args["translate"]),
        "Cutout": lambda: cutout_tf(image, center, args["cutout"]),
        "SolarizeAdd": lambda: tf.where(
            image < 128,
            tf.cast(tf.clip_by_value(tf.cast(image, "int32") + args["solarize_add"], 0, 255),
                    "uint8"),
            image),
    }
    if isinstance(op_index, (int, np.integer)):
        return branches[OPS[int(op_index)]]()
    out = tf.switch_case(tf.cast(op_index, "int32"), [branches[name] for name in OPS])
    return tf.ensure_shape(out, image.shape)


class UpstreamRandAugment:
    """Upstream's RandAugment (`randaug(num_layers, magnitude)`).

    Each of `num_layers` layers applies one of the 16 operations of `OPS`,
    chosen uniformly, at `magnitude`. Images are taken as uint8 (floats are
    truncated) and returned as float32 in [0, 255].

    Args:
        num_layers: int in [0, 100], operations per image (upstream's N).
        magnitude: number in [0, 30], upstream's M (10 = each operation's
            listed maximum).
        seed: int or None, seed of the draws when none is passed per call.

    Examples:

    ```python
    import numpy as np
    from keras_vmoe.preprocessing import UpstreamRandAugment

    augment = UpstreamRandAugment(2, 10, seed=0)
    image = np.random.default_rng(0).integers(0, 256, (32, 32, 3), "uint8")
    out = augment(image)   # float32 (32, 32, 3) in [0, 255]
    ```
    """

    def __init__(self, num_layers, magnitude, seed=None):
        self.num_layers, self.magnitude = _check(num_layers, magnitude)
        self.seed = seed
        self._rng = None

    def plan_np(self, rng, height, width):
        """`(ops, signs, centers)` of every layer drawn with numpy `rng`."""
        ops = rng.integers(0, len(OPS), self.num_layers)
        signs = np.where(rng.random(self.num_layers) < 0.5, -1.0, 1.0)
        centers = np.stack([rng.integers(0, height, self.num_layers),
                            rng.integers(0, width, self.num_layers)], -1)
        return ops, signs, centers

    def plan_tf(self, height, width, seed=None):
        """`(ops, signs, centers)` tensors; stateless when `seed` is given."""
        tf = _tf()
        n = self.num_layers
        if seed is not None:
            s = tf.unstack(tf.random.experimental.stateless_split(seed, 4))
            ops = tf.random.stateless_uniform([n], s[0], 0, len(OPS), "int32")
            signs = tf.where(tf.random.stateless_uniform([n], s[1]) < 0.5, -1.0, 1.0)
            rows = tf.random.stateless_uniform([n], s[2], 0, height, "int32")
            cols = tf.random.stateless_uniform([n], s[3], 0, width, "int32")
        else:
            # Distinct op seeds: ops sharing one seed draw correlated streams.
            seeds = [None] * 4 if self.seed is None else [self.seed + i for i in range(4)]
            ops = tf.random.uniform([n], 0, len(OPS), "int32", seed=seeds[0])
            signs = tf.where(tf.random.uniform([n], seed=seeds[1]) < 0.5, -1.0, 1.0)
            rows = tf.random.uniform([n], 0, height, "int32", seed=seeds[2])
            cols = tf.random.uniform([n], 0, width, "int32", seed=seeds[3])
        return ops, signs, tf.stack([rows, cols], -1)

    def apply_plan_np(self, image, plan):
        image = np.asarray(image)
        if image.dtype != np.uint8:
            image = np.clip(image, 0, 255).astype("uint8")
        for op, sign, center in zip(*plan, strict=True):
            image = apply_op_np(image, OPS[int(op)], self.magnitude, sign, center)
        return image.astype("float32")

    def apply_plan_tf(self, image, plan):
        tf = _tf()
        if image.dtype != tf.uint8:
            image = tf.cast(tf.clip_by_value(image, 0, 255), "uint8")
        ops, signs, centers = plan
        for i in range(self.num_layers):
            image = apply_op_tf(image, ops[i], self.magnitude, signs[i], centers[i])
        return tf.cast(image, "float32")

    def __call__(self, images, seed=None, rng=None):
        """Augments one image `(H, W, 3)` or a batch `(B, H, W, 3)`.

        Args:
            images: a `tf.Tensor` (TensorFlow ops) or a NumPy array.
            seed: TensorFlow only: optional `(2,)` int stateless seed (for a
                batch, each image gets a seed split from it).
            rng: NumPy only: optional `np.random.Generator`.
        """
        if type(images).__module__.startswith("tensorflow"):
            return self._call_tf(images, seed)
        if rng is None:
            if self._rng is None:
                self._rng = np.random.default_rng(self.seed)
            rng = self._rng
        images = np.asarray(images)
        if images.ndim == 4:
            return np.stack([self(image, rng=rng) for image in images])
        return self.apply_plan_np(images, self.plan_np(rng, *images.shape[:2]))

    def _call_tf(self, images, seed):
        tf = _tf()

        def one(image, image_seed=None):
            shape = tf.shape(image)
            plan = self.plan_tf(shape[0], shape[1], image_seed)
            return self.apply_plan_tf(image, plan)

        if images.shape.rank == 4:
            if seed is None:
                return tf.map_fn(one, images, fn_output_signature=tf.float32)
            seeds = tf.random.experimental.stateless_split(seed, tf.shape(images)[0])
            return tf.map_fn(lambda x: one(x[0], x[1]), (images, seeds),
                             fn_output_signature=tf.float32)
        return one(images, seed)
