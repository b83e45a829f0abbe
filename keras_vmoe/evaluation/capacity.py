"""Accuracy and dropped tokens vs the inference capacity factor (± BPR)."""

import numpy as np

from keras_vmoe.data.labels import check_class_ids
from keras_vmoe.evaluation._batches import get_backbone
from keras_vmoe.evaluation._batches import iterate_batches
from keras_vmoe.evaluation.predictions import has_head
from keras_vmoe.evaluation.predictions import predict_log_probabilities
from keras_vmoe.evaluation.routing_stats import convert_images
from keras_vmoe.utils.validation import plain as _plain

CAPACITY_FACTORS = (0.25, 0.5, 1.0, 1.5, 2.0)


def check_capacity_factors(capacity_factors):
    values = list(np.atleast_1d(capacity_factors)) if capacity_factors is not None else []
    if not values or not all(
        isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool)
        and np.isfinite(v) and v > 0 for v in values
    ):
        raise ValueError(
            "`capacity_factors` must be a non-empty list of finite numbers > 0, "
            f"e.g. {list(CAPACITY_FACTORS)}. Received: {capacity_factors!r}"
        )
    return [float(v) for v in values]


def check_batch_priorities(batch_priorities):
    """`batch_priorities` as a non-empty list of bools, checked."""
    values = (list(batch_priorities)
              if isinstance(batch_priorities, (list, tuple, np.ndarray)) else None)
    if not values or not all(isinstance(v, (bool, np.bool_)) for v in values):
        raise ValueError(
            "`batch_priorities` must be a non-empty list of booleans (Batch "
            "Prioritized Routing off or on), e.g. [False, True]. Received: "
            f"batch_priorities={batch_priorities!r}"
        )
    return [bool(v) for v in values]


def _routing_state(backbone):
    return _plain(backbone.moe), [
        (layer.router.capacity_factor, layer.router.capacity,
         getattr(layer.router, "batch_priority", None), layer.eval_routing)
        for layer in backbone.get_moe_layers()
    ]


def _restore_routing(backbone, state):
    moe, layers = state
    for layer, (factor, capacity, priority, eval_routing) in zip(
            backbone.get_moe_layers(), layers, strict=True):
        layer.router.capacity_factor = factor
        layer.router.capacity = capacity
        layer.eval_routing = eval_routing
        if priority is not None:
            layer.router.batch_priority = priority
    backbone.moe = moe
    for index in backbone.moe_layers:
        backbone.get_layer(f"encoderblock_{index}").moe = _plain(moe)
    backbone.reset_compiled_functions()


def _dropped_fractions(model, backbone, images, labels, batch_size):
    totals, count = {}, 0
    for x, _ in iterate_batches(images, labels, batch_size):
        x = convert_images(model, x)
        metrics = backbone.routing_metrics(x)  # partial groups are padded by the layers
        for name, values in metrics.items():
            if isinstance(values, dict):
                totals[name] = totals.get(name, 0.0) + values["tokens_dropped_fraction"] * len(x)
        count += len(x)
    return {name: total / count for name, total in totals.items()}


def capacity_sweep(model, images, labels=None, capacity_factors=CAPACITY_FACTORS,
                   batch_priorities=(False, True), batch_size=32):
    """Accuracy and dropped tokens at several inference capacity factors.

    Each factor runs with vanilla routing and Batch Prioritized Routing
    (Token Choice routers only); the original routing is restored after.

    Args:
        model: a keras_vmoe task (accuracy needs a head and labels) or a
            backbone (dropped tokens only) with sparse MoE layers.
        images, labels: the data (see `routing_statistics`).
        capacity_factors: inference capacity factors (> 0).
        batch_priorities: non-empty list of booleans, the BPR settings.
        batch_size: int, batch size for array inputs.

    Returns:
        `{"rows": [{"capacity_factor", "batch_priority", "accuracy" (or
        None), "tokens_dropped_fraction" (mean over MoE layers),
        "layers": {block: tokens_dropped_fraction}}, ...]}`.
    """
    capacity_factors = check_capacity_factors(capacity_factors)
    batch_priorities = check_batch_priorities(batch_priorities)
    backbone = get_backbone(model)
    layers = backbone.get_moe_layers()
    if not layers or backbone.moe_type == "soft":
        raise ValueError(
            "The capacity sweep needs sparse MoE layers (V-MoE, E³); this model "
            f"has moe_type={backbone.moe_type!r}."
        )
    has_bpr = hasattr(layers[0].router, "batch_priority")
    if not has_bpr:
        batch_priorities = [False]
    with_accuracy = has_head(model)
    if with_accuracy and labels is not None:
        check_class_ids(labels, model.num_classes, "capacity_sweep")
    state = _routing_state(backbone)
    rows = []
    try:
        for factor in capacity_factors:
            for priority in batch_priorities:
                backbone.set_routing(phase="eval", capacity_factor=factor,  # inference
                                     batch_priority=priority if has_bpr else None)
                accuracy = None
                if with_accuracy:
                    result = predict_log_probabilities(model, images, labels, batch_size)
                    if result["labels"] is not None:
                        predicted = result["log_probabilities"].argmax(-1)
                        accuracy = float(np.mean(predicted == result["labels"]))
                dropped = _dropped_fractions(model, backbone, images, labels, batch_size)
                rows.append({
                    "capacity_factor": factor,
                    "batch_priority": bool(priority),
                    "accuracy": accuracy,
                    "tokens_dropped_fraction": float(np.mean(list(dropped.values()))),
                    "layers": dropped,
                })
    finally:
        _restore_routing(backbone, state)
    return {"rows": rows}
