"""Routers: map a group of tokens `(G, S, D)` to a `Routing`.

Sparse routers (Token Choice and Expert Choice with softmax, Sinkhorn or
sparsity-constrained affinities) produce buffer *indices*; the Soft MoE
router produces dense dispatch and combine weights. Every router also
returns its auxiliary losses (per group) and routing metrics.

Axis letters: G groups, S tokens per group, D hidden size, E experts,
C capacity, K choices per token, P slots per expert, N partitions.
"""

import dataclasses
import math
from typing import Any

import keras
from keras import ops

from keras_vmoe.layers import affinity as affinity_lib
from keras_vmoe.layers import losses as losses_lib
from keras_vmoe.layers.allocation import expert_choice_allocation
from keras_vmoe.layers.allocation import token_choice_allocation
from keras_vmoe.layers.capacity import CEIL_OR_ROUND
from keras_vmoe.layers.capacity import compute_capacity
from keras_vmoe.layers.capacity import validate_capacity_factor
from keras_vmoe.layers.capacity import validate_real

# Dispatch affinity given to tokens with non-finite router logits (NaN/inf
# inputs): below every softmax gate or transport-plan value (all >= 0), so
# such tokens never win an Expert Choice slot.
_INVALID_AFFINITY = -1.0


@dataclasses.dataclass
class Routing:
    """The result of routing one call's groups of tokens.

    Sparse routings fill `buffer_token`/`buffer_weight` (and, for Token
    Choice, the per-token `token_*` fields used by the gather combine).
    Soft routings fill `dispatch_weights`/`combine_weights`.

    Attributes:
        capacity: int C (slots per expert per group), or P for Soft MoE.
        buffer_token: `(G, E, C)` int32 token index held by each slot; the
            group size S marks an empty slot.
        buffer_weight: `(G, E, C)` combine weight of each slot (0 if empty).
        token_expert: `(G, S, K)` int32 experts chosen by each token.
        token_slot: `(G, S, K)` int32 slot of each choice, C if dropped.
        token_weight: `(G, S, K)` combine weight of each choice (0 if
            dropped).
        dispatch_weights: `(G, S, E, P)` Soft MoE dispatch weights.
        combine_weights: `(G, S, E, P)` Soft MoE combine weights.
        gates: `(G, S, E)` router probabilities (for analysis).
        auxiliary_losses: dict of unweighted losses, one value per group.
        auxiliary_loss: scalar weighted sum of the auxiliary losses,
            averaged over groups (0 when the router has none).
        metrics: dict of scalar routing statistics.
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

    @property
    def is_sparse(self):
        return self.buffer_token is not None


def finite_logits(logits):
    """Separates tokens with non-finite router logits from the others.

    A NaN/inf image must not take expert capacity from the other images of
    its group: its tokens are excluded from routing (they are dropped, and
    the residual connection carries them).

    Args:
        logits: `(G, S, E)` router logits.

    Returns:
        `(logits, valid)`: the logits with the rows of invalid tokens set to
        0 (finite, so that softmax and Sinkhorn stay finite) and the
        `(G, S)` boolean mask of the tokens whose logits are all finite.
    """
    valid = ops.all(ops.isfinite(logits), axis=-1)  # (G, S)
    return ops.where(valid[..., None], logits, ops.zeros_like(logits)), valid


def _check_positive_int(name, value, minimum=1):
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(
            f"`{name}` must be an integer >= {minimum}. Received: {name}={value!r}"
        )


# Iterations and solver steps are unrolled when traced: more would not end.
MAX_ITERATIONS = 1000


def _iterations(value, name):
    """An int in [1, MAX_ITERATIONS] (Sinkhorn iterations, solver steps)."""
    if (
        not isinstance(value, int)
        or isinstance(value, bool)
        or not 1 <= value <= MAX_ITERATIONS
    ):
        raise ValueError(
            f"`{name}` must be an integer between 1 and {MAX_ITERATIONS}. "
            f"Received: {name}={value!r}"
        )
    return value


def _loss_weight(value, name):
    """A finite float >= 0 (0 turns the loss off)."""
    return validate_real(value, name, allow_minimum=True)


def _learning_rate(value, name):
    return validate_real(value, name)


def _multiple_of(value, name):
    """None (no rounding) or an int >= 1."""
    if value is not None:
        _check_positive_int(name, value)
    return value


class _Setting:
    """A router setting checked at construction and on every assignment.

    `check(value, name)` returns the value to store or raises a
    `ValueError` naming the setting, the value and the valid range.
    """

    def __init__(self, check):
        self.check = check

    def __set_name__(self, owner, name):
        self.name = name
        self.attribute = f"_{name}"

    def __get__(self, obj, objtype=None):
        return self if obj is None else getattr(obj, self.attribute)

    def __set__(self, obj, value):
        setattr(obj, self.attribute, self.check(value, self.name))


class Router(keras.layers.Layer):
    """Base class of the routers. Subclasses implement `route`.

    Args:
        num_experts: int, number of experts E.
        noise_std: float, std of the Gaussian noise added to the router
            logits in training, divided by the number of experts (upstream
            convention: `noise_std=1.0` means std `1/E`). 0 disables it.
        capacity_factor: float, slots per expert relative to the tokens per
            expert (ignored when `capacity` is set).
        capacity: int, explicit number of slots per expert per group.
        capacity_ceil_or_round: `"ceil"` or `"round"` (half to even).
        capacity_multiple_of: int >= 1, round the capacity up to a multiple
            of it (`None` or 1: no rounding).
        kernel_initializer: initializer of the `(D, E)` gating kernel.
        **kwargs: base layer arguments (`name`, `dtype`, ...).
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
        _check_positive_int("num_experts", num_experts)
        if capacity_ceil_or_round not in CEIL_OR_ROUND:
            raise ValueError(
                f"`capacity_ceil_or_round` must be one of {CEIL_OR_ROUND}. "
                f"Received: capacity_ceil_or_round={capacity_ceil_or_round!r}"
            )
        self.num_experts = num_experts
        self.noise_std = noise_std
        self.capacity_factor = capacity_factor
        self.capacity = capacity
        self.capacity_ceil_or_round = capacity_ceil_or_round
        self.capacity_multiple_of = capacity_multiple_of
        self.kernel_initializer = keras.initializers.get(kernel_initializer)
        self.seed_generator = keras.random.SeedGenerator(name="seed_generator")
        self._validate_capacity_settings()

    capacity_multiple_of = _Setting(_multiple_of)

    @property
    def noise_std(self):
        return self._noise_std

    @noise_std.setter
    def noise_std(self, value):
        self._noise_std = validate_real(value, "noise_std", allow_minimum=True)

    @property
    def capacity_factor(self):
        return self._capacity_factor

    @capacity_factor.setter
    def capacity_factor(self, value):
        # `None` only together with an explicit `capacity`.
        self._capacity_factor = (
            None if value is None else validate_capacity_factor(value)
        )

    def _validate_capacity_settings(self):
        if self.capacity is not None:
            _check_positive_int("capacity", self.capacity)
        elif self.capacity_factor is None:
            raise ValueError(
                "Set either `capacity` (int >= 1) or a positive `capacity_factor`. "
                f"Received: capacity={self.capacity!r}, "
                f"capacity_factor={self.capacity_factor!r}"
            )

    def build(self, input_shape):
        hidden = input_shape[-1]
        self.kernel = self.add_weight(
            name="kernel",
            shape=(hidden, self.num_experts),
            initializer=self.kernel_initializer,
        )

    @property
    def effective_noise_std(self):
        return self.noise_std / self.num_experts

    def compute_logits(self, x):
        """Router logits in float32. (G, S, D) -> (G, S, E)."""
        x = ops.cast(x, "float32")
        kernel = ops.cast(self.kernel, "float32")
        return ops.einsum("gsd,de->gse", x, kernel)

    def finite_logits(self, x, token_mask=None):
        """`finite_logits(self.compute_logits(x))`: logits and valid mask.

        `token_mask` `(G, S)` (False for the padding of a partial group)
        is and-ed into the valid mask.
        """
        logits, valid = finite_logits(self.compute_logits(x))
        return logits, _and_mask(valid, token_mask)

    def add_noise(self, logits, training):
        if not training or self.noise_std == 0:
            return logits
        noise = keras.random.normal(ops.shape(logits), seed=self.seed_generator)
        return logits + self.effective_noise_std * noise

    def num_capacity_tokens(self, group_size):
        """Tokens competing for capacity in a group of `group_size` tokens."""
        return group_size

    def get_capacity(self, group_size):
        """Slots per expert for a group of `group_size` tokens.

        Capped at `group_size`: an expert can never receive more than S
        tokens (Token Choice) and can at most take every token (Expert
        Choice), so an explicit `capacity` or a huge `capacity_factor` never
        allocates more than S slots.
        """
        if self.capacity is not None:
            return min(self.capacity, group_size)
        return compute_capacity(
            self.num_capacity_tokens(group_size),
            self.num_experts,
            self.capacity_factor,
            self.capacity_ceil_or_round,
            self.capacity_multiple_of,
            max_capacity=group_size,
        )

    def call(self, x, training=None, token_mask=None):
        """Routes `x` `(G, S, D)`.

        Args:
            x: grouped tokens.
            training: bool.
            token_mask: optional `(G, S)` bool, False for padding tokens
                (`MoeLayer` pads a partial last group): they take no
                capacity, receive no expert and count in no auxiliary loss.
        """
        if len(x.shape) != 3:
            raise ValueError(
                f"Routers expect grouped tokens of shape (G, S, D). "
                f"Received shape: {tuple(x.shape)}"
            )
        if token_mask is None:
            return self.route(x, training=bool(training))
        return self.route(x, training=bool(training), token_mask=token_mask)

    def route(self, x, training=False, token_mask=None):
        raise NotImplementedError

    def compute_output_spec(self, x, training=None, token_mask=None):
        return None

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "num_experts": self.num_experts,
                "noise_std": self.noise_std,
                "capacity_factor": self.capacity_factor,
                "capacity": self.capacity,
                "capacity_ceil_or_round": self.capacity_ceil_or_round,
                "capacity_multiple_of": self.capacity_multiple_of,
                "kernel_initializer": keras.initializers.serialize(
                    self.kernel_initializer
                ),
            }
        )
        return config


