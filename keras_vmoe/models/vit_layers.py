"""Building blocks of the (MoE) Vision Transformer.

Attention, MLP and encoder blocks and the MAP head live here; the patch and
position embeddings are in `vit_embeddings` and the `moe` dict handling in
`moe_config`.

Axis letters: B batch, H/W image or grid height/width, P patch size,
T tokens per image, D hidden size, M MLP size, N heads (in attention) or
ensemble members (in E³), K head size D/N, E experts.

Numerics follow upstream (flax) conventions by default: LayerNorm epsilon
1e-6, tanh-approximated GELU (both settable, for checkpoints of other
libraries: `layer_norm_epsilon`, `mlp_activation="gelu"`), plain
`softmax(q·k/√K)` attention, xavier-uniform attention/MLP kernels with
the fans of the flattened 2-D matrix (as `flax.linen.DenseGeneral`), MLP biases `normal(1e-6)`.

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

    def batched_draw(self, shape, dtype):
        """`__call__`'s draw, deferred (`utils.initialization.Draw`), or None."""
        shape = tuple(shape)
        fan_in = math.prod(shape[: self.num_input_axes])
        fan_out = math.prod(shape[self.num_input_axes :])
        draw = initialization.draw_of(self.initializer, (fan_in, fan_out), dtype)
        return None if draw is None else draw.reshape(shape)

    def get_config(self):
        return {
            "initializer": keras.initializers.serialize(self.initializer),
            "num_input_axes": self.num_input_axes,
        }


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
            self.query_ln = LayerNorm(
                epsilon=LAYER_NORM_EPSILON,
                center=False,
                name="query_ln",
                dtype=self.dtype_policy,
            )
            self.key_ln = LayerNorm(
                epsilon=LAYER_NORM_EPSILON,
                center=False,
                name="key_ln",
                dtype=self.dtype_policy,
            )
            self.query_ln.build((None, None, self.num_heads, head_dim))
            self.key_ln.build((None, None, self.num_heads, head_dim))
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
    """`Dense(M) -> GELU -> Dropout -> Dense(D) -> Dropout` (upstream MlpBlock).

    Sub-layers `dense_0` and `dense_1`; kernels xavier-uniform, biases
    `normal(1e-6)`.

    Args:
        mlp_dim: int M.
        dropout_rate: float.
        activation: `"gelu_tanh"` (upstream's tanh-approximated GELU, the
            default) or `"gelu"` (exact, erf).
        **kwargs: base layer arguments.
    """

    def __init__(self, mlp_dim, dropout_rate=0.0, activation="gelu_tanh", **kwargs):
        super().__init__(**kwargs)
        self.mlp_dim = mlp_dim
        self.dropout_rate = dropout_rate
        self.activation = check_activation(activation, "activation")

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
        mlp_activation: `"gelu_tanh"` (default) or `"gelu"` (exact), of the
            MLP or the experts.
        layer_norm_epsilon: float, epsilon of `layer_norm_0` and
            `layer_norm_1`.
        remat: bool, recompute the block's activations in the backward pass
            instead of keeping them (gradient checkpointing, see
            `keras_vmoe.models.remat`): less memory, one more forward pass
            of the block per step. Outputs, gradients, auxiliary losses and
            random numbers are those of the block without it. Calls that
            return metrics or routing are not rematerialised.
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

        self.layer_norm_0 = LayerNorm(
            epsilon=layer_norm_epsilon, name="layer_norm_0", dtype=self.dtype_policy
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
        self.layer_norm_1 = LayerNorm(
            epsilon=layer_norm_epsilon, name="layer_norm_1", dtype=self.dtype_policy
        )
        if moe is None:
            self.moe_layer = None
            self.mlp_layer = MlpBlock(
                mlp_dim, dropout_rate=dropout_rate, activation=mlp_activation,
                name="mlp", dtype=self.dtype_policy
            )
        else:
            self.mlp_layer = None
            self.moe_layer = moe_config.make_moe_layer(
                moe,
                mlp_dim,
                ensemble_size=ensemble_size,
                dropout_rate=dropout_rate,
                activation=mlp_activation,
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
    """Multihead attention pooling (big_vision / upstream `MapHead`).

    A learned probe `(1, 1, D)` attends over the tokens; the result goes
    through `LayerNorm -> MLP` with a residual. `(B, T, D) -> (B, D)`.

    Args:
        num_heads: int.
        mlp_dim: int M.
        qk_norm: bool.
        mlp_activation: `"gelu_tanh"` (default) or `"gelu"` (exact).
        layer_norm_epsilon: float.
        **kwargs: base layer arguments.
    """

    def __init__(self, num_heads, mlp_dim, qk_norm=False, mlp_activation="gelu_tanh",
                 layer_norm_epsilon=LAYER_NORM_EPSILON, **kwargs):
        super().__init__(**kwargs)
        self.num_heads = num_heads
        self.mlp_dim = mlp_dim
        self.qk_norm = qk_norm
        self.mlp_activation = check_activation(mlp_activation)
        self.layer_norm_epsilon = layer_norm_epsilon
        self.attention = MultiHeadSelfAttention(
            num_heads, qk_norm=qk_norm, name="attention", dtype=self.dtype_policy
        )
        self.layer_norm = LayerNorm(
            epsilon=layer_norm_epsilon, name="layer_norm", dtype=self.dtype_policy
        )
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
