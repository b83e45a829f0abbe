"""Building blocks of the (MoE) Vision Transformer.

Axis letters: B batch, H/W image or grid height/width, P patch size,
T tokens per image, D hidden size, M MLP size, N heads (in attention) or
ensemble members (in E³), K head size D/N, E experts.

Numerics follow upstream (flax) conventions: LayerNorm epsilon 1e-6,
tanh-approximated GELU, plain `softmax(q·k/√K)` attention, xavier-uniform
attention/MLP kernels with the fans of the flattened 2-D matrix (as
`flax.linen.DenseGeneral`), MLP biases `normal(1e-6)`.

Weight paths
------------
Variable paths are part of the API: the upstream checkpoint converter and
the distribution layout maps are written against them. For a
`VisionTransformerBackbone` (`variable.path`, no model prefix) and the
task heads:

```
patch_embedding/kernel                       (P, P, 3, D)
patch_embedding/bias                         (D,)
patch_embedding/cls                          (1, 1, D)    classifier="token"
position_embedding/embedding                 (1, T, D)    "learned" only
encoderblock_{i}/layer_norm_0/gamma|beta     (D,)
encoderblock_{i}/attention/query/kernel      (D, N, K)    also key, value
encoderblock_{i}/attention/query/bias        (N, K)       also key, value
encoderblock_{i}/attention/query_ln/gamma    (K,)         qk_norm, also key_ln
encoderblock_{i}/attention/out/kernel        (N, K, D)
encoderblock_{i}/attention/out/bias          (D,)
encoderblock_{i}/layer_norm_1/gamma|beta     (D,)
# dense blocks
encoderblock_{i}/mlp/dense_0/kernel|bias     (D, M), (M,)
encoderblock_{i}/mlp/dense_1/kernel|bias     (M, D), (D,)
# MoE blocks (MoeLayer / PartitionedMoE / SoftMoE)
encoderblock_{i}/moe/experts/kernel_0        (E, D, M)
encoderblock_{i}/moe/experts/bias_0          (E, M)
encoderblock_{i}/moe/experts/kernel_1        (E, M, D)
encoderblock_{i}/moe/experts/bias_1          (E, D)
encoderblock_{i}/moe/router/kernel           (D, E)        sparse
                                             (D, N, E/N)   E³ (partitioned)
encoderblock_{i}/moe/router/mu               (D, E, slots) soft
encoderblock_{i}/moe/router/scale            ()            soft
encoder_norm/gamma|beta                      (D,)
map_head/probe                               (1, 1, D)     classifier="map"
map_head/attention/{query,key,value,out}/... as in the blocks
map_head/layer_norm/gamma|beta               (D,)
map_head/mlp/dense_0|dense_1/kernel|bias
pre_logits/kernel|bias                       (D, R), (R,)  representation_size
head/kernel|bias                             (R or D, C), (C,)   tasks only
```

The non-trainable `seed_generator_state` variables of dropout layers and
routers are not weights (they are not in `model.weights`).

Upstream (flax) names map one to one: `embedding` -> `patch_embedding`,
`cls` -> `patch_embedding/cls`, `Encoder/posembed_input/pos_embedding` ->
`position_embedding/embedding`, `Encoder/encoderblock_i/LayerNorm_0` ->
`encoderblock_i/layer_norm_0` (`scale` -> `gamma`, `bias` -> `beta`),
`SelfAttention` -> `attention`, `Mlp/Dense_0` -> `mlp/dense_0`,
`Moe/Mlp/Dense_0/kernel|bias` -> `moe/experts/kernel_0|bias_0`,
`Moe/Router/dense/kernel` -> `moe/router/kernel`, `Moe/Router/mu|scale` ->
`moe/router/mu|scale`, `Encoder/encoder_norm` -> `encoder_norm`, `MapHead`
-> `map_head` (`MultiHeadDotProductAttention` -> `attention`, `LayerNorm` ->
`layer_norm`, `Mlp` -> `mlp`), `pre_logits`, `head`.
"""

import math

import keras
import numpy as np
from keras import ops

from keras_vmoe.layers.capacity import validate_capacity_factor
from keras_vmoe.layers.moe_layer import MoeLayer
from keras_vmoe.layers.partitioned_moe import PartitionedMoE
from keras_vmoe.layers.soft_moe import SoftMoE

