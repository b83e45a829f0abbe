"""`PartitionedMoE`: the E³ (efficient ensemble) MoE layer."""

import keras
from keras import ops

from keras_vmoe.layers import symbolic_sizes
from keras_vmoe.layers.moe_layer import MoeLayer
from keras_vmoe.layers.routing import PartitionedTokenChoiceRouter
from keras_vmoe.layers.routing import check_router
from keras_vmoe.utils.validation import check_int


@keras.saving.register_keras_serializable(package="keras_vmoe")
class PartitionedMoE(MoeLayer):
    """Sparse MoE whose experts are split between ensemble members (E³).

    The batch holds N copies of every example, member index fastest
    (`tile_for_ensemble`); member n routes to experts `[n·E/N, (n+1)·E/N)`
    through its own router slice (`PartitionedTokenChoiceRouter`).

    Args:
        num_experts: int E, divisible by `num_partitions`.
        mlp_dim: int M.
        num_partitions: int N, ensemble members.
        router: dict of `PartitionedTokenChoiceRouter` arguments or a router.
        group_size: int S (counting the N copies), divisible by N.
        images_per_group: int, images routed jointly (with their N copies).
        **kwargs: other `MoeLayer` arguments.

    Examples:

    >>> layer = PartitionedMoE(num_experts=4, mlp_dim=96, num_partitions=2,
    ...                        router={"capacity_factor": 1.5})
    >>> x = tile_for_ensemble(keras.random.normal((2, 17, 48)), 2)
    >>> layer(x).shape
    (4, 17, 48)
    """

    def __init__(self, num_experts, mlp_dim=None, num_partitions=1, router=None,
                 group_size=None, **kwargs):
        num_partitions = check_int(num_partitions, "num_partitions")
        if num_experts % num_partitions:
            raise ValueError(
                f"`num_experts` ({num_experts}) must be divisible by "
                f"`num_partitions` ({num_partitions})."
            )
        self.num_partitions = num_partitions
        super().__init__(num_experts, mlp_dim, router=router or {},
                         group_size=group_size, **kwargs)

    def _make_router(self, router):
        if isinstance(router, dict) and "class_name" in router:
            router = keras.saving.deserialize_keras_object(router)
            check_router(router, PartitionedTokenChoiceRouter)
        if isinstance(router, PartitionedTokenChoiceRouter):
            for name in ("num_experts", "num_partitions"):
                if getattr(router, name) != getattr(self, name):
                    raise ValueError(
                        f"The router has {name}={getattr(router, name)} but the "
                        f"PartitionedMoE layer has {name}={getattr(self, name)}; "
                        "they must be equal (each member owns its own experts).")
            return router
        if not isinstance(router, dict):
            check_router(router, PartitionedTokenChoiceRouter)
        kwargs = {k: v for k, v in router.items()
                  if k not in ("name", "num_partitions")}
        return PartitionedTokenChoiceRouter(
            self.num_experts, num_partitions=self.num_partitions, name="router",
            dtype=self.dtype_policy, **kwargs)

    def _check_routing(self, settings, where):
        """A group of tokens also holds every member's copies."""
        if settings.group_size is not None and settings.group_size % self.num_partitions:
            raise ValueError(
                f"`group_size` ({where}) must be divisible by num_partitions="
                f"{self.num_partitions}. Received: group_size={settings.group_size}"
            )
        return super()._check_routing(settings, where)

    def group_tokens(self, inputs):
        """(B·N, T, D) -> (B, T, N, D) -> (G, S, D)."""
        batch_members, tokens, hidden = ops.shape(inputs)
        n = self.num_partitions
        if symbolic_sizes.is_static(batch_members) and batch_members % n:
            raise ValueError(
                f"The batch ({batch_members}) must hold num_partitions={n} copies "
                "of every example (use `tile_for_ensemble`)."
            )
        x = ops.reshape(inputs, (batch_members // n, n, tokens, hidden))
        x = ops.transpose(x, (0, 2, 1, 3))  # (B, T, N, D)
        return super().group_tokens(ops.reshape(x, (batch_members // n, tokens * n, hidden)))

    def ungroup_tokens(self, outputs, input_shape):
        batch_members, tokens, hidden = input_shape
        n = self.num_partitions
        y = self._unpad(outputs, batch_members * tokens)
        y = ops.reshape(y, (batch_members // n, tokens, n, hidden))
        return ops.reshape(ops.transpose(y, (0, 2, 1, 3)), input_shape)

    def get_config(self):
        config = super().get_config()
        config["num_partitions"] = self.num_partitions
        return config


def tile_for_ensemble(x, num_members):
    """`(B, ...) -> (B·N, ...)`, each example repeated (upstream's `jnp.repeat`).

    Args:
        x: a batch `(B, ...)`.
        num_members: int N, the copies of each example.
    """
    return ops.repeat(x, num_members, axis=0)