def _and_mask(valid, token_mask):
    """`valid & token_mask` (`valid` when there is no mask)."""
    if token_mask is None:
        return valid
    return ops.logical_and(valid, ops.cast(token_mask, "bool"))


def _sparse_metrics(buffer_token, group_size, num_experts, capacity, kept=None,
                    token_mask=None):
    """Scalar routing statistics of a sparse routing (means over groups).

    Per-token statistics leave out the padding tokens of `token_mask`.
    """
    num_groups = ops.shape(buffer_token)[0]
    filled = ops.cast(buffer_token < group_size, "float32")  # (G, E, C)
    ones = ops.reshape(filled, (-1,))
    segment = ops.reshape(
        buffer_token + ops.arange(0, num_groups, dtype="int32")[:, None, None] * (group_size + 1),
        (-1,),
    )
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
                ops.where(token_mask, per_token, float(num_experts))
            ),
            "experts_per_token_max": ops.max(ops.where(token_mask, per_token, 0.0)),
        }
    metrics = {"expert_fill": ops.mean(filled), **token_stats}
    if kept is not None:
        kept = ops.cast(kept, "float32")  # (G, S, K)
        if token_mask is None:
            kept_fraction = ops.mean(kept)
        else:  # over the assignments of real tokens
            real = ops.cast(token_mask, "float32")[..., None]
            kept_fraction = ops.sum(kept * real) / ops.maximum(
                ops.sum(real) * ops.shape(kept)[-1], 1.0
            )
        metrics["dropped_assignments_fraction"] = ops.maximum(
            1.0 - kept_fraction, 0.0
        )
    return metrics


