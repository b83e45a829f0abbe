"""Encoder features for dense prediction: the tokens of any blocks.

`extract_features` returns, from one call, the token sequences of chosen
encoder blocks (with or without the class token, optionally as a
`(B, h, w, D)` patch grid) and the expert assignments of every MoE block
that ran, in the spirit of timm's `forward_intermediates`. The symbolic
counterpart, for building a Keras feature model, is
`VisionTransformerBackbone.block_outputs`.
"""

import numpy as np
from keras import ops

from keras_vmoe.models.routing_analysis import block_assignments
from keras_vmoe.models.routing_analysis import jit_stateless
from keras_vmoe.models.routing_analysis import run_encoder
from keras_vmoe.models.routing_analysis import to_numpy_assignments
from keras_vmoe.preprocessing.value_range import check_pixel_values
from keras_vmoe.utils.validation import check_bool
from keras_vmoe.utils.validation import is_int


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


def _check_images(images):
    """The backbone's input: finite float images in [-1, 1], as `predict`
    and serving check them (with the same 1e-3 slack)."""
    array = np.asarray(ops.convert_to_numpy(images)) if not isinstance(
        images, np.ndarray) else images
    if array.dtype.kind in "iub":
        raise ValueError(
            "The backbone takes float images in [-1, 1]; received "
            f"{array.dtype} images. Convert them first (a task's "
            "`image_converter`, or `images / 127.5 - 1`).")
    check_pixel_values(array, (-1.0, 1.0))


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
):
    """Token sequences of chosen encoder blocks, from one call.

    Args:
        backbone: a `VisionTransformerBackbone`.
        images: `(B, H, W, C)` float array in [-1, 1] (checked, as
            `predict` checks its input: [0, 255] values or NaN raise).
        blocks: `None` (every block), a block index or a sequence of them
            (negative indices count from the end: `-1` is the last block).
        norm: bool, apply the backbone's final `encoder_norm` to each
            returned block (the last block with `norm=True` is the
            backbone's token output).
        class_token: bool, keep the class token (first token, present with
            `classifier="token"`).
        grid: bool, return the patch tokens as a `(B, h, w, D)` grid
            (`h, w = backbone.grid_size`). Needs `class_token=False` when
            the backbone has a class token.
        return_routing: bool, also return the expert assignments of every
            MoE block that ran (`routing_assignments` format).
        training: bool, run as in training (dropout, routing noise).
        jit_compile: bool, compile the run (JAX backend).

    Returns:
        `{"encoderblock_i": tokens}` of NumPy arrays `(B, T, D)` (or
        `(B, h, w, D)` with `grid=True`); with `return_routing=True`, a
        pair `(features, routing)` where `routing` is
        `{"encoderblock_j": {"processed": (B, T, E), ..., "capacity": int}}`
        for the MoE blocks up to the deepest requested block. For E³
        (`ensemble_size=N > 1`) the rows after the first MoE block are the
        B·N member copies (member index fastest).
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
    _check_images(images)
    images = ops.convert_to_tensor(images, dtype="float32")
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
