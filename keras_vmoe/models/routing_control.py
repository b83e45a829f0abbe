"""Changing the routing of a backbone's MoE layers, keeping the weights; the
compiled functions of the backbone and of the tasks registered with
`register_routing_dependent` are reset.
"""

import weakref

from keras_vmoe.models.size_estimate import check_routing_group
from keras_vmoe.models.size_estimate import in_abstract_build
from keras_vmoe.utils.validation import check_group
from keras_vmoe.utils.validation import check_one_of
from keras_vmoe.utils.validation import plain
from keras_vmoe.utils.validation import python_scalar

PHASES = ("both", "train", "eval")


def _dependents(backbone):
    # Untracked: a WeakSet of the task models wrapping this backbone.
    if "_routing_dependents" not in backbone.__dict__:
        object.__setattr__(backbone, "_routing_dependents", weakref.WeakSet())
    return backbone.__dict__["_routing_dependents"]


def compiled_function_cache(backbone):
    """The backbone's untracked cache of jitted analysis functions."""
    if "_routing_functions" not in backbone.__dict__:
        object.__setattr__(backbone, "_routing_functions", {})
    return backbone.__dict__["_routing_functions"]


def register_routing_dependent(backbone, model):
    """Makes `reset_compiled_functions(backbone)` reset `model` too."""
    _dependents(backbone).add(model)


def reset_compiled_functions(backbone):
    """Forgets the traced train/test/predict functions (of tasks too)."""
    for model in [backbone, *list(_dependents(backbone))]:
        model.train_function = model.test_function = model.predict_function = None
    compiled_function_cache(backbone).clear()


def _requested_settings(backbone, layers, requested, phase):
    """Checks `set_routing`'s settings on every layer before any changes."""
    if backbone.moe_type == "soft":
        raise ValueError(
            "Soft MoE layers have a fixed routing (every slot mixes all the "
            "tokens of one image); `set_routing` cannot change "
            f"{sorted(requested)}. Received: {requested}"
        )
    if "group_size" in requested or "images_per_group" in requested:
        # E³ groups count the N copies of each image; "all" is one group.
        requested["group_size"], requested["images_per_group"] = check_group(
            requested.get("group_size"),
            requested.get("images_per_group"),
            backbone.ensemble_size,
        )
    planned = [routing for layer in layers
               for routing in layer.planned_routing(phase, **requested)]
    if "group_size" in requested:
        check_routing_group(
            backbone.get_config(), requested["group_size"], requested["images_per_group"],
            max(routing.num_selected_experts or 1 for routing in planned),
            check_memory=not in_abstract_build())
    return requested


def set_routing(backbone, phase="both", **settings):
    """See `VisionTransformerBackbone.set_routing`; the `moe` configs of the
    backbone and its blocks record the new settings."""
    requested = {name: python_scalar(value) for name, value in settings.items()
                 if value is not None}
    layers = backbone.get_moe_layers()
    if not layers:
        raise ValueError(
            "This backbone has no MoE layers (moe_layers=()); there is no "
            "routing to set."
        )
    check_one_of(phase, "phase", PHASES)
    if not requested:
        return
    requested = _requested_settings(backbone, layers, requested, phase)
    for layer in layers:
        layer.set_routing(phase=phase, **requested)

    layer = layers[0]
    moe = plain(backbone.moe)
    router_config = dict(moe.get("router") or {})
    for name in ("num_selected_experts", "capacity_factor", "batch_priority"):
        if name in requested:
            router_config[name] = getattr(layer, name)
    if "capacity_factor" in requested and phase != "eval":
        router_config.pop("capacity", None)
    moe["router"] = router_config
    for name in ("group_size", "images_per_group"):
        moe[name] = getattr(layer, name)
    eval_routing = layer.eval_routing
    if eval_routing:
        moe["eval_routing"] = eval_routing
    else:
        moe.pop("eval_routing", None)
    backbone.moe = moe
    for index in backbone.moe_layers:
        backbone.get_layer(f"encoderblock_{index}").moe = plain(moe)
    reset_compiled_functions(backbone)
