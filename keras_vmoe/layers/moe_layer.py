"""`MoeLayer`: group tokens, route them, run the experts, combine.

    tokens (B, T, D) -> (G, S, D) -> router -> Routing -> dispatch
      -> (G, E, C, D) -> experts -> combine -> (G, S, D) -> (B, T, D)

Axis letters: B batch, T tokens per example, D hidden, G groups, S group
size, E experts, C capacity, K choices per token, P slots per expert.
"""

import numbers

import keras
from keras import ops

from keras_vmoe import budget
from keras_vmoe.distribution.sharding import constrain_groups
from keras_vmoe.layers import dispatch as dispatch_lib
from keras_vmoe.layers.capacity import validate_capacity_factor
from keras_vmoe.layers.experts import Experts
from keras_vmoe.layers.routing import get_router

DISPATCH_MODES = ("index", "einsum")


@keras.saving.register_keras_serializable(package="keras_vmoe")
class MoeLayer(keras.layers.Layer):
    """Sparse Mixture-of-Experts MLP layer (V-MoE and sparse routers).

    Tokens are routed per group of `group_size` tokens (default: all the
    tokens of the call, so a batch of one image works). Capacity, Batch
    Prioritized Routing and the auxiliary losses are all per group, as
    upstream. In training the router's weighted auxiliary loss is added
    with `add_loss`.

    The router settings users tune after training (`num_selected_experts`,
    `capacity_factor`, `batch_priority`, `group_size`) can be set on a built
    layer; re-trace (e.g. `model.make_predict_function(force=True)`) for a
    compiled model to see the change.

    Args:
        num_experts: int E.
        hidden_dim: int M, the expert MLP size.
        router: a `Router`, a router name (`"token_choice"`,
            `"sinkhorn_token_choice"`, `"expert_choice"`,
            `"sinkhorn_expert_choice"`, `"sparse_expert_choice"`), or a dict
            `{"name": ..., **router_kwargs}`.
        group_size: int S, tokens routed jointly; must divide B·T. `None`
            routes all the tokens of a call as one group.
        dropout_rate: float, expert dropout.
        identical_init: bool, experts start from identical weights.
        bfloat16_dispatch: bool, round dispatched tokens and expert outputs
            to bfloat16 as upstream's `bfloat16` dispatcher flag does.
        dispatch: `"index"` (gather/scatter, the fast path) or `"einsum"`
            (the one-hot reference).
        kernel_initializer: initializer of one expert's kernels.
        bias_initializer: initializer of one expert's biases.
        **kwargs: base layer arguments.

    Call arguments:
        inputs: `(B, T, D)` tokens.
        training: bool.
        return_metrics: bool, also return a dict of routing metrics and
            auxiliary losses.
        return_routing: bool, also return the `Routing` itself (for
            analysis, see `token_assignments`); takes precedence over
            `return_metrics`.

    Examples:

    >>> layer = MoeLayer(num_experts=8, hidden_dim=256,
    ...                  router={"name": "token_choice",
    ...                          "num_selected_experts": 2,
    ...                          "capacity_factor": 1.05})
    >>> layer(keras.random.normal((2, 50, 64))).shape
    (2, 50, 64)
    """

    def __init__(
        self,
        num_experts,
        hidden_dim,
        router="token_choice",
        group_size=None,
        dropout_rate=0.0,
        identical_init=True,
        bfloat16_dispatch=False,
        dispatch="index",
        kernel_initializer="glorot_uniform",
        bias_initializer=None,
        **kwargs,
    ):
        super().__init__(**kwargs)
        for name, value in (("num_experts", num_experts), ("hidden_dim", hidden_dim)):
            if (
                isinstance(value, bool)
                or not isinstance(value, numbers.Integral)
                or value < 1
            ):
                raise ValueError(
                    f"`{name}` must be an integer >= 1. Received: {name}={value!r}"
                )
        if dispatch not in DISPATCH_MODES:
            raise ValueError(
                f"`dispatch` must be one of {DISPATCH_MODES}. Received: dispatch={dispatch!r}"
            )
        self.num_experts = num_experts
        self.hidden_dim = hidden_dim
        self.group_size = group_size
        self.dropout_rate = dropout_rate
        self.identical_init = identical_init
        self.bfloat16_dispatch = bfloat16_dispatch
        self.dispatch = dispatch
        self.kernel_initializer = keras.initializers.get(kernel_initializer)
        self.bias_initializer = (
            None if bias_initializer is None else keras.initializers.get(bias_initializer)
        )
        self.router = self._make_router(router)
        self.experts = Experts(
            num_experts,
            hidden_dim,
            dropout_rate=dropout_rate,
            identical_init=identical_init,
            kernel_initializer=self.kernel_initializer,
            bias_initializer=self.bias_initializer,
            name="experts",
            dtype=self.dtype_policy,
        )

    def _make_router(self, router):
        return get_router(router, self.num_experts, name="router", dtype=self.dtype_policy)

    # Routing settings that can be changed on a built layer.
    @property
    def group_size(self):
        return self._group_size

    @group_size.setter
    def group_size(self, value):
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1
        ):
            raise ValueError(
                f"`group_size` must be None or an integer >= 1. Received: group_size={value!r}"
            )
        self._group_size = None if value is None else int(value)

    def _router_attribute(self, name):
        if not hasattr(self.router, name):
            raise AttributeError(
                f"The router {type(self.router).__name__} has no setting `{name}`."
            )
        return getattr(self.router, name)

    @property
    def num_selected_experts(self):
        return self._router_attribute("num_selected_experts")

    @num_selected_experts.setter
    def num_selected_experts(self, value):
        self._router_attribute("num_selected_experts")
        self.router.num_selected_experts = value

    @property
    def capacity_factor(self):
        return self.router.capacity_factor

    @capacity_factor.setter
    def capacity_factor(self, value):
        self.router.capacity_factor = validate_capacity_factor(value)
        self.router.capacity = None

    @property
    def batch_priority(self):
        return self._router_attribute("batch_priority")

    @batch_priority.setter
    def batch_priority(self, value):
        self._router_attribute("batch_priority")
        self.router.batch_priority = bool(value)

    def build(self, input_shape):
        if len(input_shape) != 3:
            raise ValueError(
                f"{type(self).__name__} expects inputs of rank 3 (batch, tokens, "
                f"hidden). Received input_shape={tuple(input_shape)}"
            )
        hidden = input_shape[-1]
        self._check_weight_bytes(hidden)
        if not self.router.built:
            self.router.build((None, None, hidden))
        if not self.experts.built:
            self.experts.build((None, self.num_experts, None, hidden))

    def _check_weight_bytes(self, hidden):
        """Refuses experts (and router) larger than this machine, up front."""
        if hidden is None or budget.in_abstract_build():
            return
        experts = self.num_experts * (2 * hidden * self.hidden_dim + hidden + self.hidden_dim)
        slots = getattr(self.router, "num_slots", None) or 1
        router = hidden * self.num_experts * slots
        settings = f"num_experts={self.num_experts}, hidden_dim={self.hidden_dim}"
        if getattr(self.router, "num_slots", None):
            settings += f", num_slots={slots}"
        value_bytes = 2 if "16" in str(self.variable_dtype) else 4
        budget.check_fits(
            (experts + router) * value_bytes,
            f"{type(self).__name__} `{self.name}` ({experts + router} weights for "
            f"inputs of width {hidden})",
            settings,
        )

    def group_tokens(self, inputs):
        """(B, T, D) -> (G, S, D)."""
        batch, tokens, hidden = ops.shape(inputs)
        total = batch * tokens
        if total == 0:
            raise ValueError(
                f"{type(self).__name__} `{self.name}` received no tokens (batch "
                f"size {batch} x {tokens} tokens); pass at least one example."
            )
        group_size = self.group_size or total
        if total % group_size:
            raise ValueError(
                f"`group_size` ({group_size}) must divide the number of tokens in "
                f"the call (batch {batch} x {tokens} tokens = {total}). Valid "
                f"group sizes are divisors of {total}, e.g. a multiple of {tokens} "
                "that divides it."
            )
        return ops.reshape(inputs, (total // group_size, group_size, hidden))

    def ungroup_tokens(self, outputs, input_shape):
        """(G, S, D) -> (B, T, D)."""
        return ops.reshape(outputs, input_shape)

    def call(self, inputs, training=None, return_metrics=False, return_routing=False):
        x = constrain_groups(self.group_tokens(inputs))  # (G, S, D), G sharded
        routing = self.router(x, training=training)
        y = self.apply_experts(x, routing, training=training)  # (G, S, D)
        y = self.ungroup_tokens(y, ops.shape(inputs))
        if training and self.trainable:
            loss = routing.auxiliary_loss
            if not isinstance(loss, float) or loss != 0.0:
                self.add_loss(loss)
        if return_routing:
            return y, routing
        if return_metrics:
            return y, self.routing_metrics(routing)
        return y

    def routing_metrics(self, routing):
        """Scalar metrics of a routing: statistics and auxiliary losses."""
        metrics = dict(routing.metrics)
        for name, value in routing.auxiliary_losses.items():
            metrics[name] = ops.mean(value)
        metrics["auxiliary_loss"] = ops.convert_to_tensor(routing.auxiliary_loss, "float32")
        metrics["capacity"] = ops.convert_to_tensor(routing.capacity, "int32")
        return metrics

    def token_assignments(self, routing, input_shape):
        """Per-token expert use of a routing, in the layout of the inputs.

        Args:
            routing: the `Routing` of a call (`return_routing=True`).
            input_shape: shape of that call's inputs `(B, T, D)`.

        Returns:
            A dict of float32 tensors `(B, T, E)`: `"processed"`, how many
            slots of each expert hold the token (Soft MoE: the token's
            dispatch weight summed over the expert's slots, and
            `"combine"`, the weight of the expert's slots in the token's
            output, summed over the slots), and for Token Choice routers
            `"requested"`, the experts each token chose before capacity
            dropped some.
        """
        batch, tokens = input_shape[0], input_shape[1]
        out_shape = (batch, tokens, self.num_experts)
        if not routing.is_sparse:
            # (G, S, E, P) -> (G, S, E)
            processed = ops.sum(ops.cast(routing.dispatch_weights, "float32"), axis=-1)
            combine = ops.sum(ops.cast(routing.combine_weights, "float32"), axis=-1)
            return {"processed": self.ungroup_tokens(processed, out_shape),
                    "combine": self.ungroup_tokens(combine, out_shape)}
        buffer_token = routing.buffer_token  # (G, E, C), S marks an empty slot
        num_groups, num_experts, capacity = ops.shape(buffer_token)
        group_size = (batch * tokens) // num_groups
        group_ids = ops.arange(num_groups, dtype="int32")[:, None, None]
        expert_ids = ops.arange(num_experts, dtype="int32")[None, :, None]
        segment = (group_ids * (group_size + 1) + buffer_token) * num_experts + expert_ids
        counts = ops.segment_sum(
            ops.ones((num_groups * num_experts * capacity,), "float32"),
            ops.reshape(segment, (-1,)),
            num_segments=num_groups * (group_size + 1) * num_experts,
        )
        counts = ops.reshape(counts, (num_groups, group_size + 1, num_experts))
        result = {"processed": self.ungroup_tokens(counts[:, :group_size], out_shape)}
        if routing.token_expert is not None:
            chosen = ops.one_hot(routing.token_expert, num_experts, dtype="float32")
            requested = ops.sum(chosen, axis=-2)  # (G, S, K, E) -> (G, S, E)
            result["requested"] = self.ungroup_tokens(requested, out_shape)
        return result

    def apply_experts(self, x, routing, training=None):
        """Dispatch, experts, combine. (G, S, D) -> (G, S, D)."""
        if self.bfloat16_dispatch:
            x = dispatch_lib.round_to_bfloat16(x)
        group_size = ops.shape(x)[1]
        if not routing.is_sparse:
            weights = ops.cast(routing.dispatch_weights, x.dtype)
            buffers = ops.einsum("gsep,gsd->gepd", weights, x)  # (G, E, P, D)
        elif self.dispatch == "einsum":
            dense_dispatch, dense_combine = dispatch_lib.dense_dispatch_tensors(
                routing.buffer_token, routing.buffer_weight, group_size
            )
            buffers = dispatch_lib.einsum_dispatch(x, dense_dispatch)  # (G, E, C, D)
        else:
            buffers = dispatch_lib.gather_dispatch(x, routing.buffer_token)
        y = self.experts(buffers, training=training)  # (G, E, C, D)
        if self.bfloat16_dispatch:
            y = dispatch_lib.round_to_bfloat16(y)
        if not routing.is_sparse:
            weights = ops.cast(routing.combine_weights, y.dtype)
            return ops.einsum("gsep,gepd->gsd", weights, y)
        if self.dispatch == "einsum":
            return dispatch_lib.einsum_combine(y, dense_combine, dense_dispatch)
        if routing.token_expert is not None:
            return dispatch_lib.gather_combine(
                y, routing.token_expert, routing.token_slot, routing.token_weight
            )
        return dispatch_lib.scatter_combine(
            y, routing.buffer_token, routing.buffer_weight, group_size
        )

    def compute_output_shape(self, input_shape):
        return input_shape

    def compute_output_spec(
        self, inputs, training=None, return_metrics=False, return_routing=False
    ):
        out = keras.KerasTensor(inputs.shape, dtype=self.compute_dtype)
        if not (return_metrics or return_routing):
            return out
        raise ValueError(
            "`return_metrics=True` and `return_routing=True` are only supported "
            "when calling the layer on real tensors."
        )

    def _serialized_router(self):
        # Without its build config, so that the router is built inside this
        # layer's name scope on reload (weight paths stay "<moe>/router/...").
        config = keras.saving.serialize_keras_object(self.router)
        config.pop("build_config", None)
        return config

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "num_experts": self.num_experts,
                "hidden_dim": self.hidden_dim,
                "router": self._serialized_router(),
                "group_size": self.group_size,
                "dropout_rate": self.dropout_rate,
                "identical_init": self.identical_init,
                "bfloat16_dispatch": self.bfloat16_dispatch,
                "dispatch": self.dispatch,
                "kernel_initializer": keras.initializers.serialize(self.kernel_initializer),
                "bias_initializer": (
                    None
                    if self.bias_initializer is None
                    else keras.initializers.serialize(self.bias_initializer)
                ),
            }
        )
        return config



