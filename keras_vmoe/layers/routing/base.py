"""What every router shares: the `Routing` result, the `Router` base layer,
the checks of router settings and the statistics of sparse routings.

Axis letters: G groups, S tokens per group, D hidden size, E experts,
C capacity, K choices per token, P slots per expert, N partitions.
"""

import dataclasses
from typing import Any

import keras
from keras import ops

from keras_vmoe.layers import symbolic_sizes as sizes
from keras_vmoe.layers.capacity import CEIL_OR_ROUND
from keras_vmoe.layers.capacity import compute_capacity
from keras_vmoe.layers.capacity import validate_capacity_factor
from keras_vmoe.layers.capacity import validate_real
from keras_vmoe.utils.validation import check_int
from keras_vmoe.utils.validation import check_one_of


class Deferred:
    """The value of `compute()`, computed on its first use (`get`).

    Eager PyTorch runs every op, even unused ones: a `Routing`'s losses and
    metrics run only when read, inside the same call.
    """

    __slots__ = ("_compute", "_value")
    _PENDING = object()

    def __init__(self, compute):
        self._compute = compute
        self._value = Deferred._PENDING

    def get(self):
        if self._value is Deferred._PENDING:
            self._value = self._compute()
            self._compute = None
        return self._value


def resolve(value):
    """`value`, or what it computes if it is a `Deferred`."""
    return value.get() if isinstance(value, Deferred) else value


_DEFERRABLE = frozenset({"auxiliary_losses", "auxiliary_loss", "metrics"})


@dataclasses.dataclass
class Routing:
    """The result of routing one call's groups of tokens.

    Sparse routings fill `buffer_token`/`buffer_weight` (Token Choice also
    `token_*`); soft routings `dispatch_weights`/`combine_weights`.

    Attributes:
        capacity: int C (slots per expert per group), or P for Soft MoE.
        buffer_token: `(G, E, C)` int32 token of each slot, S if empty.
        buffer_weight: `(G, E, C)` combine weight of each slot (0 if empty).
        token_expert: `(G, S, K)` int32 experts chosen by each token.
        token_slot: `(G, S, K)` int32 slot of each choice, C if dropped.
        token_weight: `(G, S, K)` combine weight of each choice (0 if dropped).
        dispatch_weights: `(G, S, E, P)` Soft MoE dispatch weights.
        combine_weights: `(G, S, E, P)` Soft MoE combine weights.
        gates: `(G, S, E)` router probabilities (for analysis).
        auxiliary_losses: dict of unweighted losses, one value per group.
        auxiliary_loss: scalar weighted sum of the group-averaged losses.
        metrics: dict of scalar routing statistics.

    `auxiliary_losses`, `auxiliary_loss` and `metrics` may be `Deferred`
    (computed on first access); `materialize` a routing that leaves its call.
    """

    capacity: int
    buffer_token: Any = None
    buffer_weight: Any = None
    token_expert: Any = None
    token_slot: Any = None
    token_weight: Any = None
    dispatch_weights: Any = None
    combine_weights: Any = None
    gates: Any = None
    auxiliary_losses: dict = dataclasses.field(default_factory=dict)
    auxiliary_loss: Any = 0.0
    metrics: dict = dataclasses.field(default_factory=dict)

    def __getattribute__(self, name):
        value = object.__getattribute__(self, name)
        if name in _DEFERRABLE and isinstance(value, Deferred):
            value = value.get()
            object.__setattr__(self, name, value)
        return value

    def materialize(self):
        """Computes every deferred field now; returns the routing."""
        for name in _DEFERRABLE:
            getattr(self, name)
        return self

    @property
    def is_sparse(self):
        return self.buffer_token is not None


def finite_logits(logits):
    """`(logits, valid)`: `(G, S, E)` logits, non-finite rows set to 0, and the
    `(G, S)` mask of the tokens with finite logits (NaN/inf take no capacity)."""
    valid = ops.all(ops.isfinite(logits), axis=-1)  # (G, S)
    return ops.where(valid[..., None], logits, ops.zeros_like(logits)), valid


