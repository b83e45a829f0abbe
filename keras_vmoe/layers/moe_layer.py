"""`MoeLayer`: group tokens, route them, run the experts, combine.

    tokens (B, T, D) -> (G, S, D) -> router -> Routing -> dispatch
      -> (G, E, C, D) -> experts -> combine -> (G, S, D) -> (B, T, D)

Axis letters: B batch, T tokens per example, D hidden, G groups, S group
size, E experts, C capacity, K choices per token, P slots per expert.
"""

import contextlib

import keras
from keras import ops

from keras_vmoe.distribution.sharding import constrain_groups
from keras_vmoe.layers import dispatch as dispatch_lib
from keras_vmoe.layers import symbolic_sizes as sizes
from keras_vmoe.layers.experts import Experts
from keras_vmoe.layers.phase_routing import ROUTER_SETTINGS
from keras_vmoe.layers.phase_routing import PhaseRouting
from keras_vmoe.layers.routing import get_router
from keras_vmoe.utils import memory_budget as budget
from keras_vmoe.utils.validation import check_int
from keras_vmoe.utils.validation import check_one_of

DISPATCH_MODES = ("index", "einsum")
# Which routing `MoeLayer.set_routing` changes.
ROUTING_PHASES = ("both", "train", "eval")


def _train_setting(name):
    def get(self):
        return getattr(self.train_routing, name)

    def set_(self, value):
        self._set_train_routing(self.train_routing.replace(**{name: value}))

    return property(get, set_, doc=f"The training routing's `{name}`.")


