"""Encoder features for dense prediction: the tokens of any blocks.

`extract_features` returns, from one call, the token sequences of chosen
encoder blocks (optionally as a `(B, h, w, D)` patch grid) and the expert
assignments of the MoE blocks, in the spirit of timm's `forward_intermediates`.
"""

import numpy as np
from keras import ops

from keras_vmoe.models.image_classifier_preprocessor import passes_unchanged
from keras_vmoe.models.routing_analysis import block_assignments
from keras_vmoe.models.routing_analysis import jit_stateless
from keras_vmoe.models.routing_analysis import run_encoder
from keras_vmoe.models.routing_analysis import to_numpy_assignments
from keras_vmoe.preprocessing import ImageConverter
from keras_vmoe.preprocessing.value_range import check_pixel_values
from keras_vmoe.utils.validation import check_bool
from keras_vmoe.utils.validation import is_int

_CONVERT_CHUNK = 256


def convert_images(images, converter):
    """Raw images (an array, or a list of images or batches of any sizes) ->
    the model's float32 input, as a task's `predict` converts them."""
    if isinstance(images, (list, tuple)):
        if not images:
            raise ValueError("`images` is an empty list; pass at least one image.")
        batches = []
        for index, image in enumerate(images):
            image = np.asarray(image)
            try:
                batches.append(convert_images(image[None] if image.ndim == 3 else image,
                                              converter))
            except ValueError as error:
                raise ValueError(f"Image {index} of the list: {error}") from None
        return np.concatenate([np.asarray(b, dtype="float32") for b in batches])
    if not hasattr(images, "shape") or not hasattr(images, "dtype"):
        images = np.asarray(images)
    # `extract_features` takes another converter as `image_converter=`.
    declare = ("image_converter=keras_vmoe.preprocessing.ImageConverter("
               f"{converter.image_size!r}, float_range=({{low}}, {{high}}))")
    if passes_unchanged(images, converter):
        # As `predict` checks its input: [0, 255] values or NaN raise.
        check_pixel_values(np.asarray(ops.convert_to_numpy(images)), (-1.0, 1.0), declare)
        return images
    converter.check_images(tuple(images.shape), images.dtype)
    images = np.asarray(ops.convert_to_numpy(images))
    check_pixel_values(images, tuple(converter.float_range), declare)
    return np.concatenate([
        np.asarray(converter(images[i:i + _CONVERT_CHUNK]), dtype="float32")
        for i in range(0, len(images), _CONVERT_CHUNK)])


def normalize_block_indices(blocks, num_layers):
    """`blocks` (None, an int or ints; negative counts from the end) as a
    sorted tuple of block indices in `[0, num_layers)`."""
    if blocks is None:
        return tuple(range(num_layers))
    if is_int(blocks):
        blocks = (blocks,)
    if not isinstance(blocks, (list, tuple, range, np.ndarray)):
        raise ValueError(
            "`blocks` must be None, a block index (int) or a sequence of them "
            f"(num_layers={num_layers}). Received: blocks={blocks!r}"
        )
    indices = []
    for index in blocks:
        if not is_int(index) or not -num_layers <= index < num_layers:
            raise ValueError(
                f"`blocks` must hold block indices in [{-num_layers}, "
                f"{num_layers - 1}] (num_layers={num_layers}). Received: "
                f"blocks={blocks!r}"
            )
        indices.append(int(index) % num_layers)
    if not indices:
        raise ValueError("`blocks` must name at least one block. Received: blocks=()")
    return tuple(sorted(set(indices)))


def extract_features(
    backbone,
    images,
    blocks=None,
    norm=False,
    class_token=True,
    grid=False,
    return_routing=False,
    training=False,
    jit_compile=True,
    image_converter=None,
):
    """Token sequences of chosen encoder blocks of `backbone`, from one call.

    Args:
        images: what a task's `predict` accepts (an array of any size, or
            a list of raw images).
        blocks: `None` (every block), a block index or a sequence of them
            (negative indices count from the end).
        norm: bool, apply the backbone's final `encoder_norm`.
        class_token: bool, keep the class token (`classifier="token"`).
        grid: bool, return the patch tokens as a `(B, h, w, D)` grid
            (needs `class_token=False` with a class token).
        return_routing: bool, also return the expert assignments of the
            MoE blocks that ran (`routing_assignments` format).
        training: bool, run as in training (dropout, routing noise).
        jit_compile: bool, compile the run (JAX backend).
        image_converter: the `ImageConverter` to apply (default:
            `ImageConverter(backbone.image_size)`).

    Returns:
        `{"encoderblock_i": (B, T, D) or (B, h, w, D) array}`; with
        `return_routing=True`, a pair `(features, routing)`. For E³ the
        rows after the first MoE block are the B·N member copies.
    """
    indices = normalize_block_indices(blocks, backbone.num_layers)
    class_token = check_bool(class_token, "class_token")
    grid = check_bool(grid, "grid")
    has_class_token = backbone.classifier == "token"
    if grid and has_class_token and class_token:
        raise ValueError(
            "A (B, h, w, D) grid holds the patch tokens only; pass "
            "`class_token=False` with `grid=True` for a backbone with a class "
            f"token (classifier={backbone.classifier!r})."
        )
    training = check_bool(training, "training")
    return_routing = check_bool(return_routing, "return_routing")
    norm = check_bool(norm, "norm")
    if image_converter is None:
        image_converter = ImageConverter(backbone.image_size, name="image_converter")
    images = ops.convert_to_tensor(convert_images(images, image_converter),
                                   dtype="float32")
    moe_layers = set(backbone.moe_layers)
    wanted = set(indices)
    encoder_norm = backbone.get_layer("encoder_norm")

    def run(x_images):
        def run_block(i, block, x):
            routing = None
            if return_routing and i in moe_layers:
                x, routing = block_assignments(block, x, training)
            else:
                x = block(x, training=training)
            tokens = None
            if i in wanted:
                tokens = encoder_norm(x) if norm else x
            return x, (tokens, routing)

        results = run_encoder(backbone, x_images, training, max(indices), run_block)
        features = {k: v[0] for k, v in results.items() if v[0] is not None}
        routing = {k: v[1] for k, v in results.items() if v[1] is not None}
        return features, routing

    key = ("features", indices, norm, return_routing, training)
    features, routing = jit_stateless(backbone, key, run, images, jit_compile)
    out = {}
    for name, tokens in features.items():
        tokens = np.asarray(ops.convert_to_numpy(tokens))
        if has_class_token and not class_token:
            tokens = tokens[:, 1:]
        if grid:
            h, w = backbone.grid_size
            tokens = tokens.reshape(tokens.shape[0], h, w, tokens.shape[-1])
        out[name] = tokens
    if return_routing:
        return out, to_numpy_assignments(routing)
    return out
