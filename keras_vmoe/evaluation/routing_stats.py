"""Routing statistics of every MoE layer over a dataset.

Axis letters: B images, N ensemble members, T tokens, E experts, C classes.
"""

import numpy as np

from keras_vmoe.data.labels import check_class_ids
from keras_vmoe.evaluation._batches import get_backbone
from keras_vmoe.evaluation._batches import iterate_batches
from keras_vmoe.utils.validation import check_int


def convert_images(model_or_backbone, images):
    """Applies the task's preprocessor, if it has one, to a NumPy batch."""
    preprocessor = getattr(model_or_backbone, "preprocessor", None)
    if preprocessor is not None:
        images = preprocessor.convert(np.asarray(images))
    return np.asarray(images, dtype="float32")


def _accumulate(totals, assignments, y, batch, members, tokens, num_experts):
    """Adds one batch's `routing_assignments` to the per-layer `totals`."""
    for name, values in assignments.items():
        layer = totals.setdefault(name, {"positions": 0.0, "requested": None,
                                         "dropped_tokens": 0.0, "classes": []})
        processed = values["processed"][: batch * members]  # (B·N, T, E)
        processed = processed.reshape(batch, members, tokens, num_experts)
        layer["positions"] = layer["positions"] + processed.sum(axis=(0, 1)).T
        layer["dropped_tokens"] += float((processed.sum(-1) == 0).sum())
        if "requested" in values:
            requested = values["requested"][: batch * members]
            previous = layer["requested"] if layer["requested"] is not None else 0.0
            layer["requested"] = previous + requested.reshape(-1, num_experts).sum(0)
        if y is not None:
            layer["classes"].append((y, processed.sum(axis=(1, 2))))  # (B, E)
        layer["capacity"] = values["capacity"]


def _layer_statistics(layer, token_slots, members, tokens, num_experts, num_classes,
                      labeled):
    """One layer's entry of `routing_statistics` from its `_accumulate` totals."""
    positions = np.asarray(layer["positions"], dtype="float64")  # (E, T)
    counts = positions.sum(axis=1)
    total = counts.sum()
    entry = {
        "capacity": int(layer["capacity"]),
        "expert_counts": counts.tolist(),
        "expert_load": (counts / total if total else counts).tolist(),
        "tokens_dropped_fraction": layer["dropped_tokens"] / token_slots,
        "expert_position_counts": positions.tolist(),
    }
    if layer["requested"] is not None:
        requested = np.asarray(layer["requested"], dtype="float64")
        entry["requested_counts"] = requested.tolist()
        entry["dropped_assignments_fraction"] = float(
            max(0.0, 1.0 - total / requested.sum()) if requested.sum() else 0.0)
    if labeled:
        per_class = np.zeros((num_experts, num_classes))
        class_tokens = np.zeros(num_classes)
        for y, per_image in layer["classes"]:
            np.add.at(per_class.T, y, per_image)
            np.add.at(class_tokens, y, members * tokens)
        entry["expert_class_counts"] = per_class.tolist()
        entry["class_token_counts"] = class_tokens.tolist()
    return entry


def routing_statistics(model_or_backbone, images, labels=None, batch_size=32,
                       num_classes=None):
    """Per-MoE-layer routing statistics over a dataset.

    Routes every batch (inference routing, no noise) and counts, per MoE
    layer, which experts processed each token.

    Args:
        model_or_backbone: a keras_vmoe task or `VisionTransformerBackbone`
            with MoE layers.
        images: `(B, H, W, C)` array (raw images when the task has a
            preprocessor), or an iterable of batches yielding images or
            `(images, labels)`.
        labels: `(B,)` integer labels for array `images` (optional).
        batch_size: int, batch size for array inputs.
        num_classes: int, columns of the expert × class counts (default:
            the task's `num_classes`, else the largest label + 1).

    Returns:
        A JSON-serialisable dict: `num_images`, `num_tokens`, `grid_size`,
        `has_class_token`, `num_experts`, `ensemble_size`, `num_classes` and
        `layers`, `{"encoderblock_i": {...}}` with `expert_counts` `[E]`,
        `expert_load` `[E]` (fractions), `requested_counts` `[E]` and
        `dropped_assignments_fraction` (Token Choice), `tokens_dropped_fraction`
        (tokens no expert processed), `capacity` (of the last batch),
        `expert_position_counts` `[E][T]` and, with labels,
        `expert_class_counts` `[E][C]` and `class_token_counts` `[C]`. For Soft
        MoE the counts are dispatch weights summed over slots.

    Examples:

    ```python
    import numpy as np
    import keras_vmoe

    model = keras_vmoe.models.ImageClassifier.from_preset(  # tiny and untrained
        "vmoe_s32", load_weights=False, image_size=32, patch_size=16, hidden_dim=32,
        num_heads=2, mlp_dim=64, num_layers=4, num_experts=4, num_classes=10)
    images = np.random.default_rng(0).integers(0, 256, (8, 32, 32, 3), "uint8")
    labels = np.arange(8) % 10
    stats = keras_vmoe.evaluation.routing_statistics(model, images, labels)
    load = stats["layers"]["encoderblock_1"]["expert_load"]   # 4 fractions
    keras_vmoe.evaluation.plot_routing_heatmaps(stats, "routing.png")
    ```
    """
    num_classes = check_int(num_classes, "num_classes", allow_none=True)
    backbone = get_backbone(model_or_backbone)
    moe_layers = backbone.get_moe_layers()
    if not moe_layers:
        raise ValueError(
            "The model has no MoE layers (a dense ViT); there are no routing "
            "statistics."
        )
    num_experts = moe_layers[0].num_experts
    members = backbone.ensemble_size
    tokens = backbone.num_tokens
    totals, class_batches, num_images = {}, [], 0
    for x, y in iterate_batches(images, labels, batch_size):
        x = convert_images(model_or_backbone, x)
        num_images += x.shape[0]
        if y is not None:
            y = np.asarray(y).reshape(-1).astype("int64")
            class_batches.append(y)
        _accumulate(totals, backbone.routing_assignments(x), y, x.shape[0], members,
                    tokens, num_experts)
    if num_images == 0:
        raise ValueError("`images` is empty: there is nothing to route.")
    all_labels = np.concatenate(class_batches) if class_batches else None
    if num_classes is None:
        num_classes = getattr(model_or_backbone, "num_classes", None)
    if num_classes is None and all_labels is not None and all_labels.size:
        num_classes = max(int(all_labels.max()) + 1, 1)  # negative ones still checked
    if all_labels is not None:
        check_class_ids(all_labels, num_classes, "routing_statistics")
    token_slots = num_images * members * tokens
    return {
        "num_images": num_images,
        "num_tokens": tokens,
        "grid_size": list(backbone.grid_size),
        "has_class_token": backbone.classifier == "token",
        "num_experts": num_experts,
        "ensemble_size": members,
        "moe_type": backbone.moe_type,
        "num_classes": num_classes if all_labels is not None else None,
        "layers": {name: _layer_statistics(layer, token_slots, members, tokens,
                                           num_experts, num_classes,
                                           labeled=all_labels is not None)
                   for name, layer in totals.items()},
    }
