"""Routers: map a group of tokens `(G, S, D)` to a `Routing`; the name registry.

Routers are registered with Keras as `keras_vmoe>ClassName` (no module path),
so saved models load whatever module holds the class.
"""

import keras

from keras_vmoe.layers.routing.base import MAX_ITERATIONS
from keras_vmoe.layers.routing.base import Router
from keras_vmoe.layers.routing.base import Routing
from keras_vmoe.layers.routing.base import finite_logits
from keras_vmoe.layers.routing.expert_choice import ExpertChoiceRouter
from keras_vmoe.layers.routing.renormalized import RenormalizedTokenChoiceRouter
from keras_vmoe.layers.routing.soft import SoftRouter
from keras_vmoe.layers.routing.token_choice import PartitionedTokenChoiceRouter
from keras_vmoe.layers.routing.token_choice import TokenChoiceRouter

__all__ = [
    "MAX_ITERATIONS",
    "ROUTERS",
    "RenormalizedTokenChoiceRouter",
    "ExpertChoiceRouter",
    "PartitionedTokenChoiceRouter",
    "Router",
    "Routing",
    "SoftRouter",
    "TokenChoiceRouter",
    "check_router",
    "finite_logits",
    "get_router",
]

ROUTERS = {
    "token_choice": (TokenChoiceRouter, {"affinity": "softmax"}),
    "softmax_token_choice": (TokenChoiceRouter, {"affinity": "softmax"}),
    "sinkhorn_token_choice": (TokenChoiceRouter, {"affinity": "sinkhorn"}),
    "expert_choice": (ExpertChoiceRouter, {"affinity": "softmax"}),
    "softmax_expert_choice": (ExpertChoiceRouter, {"affinity": "softmax"}),
    "sinkhorn_expert_choice": (ExpertChoiceRouter, {"affinity": "sinkhorn"}),
    "sparse_expert_choice": (ExpertChoiceRouter, {"affinity": "sparse"}),
    "soft": (SoftRouter, {}),
    # Gates renormalized over the K choices (sparse upcycling).
    "renormalized_token_choice": (RenormalizedTokenChoiceRouter, {"affinity": "softmax"}),
}


def check_router(router, expected=None):
    """`router` if it is an `expected` (default `Router`), else a `TypeError`."""
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
    """A `Router` from an instance, a name in `ROUTERS`, a dict
    `{"name": ..., **kwargs}` or a Keras serialized config, with E
    `num_experts`, the layer name `name` and the dtype policy `dtype`."""
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
        raise ValueError(f"Unknown router {router!r}. Valid names: {sorted(ROUTERS)}.")
    cls, defaults = ROUTERS[router]
    return cls(num_experts=num_experts, **{**defaults, **kwargs}, name=name, dtype=dtype)
