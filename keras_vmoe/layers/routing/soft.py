"""Soft MoE router: dense dispatch and combine weights, no token dropped."""

import math

import keras
from keras import ops

from keras_vmoe.layers.routing.base import Router
from keras_vmoe.layers.routing.base import Routing
from keras_vmoe.utils.validation import check_int


def _l2_normalize(x, axis):
    """x · rsqrt(Σ x² + 1e-6) along `axis`, as upstream's SoftRouter."""
    return x * ops.rsqrt(ops.sum(ops.square(x), axis=axis, keepdims=True) + 1e-6)


@keras.saving.register_keras_serializable(package="keras_vmoe")
class SoftRouter(Router):
    """Soft MoE router (Puigcerver et al., 2023).

    Tokens and slot parameters `mu` `(D, E, P)` are L2-normalised, a learned
    `scale` multiplies the smaller; dispatch is a softmax over the tokens of
    a group, combine a softmax over all E·P slots.

    Args:
        num_experts: int E.
        num_slots: int P, slots per expert; `None`: `round(S·capacity_factor/E)`.
        capacity_factor: float, used when `num_slots` is None.
        noise_std: float, std of the training logit noise (not divided by E).
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
        for key in ("capacity", "capacity_ceil_or_round", "capacity_multiple_of",
                    "kernel_initializer"):
            kwargs.pop(key, None)
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
            check_int(self.capacity, "num_slots")

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
        if None not in x.shape:
            if math.prod(x.shape) < math.prod(mu.shape):
                x_norm = x_norm * scale
            else:
                mu_norm = mu_norm * scale
            logits = ops.einsum("gsd,dep->gsep", x_norm, mu_norm)  # (G, S, E, P)
        else:  # a symbolic batch size: decide at run time
            logits = ops.cond(
                math.prod(ops.shape(x)) < math.prod(mu.shape),
                lambda: ops.einsum("gsd,dep->gsep", x_norm * scale, mu_norm),
                lambda: ops.einsum("gsd,dep->gsep", x_norm, mu_norm * scale),
            )
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
        return Routing(capacity=num_slots, dispatch_weights=dispatch,
                       combine_weights=combine, metrics=metrics)

    def get_config(self):
        config = keras.layers.Layer.get_config(self)
        config.update({"num_experts": self.num_experts, "num_slots": self.num_slots,
                       "capacity_factor": self.capacity_factor, "noise_std": self.noise_std,
                       "mu_initializer": keras.initializers.serialize(self.kernel_initializer)})
        return config