@keras.saving.register_keras_serializable(package="keras_vmoe")
class TokenChoiceRouter(Router):
    """Token Choice router: each token picks its top-K experts (V-MoE).

    With `affinity="softmax"` this is upstream's
    `NoisyTopExpertsPerItemRouter`: gates `softmax(logits + noise)`, top-K
    without renormalisation, k-major capacity allocation, optional Batch
    Prioritized Routing. With `affinity="sinkhorn"` the choices come from
    the Sinkhorn plan and the combine weights from the clean softmax.

    Args:
        num_experts: int, number of experts E.
        num_selected_experts: int K, experts per token (1 <= K <= E).
        affinity: `"softmax"` or `"sinkhorn"`.
        batch_priority: bool, use Batch Prioritized Routing.
        importance_loss_weight: float, weight of the importance loss.
            `None` (default): 0.005 for `affinity="softmax"` (V-MoE) and 0
            for `"sinkhorn"` (Sinkhorn balances the experts itself, as in
            upstream's Sinkhorn Token Choice).
        load_loss_weight: float, weight of the load loss (noisy training
            only). `None` (default): 0.005 for softmax, 0 for Sinkhorn.
        gshard_loss_weight: float, weight of the GShard loss.
            The three loss weights are finite and >= 0.
        sinkhorn_iterations: int, Sinkhorn iterations, 1 to
            `MAX_ITERATIONS` (the loop is unrolled when traced).
        **kwargs: `Router` arguments (noise and capacity settings, name...).

    Examples:

    >>> router = TokenChoiceRouter(num_experts=8, num_selected_experts=2,
    ...                            capacity_factor=1.05)
    >>> routing = router(keras.random.normal((2, 400, 32)))
    >>> routing.buffer_token.shape  # capacity ceil(400*2*1.05/8) -> 108
    (2, 8, 108)
    """

    # Importance and load loss weights by affinity (upstream defaults).
    DEFAULT_BALANCE_LOSS_WEIGHT = {"softmax": 0.005, "sinkhorn": 0.0}
    importance_loss_weight = _Setting(_loss_weight)
    load_loss_weight = _Setting(_loss_weight)
    gshard_loss_weight = _Setting(_loss_weight)
    sinkhorn_iterations = _Setting(_iterations)

    def __init__(
        self,
        num_experts,
        num_selected_experts=1,
        affinity="softmax",
        batch_priority=False,
        importance_loss_weight=None,
        load_loss_weight=None,
        gshard_loss_weight=0.0,
        sinkhorn_iterations=20,
        **kwargs,
    ):
        super().__init__(num_experts, **kwargs)
        if affinity not in ("softmax", "sinkhorn"):
            raise ValueError(
                "`affinity` of a Token Choice router must be 'softmax' or "
                f"'sinkhorn'. Received: affinity={affinity!r}"
            )
        self.affinity = affinity
        self.num_selected_experts = num_selected_experts
        self.batch_priority = batch_priority
        default_weight = self.DEFAULT_BALANCE_LOSS_WEIGHT[affinity]
        self.importance_loss_weight = (
            default_weight if importance_loss_weight is None else importance_loss_weight
        )
        self.load_loss_weight = (
            default_weight if load_loss_weight is None else load_loss_weight
        )
        self.gshard_loss_weight = gshard_loss_weight
        self.sinkhorn_iterations = sinkhorn_iterations

    @property
    def num_selected_experts(self):
        return self._num_selected_experts

    @num_selected_experts.setter
    def num_selected_experts(self, value):
        _check_positive_int("num_selected_experts", value)
        limit = self.experts_per_choice_set
        if value > limit:
            raise ValueError(
                f"`num_selected_experts` must be <= {limit} (the experts a token "
                f"can choose from). Received: num_selected_experts={value}"
            )
        self._num_selected_experts = value

    @property
    def experts_per_choice_set(self):
        """Experts one token can choose from (E; E/N when partitioned)."""
        return self.num_experts

    def num_capacity_tokens(self, group_size):
        return group_size * self.num_selected_experts

    def route(self, x, training=False, token_mask=None):
        logits, valid = self.finite_logits(x, token_mask)  # (G, S, E), (G, S)
        logits_noisy = self.add_noise(logits, training)
        group_size = ops.shape(x)[1]
        capacity = self.get_capacity(group_size)
        gates_clean = ops.softmax(logits, axis=-1)
        gates = ops.softmax(logits_noisy, axis=-1) if logits_noisy is not logits else gates_clean
        if self.affinity == "softmax":
            dispatch_gates = combine_gates = gates
        else:
            dispatch_gates = ops.stop_gradient(
                affinity_lib.sinkhorn(logits_noisy, self.sinkhorn_iterations, valid)
            )
            # Quirk of the reference Token Choice code: combine uses the clean
            # softmax even when the dispatch logits are noisy.
            combine_gates = gates_clean
        allocation = token_choice_allocation(
            dispatch_gates, combine_gates, self.num_selected_experts, capacity,
            self.batch_priority, valid=valid,
        )
        aux = self.auxiliary_losses(
            logits, logits_noisy, gates_clean, gates, token_mask
        )
        return self.make_routing(
            allocation, capacity, group_size, combine_gates, aux, token_mask
        )

    def make_routing(self, allocation, capacity, group_size, gates, aux,
                     token_mask=None):
        """Wraps a Token Choice allocation, its losses and metrics in a `Routing`."""
        kept = allocation["token_slot"] < capacity
        metrics = _sparse_metrics(
            allocation["buffer_token"], group_size, self.num_experts, capacity, kept,
            token_mask,
        )
        return Routing(
            capacity=capacity,
            gates=gates,
            auxiliary_losses=aux,
            auxiliary_loss=self.weighted_auxiliary_loss(aux),
            metrics=metrics,
            **allocation,
        )

    def auxiliary_losses(self, logits, logits_noisy, gates_clean, gates,
                         token_mask=None):
        """Unweighted losses, one value per group (upstream semantics).

        Padding tokens (`token_mask` False) count in none of them.
        """
        aux = {
            "importance_loss": losses_lib.importance_loss(gates_clean, token_mask),
            "gshard_loss": losses_lib.gshard_loss(gates, token_mask),
        }
        if logits_noisy is not logits:
            aux["load_loss"] = losses_lib.load_loss(
                logits, logits_noisy, self.effective_noise_std,
                self.num_selected_experts, token_mask,
            )
        return aux

    def weighted_auxiliary_loss(self, aux):
        weights = {
            "importance_loss": self.importance_loss_weight,
            "load_loss": self.load_loss_weight,
            "gshard_loss": self.gshard_loss_weight,
        }
        total = 0.0
        for name, value in aux.items():
            if weights.get(name, 0.0) > 0:
                total = total + weights[name] * ops.mean(value)
        return total

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "num_selected_experts": self.num_selected_experts,
                "affinity": self.affinity,
                "batch_priority": self.batch_priority,
                "importance_loss_weight": self.importance_loss_weight,
                "load_loss_weight": self.load_loss_weight,
                "gshard_loss_weight": self.gshard_loss_weight,
                "sinkhorn_iterations": self.sinkhorn_iterations,
            }
        )
        return config


