"""Token Choice with top-K gates renormalised to sum to one per token.

For sparse upcycling (`upcycle(..., renormalize_gates=True)`): an upcycled
model then starts at the dense model's function.
"""

import keras
from keras import ops

from keras_vmoe.layers.routing.token_choice import TokenChoiceRouter


@keras.saving.register_keras_serializable(package="keras_vmoe")
class RenormalizedTokenChoiceRouter(TokenChoiceRouter):
    """`TokenChoiceRouter` whose combine weights are `g_k / sum_j g_j`.

    The K selected gates are divided by their sum (kept or dropped); the
    rest is `TokenChoiceRouter`'s.

    Args:
        **kwargs: `TokenChoiceRouter` arguments.

    Examples:

    >>> router = RenormalizedTokenChoiceRouter(num_experts=4,
    ...                                        num_selected_experts=2)
    >>> routing = router(keras.random.normal((1, 16, 8)))
    >>> routing.token_weight.shape
    (1, 16, 2)
    """

    def make_routing(self, allocation, capacity, group_size, gates, aux,
                     token_mask=None):
        allocation = dict(allocation)
        selected = ops.take_along_axis(
            ops.cast(gates, "float32"), allocation["token_expert"], axis=-1
        )  # (G, S, K)
        total = ops.maximum(ops.sum(selected, axis=-1), 1e-9)  # (G, S)
        weight = allocation["token_weight"]
        allocation["token_weight"] = ops.cast(
            ops.cast(weight, "float32") / total[..., None], weight.dtype
        )
        # Slot weights: the empty-slot index S reads a padding 1.
        padded = ops.concatenate([total, ops.ones_like(total[:, :1])], axis=1)
        buffer_token = allocation["buffer_token"]  # (G, E, C)
        g, e, c = ops.shape(buffer_token)
        slot_total = ops.reshape(
            ops.take_along_axis(padded, ops.reshape(buffer_token, (g, e * c)), axis=1),
            (g, e, c),
        )
        buffer_weight = allocation["buffer_weight"]
        allocation["buffer_weight"] = ops.cast(
            ops.cast(buffer_weight, "float32") / slot_total, buffer_weight.dtype
        )
        return super().make_routing(
            allocation, capacity, group_size, gates, aux, token_mask
        )