# Iterations and solver steps are unrolled when traced: more would not end.
MAX_ITERATIONS = 1000


def check_capacity_factor(value, name):
    """None or a finite float > 0."""
    return None if value is None else validate_capacity_factor(value, name)


class Setting:
    """A router setting checked by `check(value, name, **options)` when set."""

    def __init__(self, check, **options):
        self.check = check
        self.options = options

    def __set_name__(self, owner, name):
        self.name = name
        self.attribute = f"_{name}"

    def __get__(self, obj, objtype=None):
        return self if obj is None else getattr(obj, self.attribute)

    def __set__(self, obj, value):
        setattr(obj, self.attribute, self.check(value, self.name, **self.options))


class Router(keras.layers.Layer):
    """Base class of the routers. Subclasses implement `route`.

    Args:
        num_experts: int, number of experts E.
        noise_std: float >= 0, std of the training logit noise, divided by E.
        capacity_factor: float, slots relative to the tokens per expert.
        capacity: int, explicit number of slots per expert per group.
        capacity_ceil_or_round: `"ceil"` or `"round"` (half to even).
        capacity_multiple_of: int or `None`, round the capacity up to a multiple.
        kernel_initializer: initializer of the `(D, E)` gating kernel.
        **kwargs: base layer arguments.
    """

    def __init__(
        self,
        num_experts,
        noise_std=1.0,
        capacity_factor=1.0,
        capacity=None,
        capacity_ceil_or_round="ceil",
        capacity_multiple_of=4,
        kernel_initializer="lecun_normal",
        **kwargs,
    ):
        super().__init__(**kwargs)
        num_experts = check_int(num_experts, "num_experts")
        check_one_of(capacity_ceil_or_round, "capacity_ceil_or_round", CEIL_OR_ROUND)
        self.num_experts = num_experts
        self.noise_std = noise_std
        self.capacity_factor = capacity_factor
        self.capacity = capacity
        self.capacity_ceil_or_round = capacity_ceil_or_round
        self.capacity_multiple_of = capacity_multiple_of
        self.kernel_initializer = keras.initializers.get(kernel_initializer)
        self.seed_generator = keras.random.SeedGenerator(name="seed_generator")
        self._validate_capacity_settings()

    capacity_multiple_of = Setting(check_int, allow_none=True)
    noise_std = Setting(validate_real, allow_minimum=True)
    # `None` only together with an explicit `capacity`.
    capacity_factor = Setting(check_capacity_factor)

    def _validate_capacity_settings(self):
        if self.capacity is not None:
            check_int(self.capacity, "capacity")
        elif self.capacity_factor is None:
            raise ValueError(
                "Set either `capacity` (int >= 1) or a positive `capacity_factor`. "
                f"Received: capacity={self.capacity!r}, "
                f"capacity_factor={self.capacity_factor!r}")

    def build(self, input_shape):
        self.kernel = self.add_weight(
            name="kernel", shape=(input_shape[-1], self.num_experts),
            initializer=self.kernel_initializer)

    @property
    def effective_noise_std(self):
        return self.noise_std / self.num_experts

    def compute_logits(self, x):
        """Router logits in float32. (G, S, D) -> (G, S, E)."""
        x = ops.cast(x, "float32")
        kernel = ops.cast(self.kernel, "float32")
        return ops.einsum("gsd,de->gse", x, kernel)

    def finite_logits(self, x, token_mask=None):
        """`finite_logits(self.compute_logits(x))`, `token_mask` and-ed into valid."""
        logits, valid = finite_logits(self.compute_logits(x))
        return logits, and_mask(valid, token_mask)

    def add_noise(self, logits, training):
        if not training or self.noise_std == 0:
            return logits
        noise = keras.random.normal(ops.shape(logits), seed=self.seed_generator)
        return logits + self.effective_noise_std * noise

    def num_capacity_tokens(self, group_size):
        """Tokens competing for capacity in a group of `group_size` tokens."""
        return group_size

    def get_capacity(self, group_size):
        """Slots per expert for a group of `group_size` tokens, at most S."""
        if self.capacity is not None:
            return sizes.minimum(self.capacity, group_size)
        return compute_capacity(
            self.num_capacity_tokens(group_size), self.num_experts,
            self.capacity_factor, self.capacity_ceil_or_round,
            self.capacity_multiple_of, max_capacity=group_size)

    def call(self, x, training=None, token_mask=None):
        """Routes `x` `(G, S, D)`; padding tokens (`token_mask` False) take no
        capacity and count in no auxiliary loss."""
        if len(x.shape) != 3:
            raise ValueError("Routers expect grouped tokens of shape (G, S, D). "
                             f"Received shape: {tuple(x.shape)}")
        if token_mask is None:
            return self.route(x, training=bool(training))
        return self.route(x, training=bool(training), token_mask=token_mask)

    def route(self, x, training=False, token_mask=None):
        raise NotImplementedError

    def compute_output_spec(self, x, training=None, token_mask=None):
        return None

    def get_config(self):
        config = super().get_config()
        config.update({"num_experts": self.num_experts, "noise_std": self.noise_std,
                       "capacity_factor": self.capacity_factor, "capacity": self.capacity,
                       "capacity_ceil_or_round": self.capacity_ceil_or_round,
                       "capacity_multiple_of": self.capacity_multiple_of,
                       "kernel_initializer": keras.initializers.serialize(self.kernel_initializer)})
        return config