@keras.saving.register_keras_serializable(package="keras_vmoe")
class PartitionedTokenChoiceRouter(TokenChoiceRouter):
    """Token Choice router of E³: one router slice per ensemble member.

    The experts are split into `num_partitions` contiguous blocks of E/N;
    the tokens of a group are interleaved by member (`(S/N, N)` order, the
    member index varying fastest, as after upstream's regrouping) and member
    n can only choose experts of block n. Gates are assembled
    block-diagonally into `(G, S, E)` and allocated with the usual top-K
    capacity algorithm, so capacity is shared by the whole group. The noise
    std is `noise_std / (E/N)` and the auxiliary losses are computed per
    member, as upstream's `NoisyTopExpertsPerItemEnsembleRouter`.

    The gating kernel has shape `(D, N, E/N)`.

    Args:
        num_experts: int E, divisible by `num_partitions`.
        num_partitions: int N, ensemble members.
        **kwargs: `TokenChoiceRouter` arguments.
    """

    def __init__(self, num_experts, num_partitions=1, **kwargs):
        _check_positive_int("num_partitions", num_partitions)
        if num_experts % num_partitions:
            raise ValueError(
                f"`num_experts` ({num_experts}) must be divisible by "
                f"`num_partitions` ({num_partitions}); valid values of "
                f"num_partitions divide {num_experts}."
            )
        self.num_partitions = num_partitions
        super().__init__(num_experts, **kwargs)
        if self.affinity != "softmax":
            raise ValueError(
                "PartitionedTokenChoiceRouter supports affinity='softmax' only. "
                f"Received: affinity={self.affinity!r}"
            )

    @property
    def experts_per_partition(self):
        return self.num_experts // self.num_partitions

    @property
    def experts_per_choice_set(self):
        return self.experts_per_partition

    @property
    def effective_noise_std(self):
        return self.noise_std / self.experts_per_partition

    def build(self, input_shape):
        self.kernel = self.add_weight(
            name="kernel",
            shape=(input_shape[-1], self.num_partitions, self.experts_per_partition),
            initializer=self.kernel_initializer,
        )

    def _member_logits(self, x):
        """(G, S, D) -> (G, S/N, N, E/N) logits of each member's router."""
        num_groups, group_size, hidden = ops.shape(x)
        n = self.num_partitions
        if group_size % n:
            raise ValueError(
                f"The group size ({group_size}) must be divisible by the number "
                f"of partitions ({n})."
            )
        x = ops.reshape(ops.cast(x, "float32"), (num_groups, group_size // n, n, hidden))
        kernel = ops.cast(self.kernel, "float32")
        return ops.einsum("gtnd,dne->gtne", x, kernel)

    def _block_diagonal(self, member_values):
        """(G, S/N, N, E/N) -> (G, S, E) with zeros outside each member's block."""
        num_groups, tokens, n, per = ops.shape(member_values)
        eye = ops.eye(n, dtype=member_values.dtype)  # (N, N)
        full = member_values[:, :, :, None, :] * eye[None, None, :, :, None]
        return ops.reshape(full, (num_groups, tokens * n, n * per))

    def route(self, x, training=False, token_mask=None):
        group_size = ops.shape(x)[1]
        capacity = self.get_capacity(group_size)
        logits = self._member_logits(x)  # (G, T', N, E/N)
        num_groups, tokens, n, per = ops.shape(logits)
        logits, valid = finite_logits(logits)  # valid (G, T', N)
        valid = ops.reshape(valid, (num_groups, tokens * n))  # (G, S)
        valid = _and_mask(valid, token_mask)
        logits_noisy = self.add_noise(logits, training)
        gates_clean = ops.softmax(logits, axis=-1)
        gates = (
            ops.softmax(logits_noisy, axis=-1)
            if logits_noisy is not logits else gates_clean
        )
        full_gates = self._block_diagonal(gates)  # (G, S, E)
        allocation = token_choice_allocation(
            full_gates, full_gates, self.num_selected_experts, capacity,
            self.batch_priority, valid=valid,
        )

        def per_member(t):  # (G, T', N, E/N) -> (G·N, T', E/N)
            num_groups, tokens, n, per = ops.shape(t)
            return ops.reshape(ops.transpose(t, (0, 2, 1, 3)), (num_groups * n, tokens, per))

        member_logits = per_member(logits)
        member_noisy = (
            per_member(logits_noisy) if logits_noisy is not logits else member_logits
        )
        member_mask = None
        if token_mask is not None:  # (G, S) -> (G·N, T')
            member_mask = per_member(
                ops.reshape(token_mask, (num_groups, tokens, n, 1))
            )[..., 0]
        aux = self.auxiliary_losses(
            member_logits, member_noisy, per_member(gates_clean), per_member(gates),
            member_mask,
        )
        num_groups = ops.shape(x)[0]
        aux = {k: ops.reshape(v, (num_groups, self.num_partitions)) for k, v in aux.items()}
        return self.make_routing(
            allocation, capacity, group_size, full_gates, aux, token_mask
        )

    def get_config(self):
        config = super().get_config()
        config["num_partitions"] = self.num_partitions
        return config


@keras.saving.register_keras_serializable(package="keras_vmoe")
class ExpertChoiceRouter(Router):
    """Expert Choice router: each expert picks its top-C tokens.

    `affinity="softmax"` is upstream's `NoisyTopItemsPerExpertRouter`;
    `"sinkhorn"` picks tokens from the Sinkhorn plan and `"sparse"` from the
    sparsity-constrained (k-sparse OT) plan of the routers study (an
    expensive, experimental router); both combine with the softmax gates.
    Capacity is `C = ceil(S·cf/E)` (no K factor), capped at the group size
    S (an expert can at most take every token). There is no auxiliary
    loss (importance/load weights are 0 for every affinity). The
    sparsity-constrained router adds no training noise (as the paper's
    `softmax(XW)` and upstream), whatever `noise_std` says.

    Args:
        num_experts: int, number of experts E.
        affinity: `"softmax"`, `"sinkhorn"` or `"sparse"`.
        sinkhorn_iterations: int, Sinkhorn iterations, 1 to `MAX_ITERATIONS`.
        sparse_steps: int, Adam steps of the sparsity-constrained solver,
            1 to `MAX_ITERATIONS`.
        sparse_learning_rate: float, its learning rate (finite, > 0).
        **kwargs: `Router` arguments.

    Examples:

    >>> router = ExpertChoiceRouter(num_experts=4, capacity_factor=1.0)
    >>> routing = router(keras.random.normal((2, 34, 16)))
    >>> routing.buffer_token.shape  # ceil(34/4)=9 -> multiple of 4 -> 12
    (2, 4, 12)
    """

    AFFINITIES = ("softmax", "sinkhorn", "sparse")
    sinkhorn_iterations = _Setting(_iterations)
    sparse_steps = _Setting(_iterations)
    sparse_learning_rate = _Setting(_learning_rate)

    def __init__(
        self,
        num_experts,
        affinity="softmax",
        sinkhorn_iterations=20,
        sparse_steps=20,
        sparse_learning_rate=1e-2,
        **kwargs,
    ):
        super().__init__(num_experts, **kwargs)
        if affinity not in self.AFFINITIES:
            raise ValueError(
                f"`affinity` of an Expert Choice router must be one of "
                f"{self.AFFINITIES}. Received: affinity={affinity!r}"
            )
        self.affinity = affinity
        self.sinkhorn_iterations = sinkhorn_iterations
        self.sparse_steps = sparse_steps
        self.sparse_learning_rate = sparse_learning_rate

    def route(self, x, training=False, token_mask=None):
        group_size = ops.shape(x)[1]
        capacity = self.get_capacity(group_size)
        logits, valid = self.finite_logits(x, token_mask)  # (G, S, E), (G, S)
        if self.affinity != "sparse":
            logits = self.add_noise(logits, training)
        gates = ops.softmax(logits, axis=-1)
        if self.affinity == "softmax":
            dispatch = gates
        elif self.affinity == "sinkhorn":
            dispatch = ops.stop_gradient(
                affinity_lib.sinkhorn(logits, self.sinkhorn_iterations, valid)
            )
        else:
            dispatch = affinity_lib.sparsity_constrained(
                gates, capacity, self.sparse_steps, self.sparse_learning_rate,
                valid=valid,
            )
        # Tokens with non-finite logits rank below every valid token.
        dispatch = ops.where(valid[..., None], dispatch, _INVALID_AFFINITY)
        allocation = expert_choice_allocation(dispatch, gates, capacity)
        if token_mask is not None:
            # A slot an expert could only fill with padding stays empty.
            token = allocation["buffer_token"]  # (G, E, C)
            num_groups = ops.shape(token)[0]
            picked = ops.take_along_axis(
                token_mask, ops.reshape(token, (num_groups, -1)), axis=1
            )
            picked = ops.reshape(picked, ops.shape(token))
            allocation = {
                "buffer_token": ops.where(picked, token, group_size),
                "buffer_weight": ops.where(
                    picked, allocation["buffer_weight"], 0.0
                ),
            }
        metrics = _sparse_metrics(
            allocation["buffer_token"], group_size, self.num_experts, capacity,
            token_mask=token_mask,
        )
        metrics["min_selected_gate"] = ops.min(allocation["buffer_weight"])
        metrics["max_selected_gate"] = ops.max(allocation["buffer_weight"])
        return Routing(capacity=capacity, gates=gates, metrics=metrics, **allocation)

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "affinity": self.affinity,
                "sinkhorn_iterations": self.sinkhorn_iterations,
                "sparse_steps": self.sparse_steps,
                "sparse_learning_rate": self.sparse_learning_rate,
            }
        )
        return config


