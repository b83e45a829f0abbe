"""Building blocks of the (MoE) Vision Transformer: attention, MLP, encoder
block and MAP head, with upstream (flax) numerics and weight layout.

Variable paths (`encoderblock_{i}/attention/query/kernel`, ...) are part of
the API: the checkpoint converter and the layout maps are written against them.
"""

import math

import keras
from keras import ops

from keras_vmoe.layers.dropout import apply_dropout
from keras_vmoe.layers.experts import check_activation
from keras_vmoe.layers.experts import mlp_activation
from keras_vmoe.layers.layer_norm import LayerNorm
from keras_vmoe.layers.lora_einsum import LoraEinsumDense
from keras_vmoe.models import moe_config
from keras_vmoe.models.remat import check_remat_backend
from keras_vmoe.models.remat import remat_call
from keras_vmoe.utils import initialization
from keras_vmoe.utils.validation import check_bool

LAYER_NORM_EPSILON = 1e-6


@keras.saving.register_keras_serializable(package="keras_vmoe")
class DenseGeneralInitializer(keras.initializers.Initializer):
    """Initialises an N-D kernel as the 2-D matrix it flattens to (flax's
    `DenseGeneral` fans): with `num_input_axes=1` a `(D, N, K)` kernel is
    drawn as `(D, N·K)`, with 2 an `(N, K, D)` kernel as `(N·K, D)`."""

    def __init__(self, initializer="glorot_uniform", num_input_axes=1):
        self.initializer = keras.initializers.get(initializer)
        self.num_input_axes = num_input_axes

    def _matrix(self, shape):
        n = self.num_input_axes
        return (math.prod(shape[:n]), math.prod(shape[n:]))

    def __call__(self, shape, dtype=None):
        return ops.reshape(self.initializer(self._matrix(shape), dtype=dtype), shape)

    def batched_draw(self, shape, dtype):
        """`__call__`'s draw, deferred (`utils.initialization.Draw`), or None."""
        draw = initialization.draw_of(self.initializer, self._matrix(shape), dtype)
        return None if draw is None else draw.reshape(tuple(shape))

    def get_config(self):
        return {
            "initializer": keras.initializers.serialize(self.initializer),
            "num_input_axes": self.num_input_axes,
        }


