"""Patch and position embeddings of the Vision Transformer, and the resizing of
a learned position table to a new grid (as upstream when fine-tuning at another
resolution).
"""

import math

import keras
import numpy as np
from keras import ops

from keras_vmoe.utils.validation import check_one_of
from keras_vmoe.utils.validation import check_pair

POSITION_EMBEDDINGS = ("learned", "sincos2d", "none")


@keras.saving.register_keras_serializable(package="keras_vmoe")
class PatchEmbedding(keras.layers.Layer):
    """Embeds `P x P` patches (a stride-P convolution) and prepends a class
    token: `(B, H, W, C) -> (B, T, D)`."""

    def __init__(
        self,
        hidden_dim,
        patch_size,
        use_class_token=True,
        kernel_initializer="lecun_normal",
        **kwargs,
    ):
        super().__init__(**kwargs)
        self.hidden_dim = hidden_dim
        self.patch_size = patch_size
        self.use_class_token = use_class_token
        self.kernel_initializer = keras.initializers.get(kernel_initializer)
        self._patch = check_pair(patch_size, "patch_size")

    def build(self, input_shape):
        channels = input_shape[-1]
        self.kernel = self.add_weight(
            name="kernel", shape=(*self._patch, channels, self.hidden_dim),
            initializer=self.kernel_initializer)
        self.bias = self.add_weight(name="bias", shape=(self.hidden_dim,),
                                    initializer="zeros")
        if self.use_class_token:
            self.cls = self.add_weight(name="cls", shape=(1, 1, self.hidden_dim),
                                       initializer="zeros")

    def call(self, images):
        x = ops.conv(images, self.kernel, strides=self._patch, padding="valid",
                     data_format="channels_last")  # (B, H/P, W/P, D)
        x = x + self.bias
        batch, grid_h, grid_w, hidden = ops.shape(x)
        x = ops.reshape(x, (batch, grid_h * grid_w, hidden))  # (B, T, D)
        if self.use_class_token:
            cls = ops.broadcast_to(ops.cast(self.cls, x.dtype), (batch, 1, hidden))
            x = ops.concatenate([cls, x], axis=1)
        return x

    def compute_output_shape(self, input_shape):
        batch, height, width = input_shape[0], input_shape[1], input_shape[2]
        tokens = (height // self._patch[0]) * (width // self._patch[1])
        return (batch, tokens + int(self.use_class_token), self.hidden_dim)

    def get_config(self):
        config = super().get_config()
        config.update({"hidden_dim": self.hidden_dim, "patch_size": self.patch_size,
                       "use_class_token": self.use_class_token,
                       "kernel_initializer": keras.initializers.serialize(self.kernel_initializer)})
        return config


def sincos2d_position_embedding(grid_size, hidden_dim, temperature=10_000.0):
    """2-D sine-cosine position embedding (MoCo v3, as upstream): float32
    `(1, h·w, D)`, `[sin(x·ω), cos(x·ω), sin(y·ω), cos(y·ω)]` per position."""
    grid_h, grid_w = check_pair(grid_size, "grid_size")
    if hidden_dim % 4 or hidden_dim < 8:
        raise ValueError(
            "The sincos2d position embedding needs hidden_dim to be a multiple "
            f"of 4 and >= 8. Received: hidden_dim={hidden_dim}"
        )
    quarter = hidden_dim // 4
    omega = 1.0 / temperature ** (np.arange(quarter, dtype=np.float64) / (quarter - 1))
    ys, xs = np.meshgrid(np.arange(grid_h), np.arange(grid_w), indexing="ij")
    x_angles = xs.reshape(-1, 1) * omega[None]  # (T, D/4)
    y_angles = ys.reshape(-1, 1) * omega[None]
    table = np.concatenate(
        [np.sin(x_angles), np.cos(x_angles), np.sin(y_angles), np.cos(y_angles)],
        axis=1,
    )
    return table[None].astype("float32")


@keras.saving.register_keras_serializable(package="keras_vmoe")
class PositionEmbedding(keras.layers.Layer):
    """Adds a position embedding to the tokens of a `grid_size` patch grid:
    `kind` `"learned"` (weight `embedding` `(1, T, D)`, class token included),
    `"sincos2d"` (fixed; none for the class token) or `"none"`."""

    def __init__(
        self,
        grid_size,
        kind="learned",
        has_class_token=False,
        temperature=10_000.0,
        **kwargs,
    ):
        super().__init__(**kwargs)
        check_one_of(kind, "position_embedding", POSITION_EMBEDDINGS)
        self.grid_size = grid_size
        self.kind = kind
        self.has_class_token = has_class_token
        self.temperature = temperature
        self._grid = check_pair(grid_size, "grid_size")
        self._table = None

    @property
    def num_tokens(self):
        return self._grid[0] * self._grid[1] + int(self.has_class_token)

    def build(self, input_shape):
        hidden = input_shape[-1]
        if input_shape[1] is not None and input_shape[1] != self.num_tokens:
            raise ValueError(
                f"PositionEmbedding for a {self._grid} grid"
                f"{' plus a class token' if self.has_class_token else ''} expects "
                f"{self.num_tokens} tokens. Received input_shape={tuple(input_shape)}"
            )
        if self.kind == "learned":
            self.embedding = self.add_weight(
                name="embedding",
                shape=(1, self.num_tokens, hidden),
                initializer=keras.initializers.RandomNormal(stddev=0.02),
            )
        elif self.kind == "sincos2d":
            self._table = sincos2d_position_embedding(
                self._grid, hidden, self.temperature
            )

    def call(self, x):
        if self.kind == "none":
            return x
        tokens = x.shape[1]
        if tokens is not None and tokens != self.num_tokens:
            extra = int(self.has_class_token)
            raise ValueError(
                f"The position embedding is for a {self._grid[0]}x{self._grid[1]} "
                f"patch grid ({self.num_tokens} tokens"
                f"{' with the class token' if extra else ''}); the input has "
                f"{tokens} tokens ({tokens - extra} patches): the images do not "
                "have the model's `image_size`. Resize the images, or rebuild "
                "the model for their size (e.g. `from_preset(..., image_size=...)`)."
            )
        if self.kind == "learned":
            return x + ops.cast(self.embedding, x.dtype)
        table = ops.cast(self._table, x.dtype)
        if not self.has_class_token:
            return x + table
        return ops.concatenate([x[:, :1], x[:, 1:] + table], axis=1)

    def compute_output_shape(self, input_shape):
        return input_shape

    def get_config(self):
        config = super().get_config()
        config.update({"grid_size": self.grid_size, "kind": self.kind,
                       "has_class_token": self.has_class_token, "temperature": self.temperature})
        return config


def resize_position_embedding(pos_emb, new_grid, has_cls, old_grid=None):
    """Resizes a learned position embedding to a new patch grid, bilinearly
    (upstream's `vit_zoom`); the class-token row is kept.

    `pos_emb` is `(1, T, D)`; `old_grid` defaults to a square grid. Returns a
    NumPy array `(1, h·w (+1), D)` of `pos_emb`'s dtype.
    """
    import scipy.ndimage

    pos_emb = np.asarray(pos_emb)
    if pos_emb.ndim != 3 or pos_emb.shape[0] != 1:
        raise ValueError(
            f"`pos_emb` must have shape (1, T, D). Received shape {pos_emb.shape}"
        )
    cls_rows = pos_emb[:, :1] if has_cls else pos_emb[:, :0]
    grid_rows = pos_emb[0, 1:] if has_cls else pos_emb[0]
    num_grid = grid_rows.shape[0]
    if old_grid is None:
        side = int(round(math.sqrt(num_grid)))
        if side * side != num_grid:
            raise ValueError(
                f"Cannot infer a square grid from {num_grid} grid tokens; pass "
                "`old_grid=(h, w)`."
            )
        old_grid = (side, side)
    old_h, old_w = check_pair(old_grid, "old_grid")
    new_h, new_w = check_pair(new_grid, "new_grid")
    if old_h * old_w != num_grid:
        raise ValueError(
            f"old_grid={old_grid} has {old_h * old_w} positions but the embedding "
            f"has {num_grid} grid tokens."
        )
    grid = grid_rows.reshape(old_h, old_w, -1).astype("float32")
    if (old_h, old_w) != (new_h, new_w):
        grid = scipy.ndimage.zoom(grid, (new_h / old_h, new_w / old_w, 1), order=1)
    grid = grid.reshape(1, new_h * new_w, -1).astype(pos_emb.dtype)
    return np.concatenate([cls_rows, grid], axis=1)