def _l2_normalize(x, axis):
    """x · rsqrt(Σ x² + 1e-6) along `axis`, as upstream's SoftRouter."""
    return x * ops.rsqrt(ops.sum(ops.square(x), axis=axis, keepdims=True) + 1e-6)


@keras.saving.register_keras_serializable(package="keras_vmoe")
class SoftRouter(Router):
    """Soft MoE router (Puigcerver et al., 2023).

    Tokens and the slot parameters `mu` `(D, E, P)` are L2-normalised over D,
    a learnable scalar `scale` (init 1) multiplies whichever of the two is
    smaller, `logits = einsum("gsd,dep->gsep")`, dispatch weights are a
    softmax over the tokens of a group and combine weights a softmax over
    all E·P slots. No token is ever dropped.

    Args:
        num_experts: int E.
        num_slots: int P, slots per expert. `None` derives it from the group
            size: `round(S·capacity_factor/E)`.
        capacity_factor: float, used when `num_slots` is None.
        noise_std: float, std of the Gaussian noise added to the logits in
            training: `noise_std·N(0, 1)`, not divided by the number of
            experts (upstream `soft_moe/router.py` `add_noise`); 0 by
            default, as upstream.
        mu_initializer: initializer of `mu`.
        **kwargs: base layer arguments.

    Examples:

    >>> router = SoftRouter(num_experts=8, num_slots=2)
    >>> routing = router(keras.random.normal((4, 16, 48)))
    >>> routing.dispatch_weights.shape
    (4, 16, 8, 2)
    """

    def __init__(
        self,
        num_experts,
        num_slots=None,
        capacity_factor=1.0,
        noise_std=0.0,
        mu_initializer="lecun_normal",
        **kwargs,
    ):
        kwargs.pop("capacity", None)
        kwargs.pop("capacity_ceil_or_round", None)
        kwargs.pop("capacity_multiple_of", None)
        kwargs.pop("kernel_initializer", None)
        super().__init__(
            num_experts,
            noise_std=noise_std,
            capacity_factor=capacity_factor if num_slots is None else None,
            capacity=num_slots,
            capacity_ceil_or_round="round",
            capacity_multiple_of=1,
            kernel_initializer=mu_initializer,
            **kwargs,
        )
        self.num_slots = num_slots

    def _validate_capacity_settings(self):
        if self.capacity is None and not (self.capacity_factor and self.capacity_factor > 0):
            raise ValueError(
                "SoftRouter needs `num_slots` (int >= 1) or a positive "
                f"`capacity_factor`. Received: num_slots={self.capacity!r}, "
                f"capacity_factor={self.capacity_factor!r}"
            )
        if self.capacity is not None:
            _check_positive_int("num_slots", self.capacity)

    def build(self, input_shape):
        if self.num_slots is None:
            raise ValueError(
                "SoftRouter weights need a fixed number of slots: set `num_slots` "
                "(the layer cannot know the group size before it is called)."
            )
        self.mu = self.add_weight(
            name="mu",
            shape=(input_shape[-1], self.num_experts, self.num_slots),
            initializer=self.kernel_initializer,
        )
        self.scale = self.add_weight(name="scale", shape=(), initializer="ones")

    @property
    def effective_noise_std(self):
        # upstream vmoe/projects/soft_moe/router.py `SoftRouter.add_noise`:
        # `logits + self.noise_std * normal` (no 1/E, unlike the sparse
        # routers).
        return self.noise_std

    def route(self, x, training=False, token_mask=None):
        if token_mask is not None:
            raise ValueError(
                "SoftRouter routes every example as its own group and never "
                "sees padding; `token_mask` must be None."
            )
        x = ops.cast(x, "float32")
        mu = ops.cast(self.mu, "float32")
        scale = ops.cast(self.scale, "float32")
        x_norm = _l2_normalize(x, axis=-1)  # (G, S, D)
        mu_norm = _l2_normalize(mu, axis=0)  # (D, E, P)
        x_size = math.prod(x.shape)
        if x_size < math.prod(mu.shape):
            x_norm = x_norm * scale
        else:
            mu_norm = mu_norm * scale
        logits = ops.einsum("gsd,dep->gsep", x_norm, mu_norm)  # (G, S, E, P)
        logits = self.add_noise(logits, training)
        num_groups, group_size, num_experts, num_slots = ops.shape(logits)
        dispatch = ops.softmax(logits, axis=1)  # over tokens
        combine = ops.reshape(
            ops.softmax(
                ops.reshape(logits, (num_groups, group_size, num_experts * num_slots)),
                axis=-1,
            ),
            (num_groups, group_size, num_experts, num_slots),
        )  # over all slots
        metrics = {
            "dispatch_weights_max_mean": ops.mean(ops.max(dispatch, axis=1)),
            "combine_weights_max_mean": ops.mean(ops.max(combine, axis=(2, 3))),
        }
        return Routing(
            capacity=num_slots,
            dispatch_weights=dispatch,
            combine_weights=combine,
            metrics=metrics,
        )

    def get_config(self):
        config = keras.layers.Layer.get_config(self)
        config.update(
            {
                "num_experts": self.num_experts,
                "num_slots": self.num_slots,
                "capacity_factor": self.capacity_factor,
                "noise_std": self.noise_std,
                "mu_initializer": keras.initializers.serialize(self.kernel_initializer),
            }
        )
        return config