LAYER_NORM_EPSILON = 1e-6
POSITION_EMBEDDINGS = ("learned", "sincos2d", "none")
MOE_TYPES = ("sparse", "soft", "partitioned")
# Keys accepted in the `moe` dict of `EncoderBlock` / the backbone.
MOE_KEYS = (
    "type",
    "num_experts",
    "hidden_dim",
    "router",
    "group_size",
    "images_per_group",
    "eval_routing",
    "num_slots",
    "capacity_factor",
    "noise_std",
    "bfloat16_dispatch",
    "dropout_rate",
    "identical_init",
    "dispatch",
)


def _mlp_bias_initializer():
    return keras.initializers.RandomNormal(stddev=1e-6)


@keras.saving.register_keras_serializable(package="keras_vmoe")
class DenseGeneralInitializer(keras.initializers.Initializer):
    """Initialises an N-D kernel as the 2-D matrix it flattens to.

    Keras computes the fans of a 3-D kernel as if it were a 1-D convolution;
    flax's `DenseGeneral` (and so upstream) flattens the input axes and the
    output axes first. With `num_input_axes=1` a `(D, N, K)` kernel is drawn
    as `(D, N·K)`; with `num_input_axes=2` an `(N, K, D)` kernel as
    `(N·K, D)`.

    Args:
        initializer: the initializer of the flattened matrix.
        num_input_axes: int, leading axes that are contracted with the input.
    """

    def __init__(self, initializer="glorot_uniform", num_input_axes=1):
        self.initializer = keras.initializers.get(initializer)
        self.num_input_axes = num_input_axes

    def __call__(self, shape, dtype=None):
        shape = tuple(shape)
        fan_in = math.prod(shape[: self.num_input_axes])
        fan_out = math.prod(shape[self.num_input_axes :])
        return ops.reshape(self.initializer((fan_in, fan_out), dtype=dtype), shape)

    def get_config(self):
        return {
            "initializer": keras.initializers.serialize(self.initializer),
            "num_input_axes": self.num_input_axes,
        }


def _to_pair(value, name):
    if isinstance(value, int) and not isinstance(value, bool):
        return (value, value)
    if (
        isinstance(value, (tuple, list))
        and len(value) == 2
        and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
    ):
        return (int(value[0]), int(value[1]))
    raise ValueError(
        f"`{name}` must be an int or a pair of ints (height, width). "
        f"Received: {name}={value!r}"
    )


@keras.saving.register_keras_serializable(package="keras_vmoe")
class PatchEmbedding(keras.layers.Layer):
    """Splits images into patches, embeds them and prepends a class token.

    A `P x P` convolution with stride `P` and VALID padding (upstream's
    `embedding` Conv), flattened to tokens. `(B, H, W, C) -> (B, T, D)` with
    `T = (H/P)·(W/P)` (+1 with the class token).

    Args:
        hidden_dim: int D.
        patch_size: int or (int, int) P.
        use_class_token: bool, prepend a learned `cls` token (init zeros).
        kernel_initializer: initializer of the `(P, P, C, D)` kernel.
        **kwargs: base layer arguments.
    """

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
        self._patch = _to_pair(patch_size, "patch_size")

    def build(self, input_shape):
        channels = input_shape[-1]
        self.kernel = self.add_weight(
            name="kernel",
            shape=(*self._patch, channels, self.hidden_dim),
            initializer=self.kernel_initializer,
        )
        self.bias = self.add_weight(
            name="bias", shape=(self.hidden_dim,), initializer="zeros"
        )
        if self.use_class_token:
            self.cls = self.add_weight(
                name="cls", shape=(1, 1, self.hidden_dim), initializer="zeros"
            )

    def call(self, images):
        x = ops.conv(
            images,
            self.kernel,
            strides=self._patch,
            padding="valid",
            data_format="channels_last",
        )  # (B, H/P, W/P, D)
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
        config.update(
            {
                "hidden_dim": self.hidden_dim,
                "patch_size": self.patch_size,
                "use_class_token": self.use_class_token,
                "kernel_initializer": keras.initializers.serialize(
                    self.kernel_initializer
                ),
            }
        )
        return config


