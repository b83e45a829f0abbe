"""Routing statistics of every MoE layer over a dataset.

Axis letters: B images, N ensemble members (E³), T tokens per image, E
experts, C classes.
"""

import numpy as np

from keras_vmoe.evaluation._batches import get_backbone
from keras_vmoe.evaluation._batches import iterate_batches


def convert_images(model_or_backbone, images):
    """Applies the task's preprocessor, if it has one, to a NumPy batch.

    Backbones take images already in [-1, 1] at the model resolution; a
    task's preprocessor (raw `uint8` or float images -> model input)
    converts them here, as its `predict` does.
    """
    preprocessor = getattr(model_or_backbone, "preprocessor", None)
    if preprocessor is None:
        return np.asarray(images, dtype="float32")
    return np.asarray(preprocessor.convert(np.asarray(images)), dtype="float32")


def _num_classes(model_or_backbone, num_classes, labels_seen):
    if num_classes is None:
        num_classes = getattr(model_or_backbone, "num_classes", None)
    if num_classes is None and labels_seen:
        num_classes = int(max(labels_seen)) + 1
    return num_classes


def _accumulate(totals, assignments, y, batch, members, tokens, num_experts):
    """Adds one batch's routing assignments to the per-layer totals (in place).

    Args:
        totals: `{layer name: running totals}`, extended here.
        assignments: the backbone's `routing_assignments` of the batch.
        y: `(B,)` int64 labels of the batch, or None.
        batch: B.
        members: N.
        tokens: T.
        num_experts: E.
    """
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
    """The statistics entry of one MoE layer from its accumulated totals.

    Args:
        layer: the layer's totals (see `_accumulate`).
        token_slots: tokens routed in all (images × members × T).
        members: N.
        tokens: T.
        num_experts: E.
        num_classes: C, columns of the expert × class counts.
        labeled: whether labels were given (adds the class counts).

    Returns:
        The layer's dict in the `layers` of `routing_statistics`.
    """
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
            max(0.0, 1.0 - total / requested.sum()) if requested.sum() else 0.0
        )
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

    Routes every batch through the encoder (inference routing, no noise)
    and accumulates, per MoE layer, which experts processed each token.

    Args:
        model_or_backbone: a keras_vmoe task or `VisionTransformerBackbone`
            with MoE layers.
        images: `(B, H, W, C)` array (model input range, or raw images when
            the task has a preprocessor), or an iterable of batches
            (`tf.data.Dataset`, ...) yielding images or `(images, labels)`.
        labels: `(B,)` integer labels for array `images` (optional; needed
            for the expert × class counts).
        batch_size: int, batch size for array inputs.
        num_classes: int, columns of the expert × class counts (default:
            the task's `num_classes`, else the largest label + 1).

    Returns:
        A JSON-serialisable dict: `num_images`, `num_tokens` (T per image),
        `grid_size`, `has_class_token`, `num_experts`, `ensemble_size`,
        `num_classes` and `layers`, `{"encoderblock_i": {...}}` with

        - `expert_counts` `[E]`: token assignments each expert processed;
        - `expert_load` `[E]`: the same as fractions (sum to 1);
        - `requested_counts` `[E]` (Token Choice): assignments the tokens
            asked for before capacity, and `dropped_assignments_fraction`;
        - `tokens_dropped_fraction`: tokens (per image, member and
            position) that no expert processed;
        - `capacity`: slots per expert per group (of the last batch);
        - `expert_position_counts` `[E][T]`: assignments by token position
            (position 0 is the class token when `has_class_token`);
        - `expert_class_counts` `[E][C]` and `class_token_counts` `[C]`
            (tokens per class, members counted) when labels are given.

        For Soft MoE the counts are dispatch weights summed over slots.

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
    totals = {}
    class_batches = []
    num_images = 0
    for x, y in iterate_batches(images, labels, batch_size):
        x = convert_images(model_or_backbone, x)
        batch = x.shape[0]
        assignments = backbone.routing_assignments(x)
        num_images += batch
        if y is not None:
            y = np.asarray(y).reshape(-1).astype("int64")
            class_batches.append(y)
        _accumulate(totals, assignments, y, batch, members, tokens, num_experts)
    if num_images == 0:
        raise ValueError("`images` is empty: there is nothing to route.")
    all_labels = np.concatenate(class_batches) if class_batches else None
    if all_labels is not None and all_labels.size and all_labels.min() < 0:
        raise ValueError(
            f"`labels` must be class ids >= 0. Received a label {all_labels.min()}."
        )
    num_classes = _num_classes(
        model_or_backbone, num_classes,
        [] if all_labels is None else all_labels.tolist(),
    )
    if all_labels is not None and num_classes is not None and all_labels.max() >= num_classes:
        raise ValueError(
            f"`labels` must be in [0, {num_classes}) for num_classes={num_classes}. "
            f"Received a label {all_labels.max()}."
        )
    token_slots = num_images * members * tokens
    stats = {
        "num_images": num_images,
        "num_tokens": tokens,
        "grid_size": list(backbone.grid_size),
        "has_class_token": backbone.classifier == "token",
        "num_experts": num_experts,
        "ensemble_size": members,
        "moe_type": backbone.moe_type,
        "num_classes": num_classes if all_labels is not None else None,
        "layers": {},
    }
    for name, layer in totals.items():
        stats["layers"][name] = _layer_statistics(
            layer, token_slots, members, tokens, num_experts, num_classes,
            labeled=all_labels is not None)
    return stats