ROUTERS = {
    "token_choice": (TokenChoiceRouter, {"affinity": "softmax"}),
    "softmax_token_choice": (TokenChoiceRouter, {"affinity": "softmax"}),
    "sinkhorn_token_choice": (TokenChoiceRouter, {"affinity": "sinkhorn"}),
    "expert_choice": (ExpertChoiceRouter, {"affinity": "softmax"}),
    "softmax_expert_choice": (ExpertChoiceRouter, {"affinity": "softmax"}),
    "sinkhorn_expert_choice": (ExpertChoiceRouter, {"affinity": "sinkhorn"}),
    "sparse_expert_choice": (ExpertChoiceRouter, {"affinity": "sparse"}),
    "soft": (SoftRouter, {}),
}


def check_router(router, expected=None):
    """Returns `router` if it is a router instance, else raises a `TypeError`.

    Args:
        router: the object to check.
        expected: the required `Router` subclass (default `Router`).

    Returns:
        `router`.
    """
    expected = expected or Router
    if not isinstance(router, expected):
        raise TypeError(
            f"`router` must be a router name, a dict {{'name': ..., **kwargs}} "
            f"or a {expected.__name__} instance. Valid names: {sorted(ROUTERS)}; "
            "router classes: TokenChoiceRouter, ExpertChoiceRouter, "
            "PartitionedTokenChoiceRouter, SoftRouter. "
            f"Received: router={router!r} (type {type(router).__name__})"
        )
    return router


