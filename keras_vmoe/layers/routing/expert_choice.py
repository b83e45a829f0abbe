"""Expert Choice router: each expert picks its top-C tokens."""

import keras
from keras import ops

from keras_vmoe.layers import affinity as affinity_lib
from keras_vmoe.layers.allocation import expert_choice_allocation
from keras_vmoe.layers.capacity import validate_real
from keras_vmoe.layers.routing.base import MAX_ITERATIONS
from keras_vmoe.layers.routing.base import Deferred
from keras_vmoe.layers.routing.base import Router
from keras_vmoe.layers.routing.base import Routing
from keras_vmoe.layers.routing.base import Setting
from keras_vmoe.layers.routing.base import sparse_metrics
from keras_vmoe.utils.validation import check_int
from keras_vmoe.utils.validation import check_one_of

# Below every gate or plan value: tokens with non-finite logits never win a slot.
_INVALID_AFFINITY = -1.0


@keras.saving.register_keras_serializable(package="keras_vmoe")
class ExpertChoiceRouter(Router):
    """Expert Choice router: each expert picks its top-C tokens.

    `affinity="softmax"` is upstream's `NoisyTopItemsPerExpertRouter`;
    `"sinkhorn"` and `"sparse"` (experimental k-sparse OT, no training noise)
    pick tokens from a transport plan and combine with the softmax gates.
    Capacity is `ceil(S·cf/E)`, at most S; there is no auxiliary loss.

    Args:
        num_experts: int, number of experts E.
        affinity: `"softmax"`, `"sinkhorn"` or `"sparse"`.
        sinkhorn_iterations: int, 1 to `MAX_ITERATIONS`.
        sparse_steps: int, Adam steps of the sparse solver (`MAX_ITERATIONS`).
        sparse_learning_rate: float > 0, its learning rate.
        **kwargs: `Router` arguments.

    Examples:

    >>> router = ExpertChoiceRouter(num_experts=4, capacity_factor=1.0)
    >>> routing = router(keras.random.normal((2, 34, 16)))
    >>> routing.buffer_token.shape  # ceil(34/4)=9 -> multiple of 4 -> 12
    (2, 4, 12)
    """

    AFFINITIES = ("softmax", "sinkhorn", "sparse")
    sinkhorn_iterations = Setting(check_int, maximum=MAX_ITERATIONS)
    sparse_steps = Setting(check_int, maximum=MAX_ITERATIONS)
    sparse_learning_rate = Setting(validate_real)

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
        self.affinity = check_one_of(affinity, "affinity", self.AFFINITIES)
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
                affinity_lib.sinkhorn(logits, self.sinkhorn_iterations, valid))
        else:
            dispatch = affinity_lib.sparsity_constrained(
                gates, capacity, self.sparse_steps, self.sparse_learning_rate,
                valid=valid)
        dispatch = ops.where(valid[..., None], dispatch, _INVALID_AFFINITY)
        allocation = expert_choice_allocation(dispatch, gates, capacity)
        if token_mask is not None:
            # A slot an expert could only fill with padding stays empty.
            token = allocation["buffer_token"]  # (G, E, C)
            num_groups = ops.shape(token)[0]
            picked = ops.take_along_axis(
                token_mask, ops.reshape(token, (num_groups, -1)), axis=1)
            picked = ops.reshape(picked, ops.shape(token))
            allocation = {
                "buffer_token": ops.where(picked, token, group_size),
                "buffer_weight": ops.where(picked, allocation["buffer_weight"], 0.0)}

        def metrics():
            values = sparse_metrics(
                allocation["buffer_token"], group_size, self.num_experts, capacity,
                token_mask=token_mask,
            )
            values["min_selected_gate"] = ops.min(allocation["buffer_weight"])
            values["max_selected_gate"] = ops.max(allocation["buffer_weight"])
            return values

        return Routing(capacity=capacity, gates=gates, metrics=Deferred(metrics),
                       **allocation)

    def get_config(self):
        config = super().get_config()
        config.update({"affinity": self.affinity, "sinkhorn_iterations": self.sinkhorn_iterations,
                       "sparse_steps": self.sparse_steps,
                       "sparse_learning_rate": self.sparse_learning_rate})
        return config