@keras.saving.register_keras_serializable(package="keras_vmoe")
class MoeLayer(keras.layers.Layer):
    """Sparse Mixture-of-Experts MLP layer (V-MoE and sparse routers).

    Tokens are routed per group, as upstream; a partial last group is padded
    with masked tokens, so an example's output never depends on the batch
    size. In training the weighted auxiliary loss is added with `add_loss`.
    Routing settings can be changed with `set_routing` or as attributes.

    Args:
        num_experts: int E.
        mlp_dim: int M, the expert MLP size.
        router: a `Router`, a name in `routing.ROUTERS`, or a dict
            `{"name": ..., **router_kwargs}`.
        group_size: int S, tokens routed jointly (`None`: all of a call's).
        images_per_group: int, examples routed jointly (upstream: 8).
            Exclusive with `group_size`.
        eval_routing: dict of routing settings for `training=False` calls.
        dropout_rate: float, expert dropout.
        identical_init: bool, experts start from identical weights.
        bfloat16_dispatch: bool, round dispatched tokens and expert outputs
            to bfloat16 (upstream's `bfloat16` dispatcher flag).
        activation: the experts' activation, `"gelu_tanh"` or `"gelu"`.
        experts_dtype: dtype policy of a quantized expert bank.
        dispatch: `"index"` (gather/scatter) or `"einsum"` (the reference).
        kernel_initializer: initializer of one expert's kernels.
        bias_initializer: initializer of one expert's biases.
        **kwargs: base layer arguments.

    Call arguments:
        inputs: `(B, T, D)` tokens.
        training: bool.
        return_metrics: bool, also return a dict of routing metrics.
        return_routing: bool, also return the `Routing` (over metrics).

    Examples:

    >>> layer = MoeLayer(num_experts=8, mlp_dim=256,
    ...                  router={"name": "token_choice",
    ...                          "num_selected_experts": 2,
    ...                          "capacity_factor": 1.05})
    >>> layer(keras.random.normal((2, 50, 64))).shape
    (2, 50, 64)
    """

    def __init__(
        self,
        num_experts,
        mlp_dim=None,
        router="token_choice",
        group_size=None,
        images_per_group=None,
        eval_routing=None,
        dropout_rate=0.0,
        identical_init=True,
        bfloat16_dispatch=False,
        dispatch="index",
        experts_dtype=None,
        kernel_initializer="glorot_uniform",
        bias_initializer=None,
        activation="gelu_tanh",
        **kwargs,
    ):
        super().__init__(**kwargs)
        num_experts = check_int(num_experts, "num_experts")
        mlp_dim = check_int(mlp_dim, "mlp_dim")
        check_one_of(dispatch, "dispatch", DISPATCH_MODES)
        groups = PhaseRouting(group_size=group_size, images_per_group=images_per_group)
        self.num_experts = num_experts
        self.mlp_dim = mlp_dim
        self._group_size = groups.group_size
        self._images_per_group = groups.images_per_group
        self._eval_overrides = {}
        self.dropout_rate = dropout_rate
        self.identical_init = identical_init
        self.bfloat16_dispatch = bfloat16_dispatch
        self.dispatch = dispatch
        self.kernel_initializer = keras.initializers.get(kernel_initializer)
        self.bias_initializer = (None if bias_initializer is None
                                 else keras.initializers.get(bias_initializer))
        self.router = self._make_router(router)
        self.experts = Experts(
            num_experts, mlp_dim, dropout_rate=dropout_rate,
            identical_init=identical_init, kernel_initializer=self.kernel_initializer,
            bias_initializer=self.bias_initializer, activation=activation,
            name="experts", dtype=(keras.dtype_policies.get(experts_dtype)
                                   if experts_dtype else self.dtype_policy))
        self._check_routing(self.train_routing, "training routing")
        self.eval_routing = eval_routing

    def _make_router(self, router):
        return get_router(router, self.num_experts, name="router", dtype=self.dtype_policy)

    @property
    def train_routing(self):
        """The `PhaseRouting` of training calls."""
        return PhaseRouting.of_router(self.router, self._group_size,
                                         self._images_per_group)

    def routing_phase(self, training):
        """The `PhaseRouting` of a call with this `training` flag."""
        if training or not self._eval_overrides:
            return self.train_routing
        return self.train_routing.replace(**self._eval_overrides)

    def _check_routing(self, settings, where):
        return settings.check_router(self.router, where)

    def _set_train_routing(self, settings):
        self._check_routing(settings, "training routing")
        train = self.train_routing
        self._group_size = settings.group_size
        self._images_per_group = settings.images_per_group
        for name, value in settings.overrides_of(train).items():
            if name in ROUTER_SETTINGS:
                setattr(self.router, name, value)
        if settings.capacity_factor != train.capacity_factor:
            self.router.capacity = None  # the factor decides the capacity

    @contextlib.contextmanager
    def _routing_as(self, settings):
        """Within it, the layer and its router route with `settings`."""
        train = self.train_routing
        if settings == train:
            yield
            return
        saved = {name: getattr(self.router, name)
                 for name in (*ROUTER_SETTINGS, "capacity") if hasattr(self.router, name)}
        try:
            self._set_train_routing(settings)
            yield
        finally:
            self._group_size, self._images_per_group = train.group_size, train.images_per_group
            for name, value in saved.items():
                setattr(self.router, name, value)

    @property
    def eval_routing(self):
        """The settings evaluation overrides."""
        return dict(self._eval_overrides)

    @eval_routing.setter
    def eval_routing(self, value):
        value = dict(value or {})
        try:
            settings = self.train_routing.replace(**value)  # checks every value
        except ValueError as error:
            raise ValueError(f"Invalid `eval_routing`: {error}") from None
        self._check_routing(settings, "eval_routing")
        self._eval_overrides = {name: getattr(settings, name) for name in value}

    def set_routing(self, phase="both", **settings):
        """Changes the training and/or evaluation routing.

        Nothing changes on an error.

        Args:
            phase: `"both"` (both phases use the values), `"train"` (the
                evaluation routing stays as it was) or `"eval"`.
            **settings: any of `num_selected_experts`, `capacity_factor`,
                `batch_priority`, `group_size`, `images_per_group` (setting
                one of the last two clears the other).
        """
        train, evaluation = self.planned_routing(phase, **settings)
        self._set_train_routing(train)
        self.eval_routing = evaluation.overrides_of(train)

    def planned_routing(self, phase="both", **settings):
        """The `(train, eval)` settings `set_routing` would give, checked."""
        check_one_of(phase, "phase", ROUTING_PHASES)
        train, evaluation = self.train_routing, self.routing_phase(False)
        if phase != "eval":
            train = self._check_routing(train.replace(**settings), "training routing")
        if phase != "train":
            evaluation = self._check_routing(evaluation.replace(**settings),
                                             "evaluation routing")
        return train, evaluation

    # The training routing's settings as attributes.
    num_selected_experts = _train_setting("num_selected_experts")
    capacity_factor = _train_setting("capacity_factor")
    batch_priority = _train_setting("batch_priority")
    group_size = _train_setting("group_size")
    images_per_group = _train_setting("images_per_group")

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
        experts = self.num_experts * (2 * hidden * self.mlp_dim + hidden + self.mlp_dim)
        slots = getattr(self.router, "num_slots", None) or 1
        router = hidden * self.num_experts * slots
        settings = f"num_experts={self.num_experts}, mlp_dim={self.mlp_dim}"
        if getattr(self.router, "num_slots", None):
            settings += f", num_slots={slots}"
        value_bytes = 2 if "16" in str(self.variable_dtype) else 4
        budget.check_fits(
            (experts + router) * value_bytes,
            f"{type(self).__name__} `{self.name}` ({experts + router} weights for "
            f"inputs of width {hidden})",
            settings,
        )

    def resolved_group_size(self, batch, tokens):
        """Tokens per group S; for `batch=None` (symbolic) the static S or `None`."""
        if self.images_per_group is not None:
            return self.images_per_group * tokens
        if batch is None:
            return self.group_size
        return self.group_size or batch * tokens

    def group_tokens(self, inputs):
        """(B, T, D) -> (G, S, D), the last group padded with zero tokens."""
        batch, tokens, hidden = ops.shape(inputs)
        total = batch * tokens
        if not sizes.is_static(batch, tokens):
            return self._group_symbolic(inputs, total, hidden)
        if total == 0:
            raise ValueError(
                f"{type(self).__name__} `{self.name}` received no tokens (batch "
                f"size {batch} x {tokens} tokens); pass at least one example."
            )
        group_size = self.resolved_group_size(batch, tokens)
        # `//` only: also valid for a symbolic batch (jax.export, jax2tf).
        num_groups = -(-total // group_size)
        padding = num_groups * group_size - total
        if padding and group_size % tokens == 0:
            # Whole padding examples (keeps a batch-sharded layout simple).
            inputs = ops.pad(inputs, ((0, padding // tokens), (0, 0), (0, 0)))
        elif padding:
            flat = ops.reshape(inputs, (total, hidden))
            inputs = ops.pad(flat, ((0, padding), (0, 0)))
        return ops.reshape(inputs, (num_groups, group_size, hidden))

    def _group_symbolic(self, inputs, total, hidden):
        """`group_tokens` for a symbolic batch size: the last group always padded."""
        group_size = self.resolved_group_size(None, ops.shape(inputs)[1])
        if group_size is None:
            return ops.reshape(inputs, (1, total, hidden))
        num_groups = sizes.ceil_div(total, group_size)
        flat = ops.pad(
            ops.reshape(inputs, (total, hidden)),
            ((0, num_groups * group_size - total), (0, 0)),
        )
        return ops.reshape(flat, (num_groups, group_size, hidden))

    @staticmethod
    def padding_mask(grouped_shape, num_tokens):
        """`(G, S)` bool, False for padding; `None` when there is none."""
        num_groups, group_size = grouped_shape[0], grouped_shape[1]
        if not sizes.is_static(num_groups, group_size, num_tokens):
            if sizes.is_static(num_groups) and num_groups == 1:
                return None
        elif num_groups * group_size == num_tokens:
            return None
        index = ops.arange(0, num_groups * group_size, dtype="int32")
        return ops.reshape(index < num_tokens, (num_groups, group_size))

    def _unpad(self, outputs, num_tokens):
        """(G, S, ...) -> (G·S, ...) without the padding tokens."""
        shape = ops.shape(outputs)
        flat = ops.reshape(outputs, (shape[0] * shape[1], *shape[2:]))
        if sizes.is_static(shape[0], shape[1], num_tokens) and (
            shape[0] * shape[1] == num_tokens
        ):
            return flat
        return flat[:num_tokens]

    def ungroup_tokens(self, outputs, input_shape):
        """(G, S, D) -> (B, T, D), dropping the padding."""
        num_tokens = input_shape[0] * input_shape[1]
        return ops.reshape(self._unpad(outputs, num_tokens), input_shape)

    def call(self, inputs, training=None, return_metrics=False, return_routing=False):
        input_shape = ops.shape(inputs)
        with self._routing_as(self.routing_phase(training)):
            x = constrain_groups(self.group_tokens(inputs))  # (G, S, D), G sharded
            num_tokens = input_shape[0] * input_shape[1]
            token_mask = self.padding_mask(ops.shape(x), num_tokens)
            routing = self.router(x, training=training, token_mask=token_mask)
            y = self.apply_experts(x, routing, training=training)  # (G, S, D)
            y = self.ungroup_tokens(y, input_shape)
            # Deferred losses and metrics read the router's settings: inside.
            if training and self.trainable:
                loss = routing.auxiliary_loss
                if not isinstance(loss, float) or loss != 0.0:
                    self.add_loss(loss)
            if return_routing:
                return y, routing.materialize()
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
                routing.buffer_token, routing.buffer_weight, group_size)
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
                y, routing.token_expert, routing.token_slot, routing.token_weight)
        return dispatch_lib.scatter_combine(
            y, routing.buffer_token, routing.buffer_weight, group_size)

    def compute_output_shape(self, input_shape):
        return input_shape

    def compute_output_spec(
        self, inputs, training=None, return_metrics=False, return_routing=False
    ):
        if return_metrics or return_routing:
            raise ValueError(
                "`return_metrics=True` and `return_routing=True` are only supported "
                "when calling the layer on real tensors.")
        return keras.KerasTensor(inputs.shape, dtype=self.compute_dtype)

    def get_config(self):
        config = super().get_config()
        router = keras.saving.serialize_keras_object(self.router)
        # No build config: on reload the router builds in this layer's scope.
        router.pop("build_config", None)
        config.update({"num_experts": self.num_experts, "mlp_dim": self.mlp_dim,
                       "router": router, "group_size": self.group_size,
                       "images_per_group": self.images_per_group,
                       "eval_routing": self.eval_routing or None, "dropout_rate": self.dropout_rate,
                       "identical_init": self.identical_init,
                       "bfloat16_dispatch": self.bfloat16_dispatch, "dispatch": self.dispatch,
                       "activation": self.experts.activation,
                       "kernel_initializer": keras.initializers.serialize(self.kernel_initializer),
                       "bias_initializer": keras.initializers.serialize(self.bias_initializer)})
        if self.experts.quantization_mode:
            config["experts_dtype"] = keras.dtype_policies.serialize(
                self.experts.dtype_policy)
        return config