def get_router(router, num_experts, name="router", dtype=None):
    """Builds a sparse router from a name, a dict or a `Router` instance.

    Args:
        router: a `Router`, one of the names in `ROUTERS`, a dict
            `{"name": <one of ROUTERS>, **kwargs}`, or a Keras serialized
            router config (with `"class_name"`).
        num_experts: int E, passed to routers built from names.
        name: name of the built router layer.
        dtype: dtype policy of the built router.

    Returns:
        A `Router`.
    """
    if isinstance(router, dict) and "class_name" in router:
        router = check_router(keras.saving.deserialize_keras_object(router))
    if isinstance(router, Router):
        if router.num_experts != num_experts:
            raise ValueError(
                f"The router has num_experts={router.num_experts} but the layer "
                f"has num_experts={num_experts}."
            )
        return router
    kwargs = {}
    if isinstance(router, dict):
        kwargs = dict(router)
        router = kwargs.pop("name", "token_choice")
    if not isinstance(router, str):
        check_router(router)
    if router not in ROUTERS:
        raise ValueError(
            f"Unknown router {router!r}. Valid names: {sorted(ROUTERS)}."
        )
    cls, defaults = ROUTERS[router]
    return cls(num_experts=num_experts, **{**defaults, **kwargs}, name=name, dtype=dtype)
