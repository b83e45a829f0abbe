"""Token Choice routers (V-MoE, and E³'s per-member variant).

Axis letters: G groups, S tokens per group, D hidden size, E experts,
C capacity, K choices per token, N partitions, T' = S/N.
"""

import keras
from keras import ops

from keras_vmoe.layers import affinity as affinity_lib
from keras_vmoe.layers import losses as losses_lib
from keras_vmoe.layers.allocation import token_choice_allocation
from keras_vmoe.layers.capacity import validate_real
from keras_vmoe.layers.routing.base import MAX_ITERATIONS
from keras_vmoe.layers.routing.base import Deferred
from keras_vmoe.layers.routing.base import Router
from keras_vmoe.layers.routing.base import Routing
from keras_vmoe.layers.routing.base import Setting
from keras_vmoe.layers.routing.base import and_mask
from keras_vmoe.layers.routing.base import finite_logits
from keras_vmoe.layers.routing.base import resolve
from keras_vmoe.layers.routing.base import sparse_metrics
from keras_vmoe.utils.validation import check_int
from keras_vmoe.utils.validation import check_one_of


@keras.saving.register_keras_serializable(package="keras_vmoe")
class TokenChoiceRouter(Router):
    """Token Choice router: each token picks its top-K experts (V-MoE).

    `affinity="softmax"` is upstream's `NoisyTopExpertsPerItemRouter`; with
    `"sinkhorn"` the choices come from the Sinkhorn plan and the combine
    weights from the clean softmax.

    Args:
        num_experts: int, number of experts E.
        num_selected_experts: int K, experts per token (1 <= K <= E).
        affinity: `"softmax"` or `"sinkhorn"`.
        batch_priority: bool, use Batch Prioritized Routing.
        importance_loss_weight: float >= 0, weight of the importance loss.
            `None`: 0.005 for softmax, 0 for Sinkhorn (as upstream).
        load_loss_weight: float >= 0, weight of the load loss (noisy
            training only). `None`: 0.005 for softmax, 0 for Sinkhorn.
        gshard_loss_weight: float >= 0, weight of the GShard loss.
        sinkhorn_iterations: int, 1 to `MAX_ITERATIONS`.
        **kwargs: `Router` arguments.

    Examples:

    >>> router = TokenChoiceRouter(num_experts=8, num_selected_experts=2,
    ...                            capacity_factor=1.05)
    >>> routing = router(keras.random.normal((2, 400, 32)))
    >>> routing.buffer_token.shape  # capacity ceil(400*2*1.05/8) -> 108
    (2, 8, 108)
    """

    DEFAULT_BALANCE_LOSS_WEIGHT = {"softmax": 0.005, "sinkhorn": 0.0}
    importance_loss_weight = Setting(validate_real, allow_minimum=True)
    load_loss_weight = Setting(validate_real, allow_minimum=True)
    gshard_loss_weight = Setting(validate_real, allow_minimum=True)
    sinkhorn_iterations = Setting(check_int, maximum=MAX_ITERATIONS)

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
        self.affinity = check_one_of(affinity, "affinity", ("softmax", "sinkhorn"))
        self.num_selected_experts = num_selected_experts
        self.batch_priority = batch_priority
        default_weight = self.DEFAULT_BALANCE_LOSS_WEIGHT[affinity]
        self.importance_loss_weight = (default_weight if importance_loss_weight is None
                                       else importance_loss_weight)
        self.load_loss_weight = (default_weight if load_loss_weight is None
                                 else load_loss_weight)
        self.gshard_loss_weight = gshard_loss_weight
        self.sinkhorn_iterations = sinkhorn_iterations

    @property
    def num_selected_experts(self):
        return self._num_selected_experts

    @num_selected_experts.setter
    def num_selected_experts(self, value):
        self._num_selected_experts = check_int(
            value, "num_selected_experts", maximum=self.experts_per_choice_set)

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
            # As upstream: combine uses the clean softmax even with noise.
            combine_gates = gates_clean
        allocation = token_choice_allocation(
            dispatch_gates, combine_gates, self.num_selected_experts, capacity,
            self.batch_priority, valid=valid,
        )
        aux = Deferred(lambda: self.auxiliary_losses(
            logits, logits_noisy, gates_clean, gates, token_mask
        ))
        return self.make_routing(
            allocation, capacity, group_size, combine_gates, aux, token_mask
        )

    def make_routing(self, allocation, capacity, group_size, gates, aux,
                     token_mask=None):
        """Wraps an allocation and its (maybe `Deferred`) losses in a `Routing`."""

        def metrics():
            kept = allocation["token_slot"] < capacity
            return sparse_metrics(
                allocation["buffer_token"], group_size, self.num_experts, capacity,
                kept, token_mask,
            )

        loss = Deferred(lambda: self.weighted_auxiliary_loss(aux))
        return Routing(capacity=capacity, gates=gates, auxiliary_losses=aux,
                       auxiliary_loss=loss, metrics=Deferred(metrics), **allocation)

    def auxiliary_losses(self, logits, logits_noisy, gates_clean, gates,
                         token_mask=None):
        """Unweighted losses, one value per group; padding tokens count in none."""
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
        """The weighted sum of `aux` (maybe `Deferred`); 0.0 when every weight is 0."""
        weights = {"importance_loss": self.importance_loss_weight,
                   "load_loss": self.load_loss_weight,
                   "gshard_loss": self.gshard_loss_weight}
        total = 0.0
        if not any(weight > 0 for weight in weights.values()):
            return total
        for name, value in resolve(aux).items():
            if weights.get(name, 0.0) > 0:
                total = total + weights[name] * ops.mean(value)
        return total

    def get_config(self):
        config = super().get_config()
        config.update({"num_selected_experts": self.num_selected_experts, "affinity": self.affinity,
                       "batch_priority": self.batch_priority,
                       "importance_loss_weight": self.importance_loss_weight,
                       "load_loss_weight": self.load_loss_weight,
                       "gshard_loss_weight": self.gshard_loss_weight,
                       "sinkhorn_iterations": self.sinkhorn_iterations})
        return config