def sincos2d_position_embedding(grid_size, hidden_dim, temperature=10_000.0):
    """2-D sine-cosine position embedding (MoCo v3, as upstream vmoe).

    Returns a float32 numpy array `(1, h·w, D)` with, per grid position
    `(y, x)` in row-major order, `[sin(x·ω), cos(x·ω), sin(y·ω), cos(y·ω)]`
    where `ω_j = temperature^(-j / (D/4 - 1))`, `j < D/4`.
    """
    grid_h, grid_w = _to_pair(grid_size, "grid_size")
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
    """Adds a position embedding to the tokens. `(B, T, D) -> (B, T, D)`.

    Args:
        grid_size: int or (int, int), the patch grid `(H/P, W/P)`.
        kind: `"learned"` (weight `embedding` `(1, T, D)`, init
            `normal(0.02)`, covering the class token too), `"sincos2d"`
            (fixed MoCo-v3 table; the class token gets none) or `"none"`.
        has_class_token: bool, the first token is a class token.
        temperature: float, sincos2d temperature.
        **kwargs: base layer arguments.
    """

    def __init__(
        self,
        grid_size,
        kind="learned",
        has_class_token=False,
        temperature=10_000.0,
        **kwargs,
    ):
        super().__init__(**kwargs)
        if kind not in POSITION_EMBEDDINGS:
            raise ValueError(
                f"`position_embedding` must be one of {POSITION_EMBEDDINGS}. "
                f"Received: position_embedding={kind!r}"
            )
        self.grid_size = grid_size
        self.kind = kind
        self.has_class_token = has_class_token
        self.temperature = temperature
        self._grid = _to_pair(grid_size, "grid_size")
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
        config.update(
            {
                "grid_size": self.grid_size,
                "kind": self.kind,
                "has_class_token": self.has_class_token,
                "temperature": self.temperature,
            }
        )
        return config