def and_mask(valid, token_mask):
    """`valid & token_mask` (`valid` when there is no mask)."""
    if token_mask is None:
        return valid
    return ops.logical_and(valid, ops.cast(token_mask, "bool"))


def sparse_metrics(buffer_token, group_size, num_experts, capacity, kept=None,
                    token_mask=None):
    """Scalar statistics of a sparse routing (means over real tokens and groups)."""
    num_groups = ops.shape(buffer_token)[0]
    filled = ops.cast(buffer_token < group_size, "float32")  # (G, E, C)
    ones = ops.reshape(filled, (-1,))
    offset = ops.arange(0, num_groups, dtype="int32")[:, None, None] * (group_size + 1)
    segment = ops.reshape(buffer_token + offset, (-1,))
    per_token = ops.segment_sum(ones, segment, num_segments=num_groups * (group_size + 1))
    per_token = ops.reshape(per_token, (num_groups, group_size + 1))[:, :group_size]
    dropped = ops.cast(per_token == 0, "float32")
    if token_mask is None:
        token_stats = {
            "tokens_dropped_fraction": ops.mean(dropped),
            "experts_per_token_mean": ops.mean(per_token),
            "experts_per_token_min": ops.min(per_token),
            "experts_per_token_max": ops.max(per_token),
        }
    else:
        real = ops.cast(token_mask, "float32")
        count = ops.maximum(ops.sum(real), 1.0)
        token_stats = {
            "tokens_dropped_fraction": ops.sum(dropped * real) / count,
            "experts_per_token_mean": ops.sum(per_token * real) / count,
            "experts_per_token_min": ops.min(
                ops.where(token_mask, per_token, float(num_experts))),
            "experts_per_token_max": ops.max(ops.where(token_mask, per_token, 0.0)),
        }
    metrics = {"expert_fill": ops.mean(filled), **token_stats}
    if kept is not None:
        kept = ops.cast(kept, "float32")  # (G, S, K)
        if token_mask is None:
            kept_fraction = ops.mean(kept)
        else:
            real = ops.cast(token_mask, "float32")[..., None]
            kept_fraction = ops.sum(kept * real) / ops.maximum(
                ops.sum(real) * ops.shape(kept)[-1], 1.0)
        metrics["dropped_assignments_fraction"] = ops.maximum(1.0 - kept_fraction, 0.0)
    return metrics