@keras.saving.register_keras_serializable(package="keras_vmoe")
class PartitionedTokenChoiceRouter(TokenChoiceRouter):
    """Token Choice router of E³: one router slice per ensemble member.

    Member n (tokens interleaved by member, member index fastest) chooses
    among experts block n of E/N; capacity is shared by the whole group. The
    noise std is `noise_std / (E/N)` and the losses are per member, as
    upstream's `NoisyTopExpertsPerItemEnsembleRouter`. Kernel `(D, N, E/N)`.

    Args:
        num_experts: int E, divisible by `num_partitions`.
        num_partitions: int N, ensemble members.
        **kwargs: `TokenChoiceRouter` arguments.
    """

    def __init__(self, num_experts, num_partitions=1, **kwargs):
        num_partitions = check_int(num_partitions, "num_partitions")
        if num_experts % num_partitions:
            raise ValueError(
                f"`num_experts` ({num_experts}) must be divisible by "
                f"`num_partitions` ({num_partitions}); valid values of "
                f"num_partitions divide {num_experts}.")
        self.num_partitions = num_partitions
        super().__init__(num_experts, **kwargs)
        if self.affinity != "softmax":
            raise ValueError(
                "PartitionedTokenChoiceRouter supports affinity='softmax' only. "
                f"Received: affinity={self.affinity!r}")

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
            raise ValueError(f"The group size ({group_size}) must be divisible by "
                             f"the number of partitions ({n}).")
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
        valid = and_mask(valid, token_mask)
        logits_noisy = self.add_noise(logits, training)
        gates_clean = ops.softmax(logits, axis=-1)
        noisy = logits_noisy is not logits
        gates = ops.softmax(logits_noisy, axis=-1) if noisy else gates_clean
        full_gates = self._block_diagonal(gates)  # (G, S, E)
        allocation = token_choice_allocation(
            full_gates, full_gates, self.num_selected_experts, capacity,
            self.batch_priority, valid=valid,
        )

        def per_member(t):  # (G, T', N, E/N) -> (G·N, T', E/N)
            num_groups, tokens, n, per = ops.shape(t)
            return ops.reshape(ops.transpose(t, (0, 2, 1, 3)), (num_groups * n, tokens, per))

        member_logits = per_member(logits)
        member_noisy = per_member(logits_noisy) if noisy else member_logits
        member_mask = None
        if token_mask is not None:  # (G, S) -> (G·N, T')
            member_mask = per_member(
                ops.reshape(token_mask, (num_groups, tokens, n, 1))
            )[..., 0]

        def aux():
            losses = self.auxiliary_losses(
                member_logits, member_noisy, per_member(gates_clean),
                per_member(gates), member_mask,
            )
            return {k: ops.reshape(v, (num_groups, self.num_partitions))
                    for k, v in losses.items()}

        return self.make_routing(
            allocation, capacity, group_size, full_gates, Deferred(aux), token_mask
        )

    def get_config(self):
        config = super().get_config()
        config["num_partitions"] = self.num_partitions
        return config