@keras.saving.register_keras_serializable(package="keras_vmoe")
class MultiHeadSelfAttention(keras.layers.Layer):
    """Multi-head dot-product attention with flax-layout weights.

    `query`/`key`/`value` kernels `(D, N, K)`, `out` kernel `(N, K, D)`;
    `qk_norm` adds bias-free LayerNorms over K. `softmax(q·k/√K)` in float32.

    Called on `(B, T, D)` queries and optional `inputs_kv` `(B, S, D)` keys
    and values (cross-attention, as in `MapHead`); `dropout_rate` applies to
    the attention weights.
    """

    def __init__(self, num_heads, qk_norm=False, dropout_rate=0.0, **kwargs):
        super().__init__(**kwargs)
        self.num_heads = num_heads
        self.qk_norm = qk_norm
        self.dropout_rate = dropout_rate

    def build(self, inputs_shape, inputs_kv_shape=None):
        input_shape = inputs_shape  # Keras passes shapes by call-argument name
        hidden = input_shape[-1]
        if hidden % self.num_heads:
            raise ValueError(
                f"`num_heads` ({self.num_heads}) must divide the hidden size "
                f"({hidden})."
            )
        head_dim = self.head_dim = hidden // self.num_heads
        kv_shape = input_shape if inputs_kv_shape is None else inputs_kv_shape

        def projection(name):
            return LoraEinsumDense(
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
            for name in ("query_ln", "key_ln"):
                norm = LayerNorm(epsilon=LAYER_NORM_EPSILON, center=False, name=name,
                                 dtype=self.dtype_policy)
                norm.build((None, None, self.num_heads, head_dim))
                setattr(self, name, norm)
        self.out = LoraEinsumDense(
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
        weights = apply_dropout(self.attention_dropout, weights, training)
        mixed = ops.einsum("bnts,bsnk->btnk", weights, value)  # (B, T, N, K)
        return self.out(mixed)  # (B, T, D)

    def compute_output_shape(self, inputs_shape, inputs_kv_shape=None):
        return inputs_shape

    def get_config(self):
        config = super().get_config()
        config.update({"num_heads": self.num_heads, "qk_norm": self.qk_norm,
                       "dropout_rate": self.dropout_rate})
        return config


@keras.saving.register_keras_serializable(package="keras_vmoe")
class MlpBlock(keras.layers.Layer):
    """`Dense(M) -> GELU -> Dropout -> Dense(D) -> Dropout` (upstream MlpBlock);
    `activation` is `"gelu_tanh"` (upstream) or `"gelu"` (exact)."""

    def __init__(self, mlp_dim, dropout_rate=0.0, activation="gelu_tanh", **kwargs):
        super().__init__(**kwargs)
        self.mlp_dim = mlp_dim
        self.dropout_rate = dropout_rate
        self.activation = check_activation(activation, "activation")

    def _dense(self, units, name):
        return keras.layers.Dense(
            units, kernel_initializer="glorot_uniform",
            bias_initializer=keras.initializers.RandomNormal(stddev=1e-6),
            name=name, dtype=self.dtype_policy)

    def build(self, input_shape):
        self.dense_0 = self._dense(self.mlp_dim, "dense_0")
        self.dense_1 = self._dense(input_shape[-1], "dense_1")
        self.dropout = keras.layers.Dropout(
            self.dropout_rate, name="dropout", dtype=self.dtype_policy
        )
        self.dense_0.build(input_shape)
        self.dense_1.build((*input_shape[:-1], self.mlp_dim))

    def call(self, x, training=None):
        h = self.dense_0(x)  # (B, T, M)
        h = mlp_activation(h, self.activation)
        h = apply_dropout(self.dropout, h, training)
        y = self.dense_1(h)  # (B, T, D)
        return apply_dropout(self.dropout, y, training)

    def compute_output_shape(self, input_shape):
        return input_shape

    def get_config(self):
        config = super().get_config()
        config.update({"mlp_dim": self.mlp_dim, "dropout_rate": self.dropout_rate,
                       "activation": self.activation})
        return config


@keras.saving.register_keras_serializable(package="keras_vmoe")
class EncoderBlock(keras.layers.Layer):
    """Pre-LN Transformer encoder block with a dense MLP or an MoE layer.

    ```
    x = x + Dropout(Attention(LayerNorm_0(x)))
    x = x + MLP_or_MoE(LayerNorm_1(x))
    ```

    The arguments are those of `VisionTransformerBackbone`; `moe` is `None`
    (sub-layer `mlp`) or a `moe` dict (sub-layer `moe`). `remat` is skipped
    by calls with `return_metrics` (also return the MoE metrics) or
    `return_routing` (also return the `Routing`, `None` for a dense block).
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
        remat=False,
        mlp_activation="gelu_tanh",
        layer_norm_epsilon=LAYER_NORM_EPSILON,
        **kwargs,
    ):
        super().__init__(**kwargs)
        remat = check_bool(remat, "remat")
        check_remat_backend(remat)
        self.mlp_activation = check_activation(mlp_activation)
        self.layer_norm_epsilon = layer_norm_epsilon
        self.num_heads = num_heads
        self.mlp_dim = mlp_dim
        self.moe = moe
        self.remat = remat
        self.ensemble_size = ensemble_size
        self.qk_norm = qk_norm
        self.dropout_rate = dropout_rate
        self.attention_dropout_rate = attention_dropout_rate

        dtype = self.dtype_policy
        self.layer_norm_0 = LayerNorm(
            epsilon=layer_norm_epsilon, name="layer_norm_0", dtype=dtype)
        self.attention = MultiHeadSelfAttention(
            num_heads, qk_norm=qk_norm, dropout_rate=attention_dropout_rate,
            name="attention", dtype=dtype)
        self.dropout = keras.layers.Dropout(dropout_rate, name="dropout", dtype=dtype)
        self.layer_norm_1 = LayerNorm(
            epsilon=layer_norm_epsilon, name="layer_norm_1", dtype=dtype)
        self.moe_layer = self.mlp_layer = None
        if moe is None:
            self.mlp_layer = MlpBlock(
                mlp_dim, dropout_rate=dropout_rate, activation=mlp_activation,
                name="mlp", dtype=dtype)
        else:
            self.moe_layer = moe_config.make_moe_layer(
                moe, mlp_dim, ensemble_size=ensemble_size, dropout_rate=dropout_rate,
                activation=mlp_activation, name="moe", dtype=dtype)

    @property
    def is_moe(self):
        return self.moe_layer is not None

    def build(self, input_shape):
        self.layer_norm_0.build(input_shape)
        self.attention.build(input_shape)
        self.layer_norm_1.build(input_shape)
        (self.moe_layer or self.mlp_layer).build(input_shape)

    def call(self, inputs, training=None, return_metrics=False, return_routing=False):
        if self.remat and not (return_metrics or return_routing):
            return remat_call(self, self._block, inputs, training=training)
        return self._block(inputs, training, return_metrics, return_routing)

    def _block(self, inputs, training=None, return_metrics=False, return_routing=False):
        x = self.layer_norm_0(inputs)
        x = self.attention(x, training=training)
        x = apply_dropout(self.dropout, x, training)
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
        config.update({"num_heads": self.num_heads, "mlp_dim": self.mlp_dim, "moe": self.moe,
                       "ensemble_size": self.ensemble_size, "qk_norm": self.qk_norm,
                       "dropout_rate": self.dropout_rate,
                       "attention_dropout_rate": self.attention_dropout_rate, "remat": self.remat,
                       "mlp_activation": self.mlp_activation,
                       "layer_norm_epsilon": self.layer_norm_epsilon})
        return config


@keras.saving.register_keras_serializable(package="keras_vmoe")
class MapHead(keras.layers.Layer):
    """Multihead attention pooling (upstream `MapHead`): a learned probe
    attends over the tokens, then `LayerNorm -> MLP` with a residual.
    `(B, T, D) -> (B, D)`."""

    def __init__(self, num_heads, mlp_dim, qk_norm=False, mlp_activation="gelu_tanh",
                 layer_norm_epsilon=LAYER_NORM_EPSILON, **kwargs):
        super().__init__(**kwargs)
        self.num_heads = num_heads
        self.mlp_dim = mlp_dim
        self.qk_norm = qk_norm
        self.mlp_activation = check_activation(mlp_activation)
        self.layer_norm_epsilon = layer_norm_epsilon
        self.attention = MultiHeadSelfAttention(
            num_heads, qk_norm=qk_norm, name="attention", dtype=self.dtype_policy)
        self.layer_norm = LayerNorm(
            epsilon=layer_norm_epsilon, name="layer_norm", dtype=self.dtype_policy)
        self.mlp = MlpBlock(mlp_dim, activation=mlp_activation, name="mlp",
                            dtype=self.dtype_policy)

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
        config.update({"num_heads": self.num_heads, "mlp_dim": self.mlp_dim,
                       "qk_norm": self.qk_norm, "mlp_activation": self.mlp_activation,
                       "layer_norm_epsilon": self.layer_norm_epsilon})
        return config