def resize_position_embedding(pos_emb, new_grid, has_cls, old_grid=None):
    """Resizes a learned position embedding to a new patch grid.

    The grid part is zoomed bilinearly (`scipy.ndimage.zoom(order=1)`, as
    upstream's `vit_zoom` rule); the class-token row is kept unchanged.

    Args:
        pos_emb: array `(1, T, D)`.
        new_grid: int or (int, int), the target grid `(h, w)`.
        has_cls: bool, the first row is the class token's.
        old_grid: int or (int, int), the source grid. Default: the square
            root of the number of grid rows.

    Returns:
        A numpy array `(1, h·w (+1), D)` with the dtype of `pos_emb`.
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
    old_h, old_w = _to_pair(old_grid, "old_grid")
    new_h, new_w = _to_pair(new_grid, "new_grid")
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


@keras.saving.register_keras_serializable(package="keras_vmoe")
class MultiHeadSelfAttention(keras.layers.Layer):
    """Multi-head dot-product attention with flax-layout weights.

    `query`, `key`, `value` are `EinsumDense` with kernels `(D, N, K)` and
    biases `(N, K)`; `out` has kernel `(N, K, D)` and bias `(D,)`. With
    `qk_norm`, queries and keys go through a bias-free LayerNorm over K
    (`query_ln`, `key_ln`). Attention is `softmax(q·k/√K)` (softmax in
    float32), no mask.

    Args:
        num_heads: int N, must divide D.
        qk_norm: bool, normalise queries and keys.
        dropout_rate: float, dropout on the attention weights.
        **kwargs: base layer arguments.

    Call arguments:
        inputs: `(B, T, D)` queries (and keys/values for self-attention).
        inputs_kv: optional `(B, S, D)` keys/values (cross-attention, as in
            `MapHead`).
        training: bool.
    """

    def __init__(self, num_heads, qk_norm=False, dropout_rate=0.0, **kwargs):
        super().__init__(**kwargs)
        self.num_heads = num_heads
        self.qk_norm = qk_norm
        self.dropout_rate = dropout_rate

    def build(self, inputs_shape, inputs_kv_shape=None):
        input_shape = inputs_shape
        hidden = input_shape[-1]
        if hidden % self.num_heads:
            raise ValueError(
                f"`num_heads` ({self.num_heads}) must divide the hidden size "
                f"({hidden})."
            )
        head_dim = hidden // self.num_heads
        self.head_dim = head_dim
        kv_shape = input_shape if inputs_kv_shape is None else inputs_kv_shape

        def projection(name):
            return keras.layers.EinsumDense(
                "btd,dnk->btnk",
                output_shape=(None, self.num_heads, head_dim),
                bias_axes="nk",
                kernel_initializer=DenseGeneralInitializer("glorot_uniform", 1),
                bias_initializer="zeros",
                name=name,
                dtype=self.dtype_policy,
            )

        self.query = projection("query")
        self.key = projection("key")
        self.value = projection("value")
        self.query.build(input_shape)
        self.key.build(kv_shape)
        self.value.build(kv_shape)
        if self.qk_norm:
            self.query_ln = keras.layers.LayerNormalization(
                epsilon=LAYER_NORM_EPSILON,
                center=False,
                name="query_ln",
                dtype=self.dtype_policy,
            )
            self.key_ln = keras.layers.LayerNormalization(
                epsilon=LAYER_NORM_EPSILON,
                center=False,
                name="key_ln",
                dtype=self.dtype_policy,
            )
            self.query_ln.build((None, None, self.num_heads, head_dim))
            self.key_ln.build((None, None, self.num_heads, head_dim))
        self.out = keras.layers.EinsumDense(
            "btnk,nkd->btd",
            output_shape=(None, hidden),
            bias_axes="d",
            kernel_initializer=DenseGeneralInitializer("glorot_uniform", 2),
            bias_initializer="zeros",
            name="out",
            dtype=self.dtype_policy,
        )
        self.out.build((None, None, self.num_heads, head_dim))
        self.attention_dropout = keras.layers.Dropout(
            self.dropout_rate, name="attention_dropout", dtype=self.dtype_policy
        )

    def call(self, inputs, inputs_kv=None, training=None):
        kv = inputs if inputs_kv is None else inputs_kv
        query = self.query(inputs)  # (B, T, N, K)
        key = self.key(kv)  # (B, S, N, K)
        value = self.value(kv)  # (B, S, N, K)
        if self.qk_norm:
            query = self.query_ln(query)
            key = self.key_ln(key)
        query = query * ops.cast(1.0 / math.sqrt(self.head_dim), query.dtype)
        logits = ops.einsum("btnk,bsnk->bnts", query, key)  # (B, N, T, S)
        weights = ops.softmax(ops.cast(logits, "float32"), axis=-1)
        weights = ops.cast(weights, value.dtype)
        weights = self.attention_dropout(weights, training=training)
        mixed = ops.einsum("bnts,bsnk->btnk", weights, value)  # (B, T, N, K)
        return self.out(mixed)  # (B, T, D)

    def compute_output_shape(self, inputs_shape, inputs_kv_shape=None):
        return inputs_shape

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "num_heads": self.num_heads,
                "qk_norm": self.qk_norm,
                "dropout_rate": self.dropout_rate,
            }
        )
        return config


@keras.saving.register_keras_serializable(package="keras_vmoe")
class MlpBlock(keras.layers.Layer):
    """`Dense(M) -> tanh-GELU -> Dropout -> Dense(D) -> Dropout` (upstream MlpBlock).

    Sub-layers `dense_0` and `dense_1`; kernels xavier-uniform, biases
    `normal(1e-6)`.

    Args:
        mlp_dim: int M.
        dropout_rate: float.
        **kwargs: base layer arguments.
    """

    def __init__(self, mlp_dim, dropout_rate=0.0, **kwargs):
        super().__init__(**kwargs)
        self.mlp_dim = mlp_dim
        self.dropout_rate = dropout_rate

    def build(self, input_shape):
        hidden = input_shape[-1]
        self.dense_0 = keras.layers.Dense(
            self.mlp_dim,
            kernel_initializer="glorot_uniform",
            bias_initializer=_mlp_bias_initializer(),
            name="dense_0",
            dtype=self.dtype_policy,
        )
        self.dense_1 = keras.layers.Dense(
            hidden,
            kernel_initializer="glorot_uniform",
            bias_initializer=_mlp_bias_initializer(),
            name="dense_1",
            dtype=self.dtype_policy,
        )
        self.dropout = keras.layers.Dropout(
            self.dropout_rate, name="dropout", dtype=self.dtype_policy
        )
        self.dense_0.build(input_shape)
        self.dense_1.build((*input_shape[:-1], self.mlp_dim))

    def call(self, x, training=None):
        h = self.dense_0(x)  # (B, T, M)
        h = keras.activations.gelu(h, approximate=True)
        h = self.dropout(h, training=training)
        y = self.dense_1(h)  # (B, T, D)
        return self.dropout(y, training=training)

    def compute_output_shape(self, input_shape):
        return input_shape

    def get_config(self):
        config = super().get_config()
        config.update({"mlp_dim": self.mlp_dim, "dropout_rate": self.dropout_rate})
        return config


def validate_moe_config(moe, ensemble_size=1):
    """Checks a backbone/encoder-block `moe` dict; returns its MoE type."""
    if not isinstance(moe, dict):
        raise ValueError(f"`moe` must be a dict. Received: moe={moe!r}")
    unknown = sorted(set(moe) - set(MOE_KEYS))
    if unknown:
        raise ValueError(f"Unknown `moe` keys {unknown}. Valid keys: {list(MOE_KEYS)}.")
    moe_type = moe.get("type", "sparse")
    if moe_type not in MOE_TYPES:
        raise ValueError(
            f"`moe['type']` must be one of {MOE_TYPES}. Received: {moe_type!r}"
        )
    num_experts = moe.get("num_experts")
    if (
        not isinstance(num_experts, int)
        or isinstance(num_experts, bool)
        or num_experts < 1
    ):
        raise ValueError(
            "`moe['num_experts']` must be an integer >= 1. "
            f"Received: num_experts={num_experts!r}"
        )
    if ensemble_size > 1:
        if moe_type == "soft":
            raise ValueError(
                "E³ ensembles (ensemble_size > 1) need sparse Token Choice MoE "
                "layers; moe['type']='soft' is not supported with "
                f"ensemble_size={ensemble_size}."
            )
        if num_experts % ensemble_size:
            raise ValueError(
                f"`moe['num_experts']` ({num_experts}) must be divisible by "
                f"`ensemble_size` ({ensemble_size}): every ensemble member owns "
                "E/ensemble_size experts. Valid ensemble sizes divide "
                f"{num_experts}."
            )
        moe_type = "partitioned"
    # Checked before any layer is built (cheap; the routers check them too).
    router = moe.get("router")
    for label, value in (
        ("moe['router']['capacity_factor']",
         router.get("capacity_factor") if isinstance(router, dict) else None),
        ("moe['capacity_factor']", moe.get("capacity_factor")),
    ):
        if value is not None:
            validate_capacity_factor(value, name=label)
    if moe.get("group_size") is not None and moe.get("images_per_group") is not None:
        raise ValueError(
            "Set at most one of moe['group_size'] (tokens) and "
            "moe['images_per_group']. Received: "
            f"group_size={moe['group_size']!r}, "
            f"images_per_group={moe['images_per_group']!r}"
        )
    eval_routing = moe.get("eval_routing")
    if eval_routing is not None:
        if moe_type == "soft" and eval_routing:
            raise ValueError(
                "Soft MoE layers have a fixed routing; moe['eval_routing'] does not "
                f"apply. Received: eval_routing={eval_routing!r}"
            )
        if not isinstance(eval_routing, dict):
            raise ValueError(
                "moe['eval_routing'] must be a dict of routing settings, e.g. "
                f"{{'capacity_factor': 4.0}}. Received: {eval_routing!r}"
            )
        if eval_routing.get("capacity_factor") is not None:
            validate_capacity_factor(
                eval_routing["capacity_factor"],
                name="moe['eval_routing']['capacity_factor']",
            )
    if moe_type == "partitioned":
        router = moe.get("router") or {}
        name = router.get("name", "token_choice") if isinstance(router, dict) else None
        if name not in ("token_choice", "softmax_token_choice"):
            raise ValueError(
                "Partitioned (E³) MoE layers use the softmax Token Choice router; "
                f"moe['router']['name'] must be 'token_choice'. Received: {name!r}"
            )
    return moe_type


def make_moe_layer(
    moe, mlp_dim, ensemble_size=1, dropout_rate=0.0, name="moe", dtype=None
):
    """Builds the MoE layer described by a backbone `moe` dict.

    Args:
        moe: dict with `num_experts` and optionally `type` (`"sparse"`,
            `"soft"`, `"partitioned"`), `hidden_dim` (expert MLP size,
            default `mlp_dim`), `router` (dict of router arguments with an
            optional `"name"`; the training routing), `group_size` or
            `images_per_group`, `eval_routing` (dict of the settings that
            differ in evaluation, see `MoeLayer`), `num_slots`, `capacity_factor`
            and `noise_std` (soft), `bfloat16_dispatch`, `dropout_rate`
            (default: the encoder's), `identical_init`, `dispatch`.
        mlp_dim: int M of the dense blocks.
        ensemble_size: int N; > 1 makes a `PartitionedMoE`.
        dropout_rate: float, default expert dropout.
        name: layer name.
        dtype: dtype policy.

    Returns:
        A `MoeLayer`, `PartitionedMoE` or `SoftMoE`.
    """
    moe_type = validate_moe_config(moe, ensemble_size)
    common = dict(
        num_experts=moe["num_experts"],
        hidden_dim=moe.get("hidden_dim") or mlp_dim,
        dropout_rate=moe.get("dropout_rate", dropout_rate),
        identical_init=moe.get("identical_init", True),
        # Soft MoE: bf16 by default, as upstream's always-bf16 dispatcher.
        bfloat16_dispatch=moe.get("bfloat16_dispatch", moe_type == "soft"),
        name=name,
        dtype=dtype,
    )
    router = dict(moe.get("router") or {})
    if moe_type == "soft":
        return SoftMoE(
            num_slots=moe.get("num_slots", 1),
            capacity_factor=moe.get("capacity_factor", 1.0),
            noise_std=moe.get("noise_std", 0.0),
            **common,
        )
    sparse = dict(
        group_size=moe.get("group_size"),
        images_per_group=moe.get("images_per_group"),
        eval_routing=moe.get("eval_routing"),
        dispatch=moe.get("dispatch", "index"),
    )
    if moe_type == "partitioned":
        router.pop("name", None)
        return PartitionedMoE(
            num_partitions=ensemble_size, router=router, **sparse, **common
        )
    return MoeLayer(router=router or "token_choice", **sparse, **common)


@keras.saving.register_keras_serializable(package="keras_vmoe")
class EncoderBlock(keras.layers.Layer):
    """Pre-LN Transformer encoder block with a dense MLP or an MoE layer.

    ```
    x = x + Dropout(Attention(LayerNorm_0(x)))
    x = x + MLP_or_MoE(LayerNorm_1(x))
    ```

    As upstream, there is no extra dropout after the MLP/MoE: the MLP and
    the experts end with their own dropout.

    Args:
        num_heads: int, attention heads.
        mlp_dim: int M.
        moe: `None` (dense block, sub-layer `mlp`) or a `moe` dict (see
            `make_moe_layer`; sub-layer `moe`).
        ensemble_size: int N of E³ (partitioned MoE layers).
        qk_norm: bool, LayerNorm on queries and keys.
        dropout_rate: float, dropout after attention and in the MLP.
        attention_dropout_rate: float, dropout on attention weights.
        **kwargs: base layer arguments.

    Call arguments:
        inputs: `(B, T, D)`.
        training: bool.
        return_metrics: bool, MoE blocks also return the routing metrics
            (eager calls on real tensors only).
        return_routing: bool, also return the MoE layer's `Routing` (`None`
            for a dense block; real tensors only).
    """

    def __init__(
        self,
        num_heads,
        mlp_dim,
        moe=None,
        ensemble_size=1,
        qk_norm=False,
        dropout_rate=0.0,
        attention_dropout_rate=0.0,
        **kwargs,
    ):
        super().__init__(**kwargs)
        self.num_heads = num_heads
        self.mlp_dim = mlp_dim
        self.moe = moe
        self.ensemble_size = ensemble_size
        self.qk_norm = qk_norm
        self.dropout_rate = dropout_rate
        self.attention_dropout_rate = attention_dropout_rate

        self.layer_norm_0 = keras.layers.LayerNormalization(
            epsilon=LAYER_NORM_EPSILON, name="layer_norm_0", dtype=self.dtype_policy
        )
        self.attention = MultiHeadSelfAttention(
            num_heads,
            qk_norm=qk_norm,
            dropout_rate=attention_dropout_rate,
            name="attention",
            dtype=self.dtype_policy,
        )
        self.dropout = keras.layers.Dropout(
            dropout_rate, name="dropout", dtype=self.dtype_policy
        )
        self.layer_norm_1 = keras.layers.LayerNormalization(
            epsilon=LAYER_NORM_EPSILON, name="layer_norm_1", dtype=self.dtype_policy
        )
        if moe is None:
            self.moe_layer = None
            self.mlp_layer = MlpBlock(
                mlp_dim, dropout_rate=dropout_rate, name="mlp", dtype=self.dtype_policy
            )
        else:
            self.mlp_layer = None
            self.moe_layer = make_moe_layer(
                moe,
                mlp_dim,
                ensemble_size=ensemble_size,
                dropout_rate=dropout_rate,
                name="moe",
                dtype=self.dtype_policy,
            )

    @property
    def is_moe(self):
        return self.moe_layer is not None

    def build(self, input_shape):
        self.layer_norm_0.build(input_shape)
        self.attention.build(input_shape)
        self.layer_norm_1.build(input_shape)
        (self.moe_layer or self.mlp_layer).build(input_shape)

    def call(self, inputs, training=None, return_metrics=False, return_routing=False):
        x = self.layer_norm_0(inputs)
        x = self.attention(x, training=training)
        x = self.dropout(x, training=training)
        x = x + inputs
        y = self.layer_norm_1(x)
        if self.moe_layer is None:
            y = self.mlp_layer(y, training=training)
            if return_routing:
                return x + y, None
            return (x + y, {}) if return_metrics else x + y
        if return_routing:
            y, routing = self.moe_layer(y, training=training, return_routing=True)
            return x + y, routing
        if return_metrics:
            y, metrics = self.moe_layer(y, training=training, return_metrics=True)
            return x + y, metrics
        return x + self.moe_layer(y, training=training)

    def compute_output_shape(self, input_shape):
        return input_shape

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "num_heads": self.num_heads,
                "mlp_dim": self.mlp_dim,
                "moe": self.moe,
                "ensemble_size": self.ensemble_size,
                "qk_norm": self.qk_norm,
                "dropout_rate": self.dropout_rate,
                "attention_dropout_rate": self.attention_dropout_rate,
            }
        )
        return config


@keras.saving.register_keras_serializable(package="keras_vmoe")
class MapHead(keras.layers.Layer):
    """Multihead attention pooling (big_vision / upstream `MapHead`).

    A learned probe `(1, 1, D)` attends over the tokens; the result goes
    through `LayerNorm -> MLP` with a residual. `(B, T, D) -> (B, D)`.

    Args:
        num_heads: int.
        mlp_dim: int M.
        qk_norm: bool.
        **kwargs: base layer arguments.
    """

    def __init__(self, num_heads, mlp_dim, qk_norm=False, **kwargs):
        super().__init__(**kwargs)
        self.num_heads = num_heads
        self.mlp_dim = mlp_dim
        self.qk_norm = qk_norm
        self.attention = MultiHeadSelfAttention(
            num_heads, qk_norm=qk_norm, name="attention", dtype=self.dtype_policy
        )
        self.layer_norm = keras.layers.LayerNormalization(
            epsilon=LAYER_NORM_EPSILON, name="layer_norm", dtype=self.dtype_policy
        )
        self.mlp = MlpBlock(mlp_dim, name="mlp", dtype=self.dtype_policy)

    def build(self, input_shape):
        hidden = input_shape[-1]
        self.probe = self.add_weight(
            name="probe", shape=(1, 1, hidden), initializer="glorot_uniform"
        )
        probe_shape = (input_shape[0], 1, hidden)
        self.attention.build(probe_shape, input_shape)
        self.layer_norm.build(probe_shape)
        self.mlp.build(probe_shape)

    def call(self, inputs, training=None):
        batch, hidden = ops.shape(inputs)[0], ops.shape(inputs)[-1]
        probe = ops.broadcast_to(ops.cast(self.probe, inputs.dtype), (batch, 1, hidden))
        x = self.attention(probe, inputs_kv=inputs, training=training)  # (B, 1, D)
        y = self.mlp(self.layer_norm(x), training=training)
        return (x + y)[:, 0]  # (B, D)

    def compute_output_shape(self, input_shape):
        return (input_shape[0], input_shape[-1])

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "num_heads": self.num_heads,
                "mlp_dim": self.mlp_dim,
                "qk_norm": self.qk_norm,
            }
        )
        return config
