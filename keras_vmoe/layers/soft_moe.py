"""`SoftMoE`: every slot is a soft mixture of the tokens of one example."""

import keras

from keras_vmoe.layers.moe_layer import MoeLayer
from keras_vmoe.layers.phase_routing import PhaseRouting
from keras_vmoe.layers.routing import SoftRouter


@keras.saving.register_keras_serializable(package="keras_vmoe")
class SoftMoE(MoeLayer):
    """Soft Mixture-of-Experts layer (Puigcerver et al., 2023).

    Each example is its own group and no token is dropped.

    Args:
        num_experts: int E.
        mlp_dim: int M, expert MLP size.
        num_slots: int P, slots per expert; `None`: `round(T·capacity_factor/E)`.
        capacity_factor: float, used when `num_slots` is None.
        noise_std: float, std of the training logit noise.
        dropout_rate: float, expert dropout.
        identical_init: bool, experts start identical (upstream default).
        bfloat16_dispatch: bool, round slots and expert outputs to bfloat16
            (default True, as upstream).
        mu_initializer: initializer of `mu`.
        kernel_initializer: initializer of one expert's kernels.
        bias_initializer: initializer of one expert's biases.
        **kwargs: `MoeLayer` base-layer arguments.

    Examples:

    >>> layer = SoftMoE(num_experts=8, mlp_dim=96, num_slots=2)
    >>> layer(keras.random.normal((4, 16, 48))).shape
    (4, 16, 48)
    """

    def __init__(
        self,
        num_experts,
        mlp_dim=None,
        num_slots=None,
        capacity_factor=1.0,
        noise_std=0.0,
        dropout_rate=0.0,
        identical_init=True,
        bfloat16_dispatch=True,
        mu_initializer="lecun_normal",
        kernel_initializer="glorot_uniform",
        bias_initializer=None,
        **kwargs,
    ):
        for key in ("router", "group_size", "images_per_group", "eval_routing",
                    "dispatch"):
            kwargs.pop(key, None)
        self.num_slots = num_slots
        self.soft_capacity_factor = capacity_factor
        self.noise_std = noise_std
        self.mu_initializer = keras.initializers.get(mu_initializer)
        super().__init__(
            num_experts, mlp_dim, router=None, dropout_rate=dropout_rate,
            identical_init=identical_init, bfloat16_dispatch=bfloat16_dispatch,
            kernel_initializer=kernel_initializer, bias_initializer=bias_initializer,
            **kwargs)

    def _make_router(self, router):
        return SoftRouter(
            self.num_experts, num_slots=self.num_slots,
            capacity_factor=self.soft_capacity_factor, noise_std=self.noise_std,
            mu_initializer=self.mu_initializer, name="router", dtype=self.dtype_policy)

    def build(self, input_shape):
        if len(input_shape) == 3 and self.router.num_slots is None:
            tokens = input_shape[1]
            if tokens is None:
                raise ValueError("SoftMoE with num_slots=None needs a known number "
                                 "of tokens at build time.")
            slots = round(tokens * self.soft_capacity_factor / self.num_experts)
            if slots < 1:
                raise ValueError(
                    f"round(tokens={tokens} * capacity_factor="
                    f"{self.soft_capacity_factor} / num_experts={self.num_experts}) "
                    "gives 0 slots per expert; set `num_slots` or a larger "
                    "capacity_factor.")
            self.router.num_slots = slots
            self.router.capacity = slots
        super().build(input_shape)

    @property
    def train_routing(self):
        """Each example is its own group; the slots are fixed."""
        return PhaseRouting(capacity_factor=self.router.capacity_factor,
                            images_per_group=1)

    def _set_train_routing(self, settings):
        if settings != self.train_routing:
            raise ValueError(
                "SoftMoE has a fixed routing (each example is its own group); "
                f"it cannot change to {settings.overrides_of(self.train_routing)}."
            )

    @property
    def eval_routing(self):
        return {}

    @eval_routing.setter
    def eval_routing(self, value):
        if value:
            raise ValueError(
                "SoftMoE has a fixed routing; there is no evaluation routing to "
                f"set. Received: eval_routing={value!r}"
            )

    def group_tokens(self, inputs):
        return inputs  # (B, T, D): one group per example.

    @staticmethod
    def padding_mask(grouped_shape, num_tokens):
        """`None`: one group per example never needs padding."""
        return None

    def get_config(self):
        config = super().get_config()
        for key in ("router", "group_size", "images_per_group", "eval_routing",
                    "dispatch"):
            config.pop(key)
        config.update({"num_slots": self.num_slots, "capacity_factor": self.soft_capacity_factor,
                       "noise_std": self.noise_std,
                       "mu_initializer": keras.initializers.serialize(self.mu_initializer)})
        return config
