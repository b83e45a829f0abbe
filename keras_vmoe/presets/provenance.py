"""Where a model's weights come from, so that a saved preset says so honestly.

`from_preset` and `upcycle` attach a `weights` record (`pretrained`, `random`,
`fine_tuned`, `upcycled` or `unknown`, with the `changes` made on loading);
`save_to_preset` writes it to `metadata.json`.
"""

import copy

import numpy as np

ATTRIBUTE = "_keras_vmoe_weights"
# Overrides of `from_preset` that change loaded weights (and thus accuracy).
WEIGHT_CHANGING_OVERRIDES = ("num_classes", "head_bias_init", "image_size", "dtype")


def optimizer_steps(model):
    """Optimizer steps the model has taken (0 when never compiled or trained)."""
    optimizer = getattr(model, "optimizer", None)
    iterations = getattr(optimizer, "iterations", None)
    if iterations is None:
        return 0
    try:  # np.array(Variable) warns on numpy 2
        return int(np.asarray(getattr(iterations, "value", iterations)))
    except (TypeError, ValueError):  # pragma: no cover - symbolic variable
        return 0


def builtin_record(name, entry, load_weights, overrides):
    """The weights record of a model `from_preset` built from a catalog entry."""
    if not load_weights or entry["weights"] is None:
        return {"kind": "random", "preset": name}
    record = {"kind": "pretrained", "preset": name, "source": entry["weights"]["upstream"]}
    return _with_changes(record, overrides)


def directory_record(metadata, load_weights, overrides):
    """The weights record of a model loaded from a preset directory."""
    if not load_weights:
        return {"kind": "random", "preset": (metadata or {}).get("preset_name")}
    record = copy.deepcopy((metadata or {}).get("weights")) or {"kind": "unknown"}
    record.pop("changes", None)
    previous = (metadata or {}).get("weights", {}) or {}
    return _with_changes(record, overrides, previous.get("changes"))


def _with_changes(record, overrides, previous=None):
    changes = list(previous or [])
    for key in WEIGHT_CHANGING_OVERRIDES:
        if overrides.get(key) is not None:
            changes.append(f"{key}={overrides[key]}")
    if changes:
        record["changes"] = changes
    return record


def record(model, weights_record):
    """Attaches a weights record to a model (with its optimizer step count)."""
    value = dict(weights_record, _steps_at_load=optimizer_steps(model))
    object.__setattr__(model, ATTRIBUTE, value)


def current(model, metadata=None):
    """The weights record to save for `model` now (`fine_tuned` after optimizer
    steps; a conversion's `metadata` makes it `pretrained`; else `unknown`)."""
    attached = getattr(model, ATTRIBUTE, None)
    if attached is None:
        source = ((metadata or {}).get("conversion") or {}).get("source")
        if source:
            return {"kind": "pretrained", "source": source}
        attached = {"kind": "unknown", "_steps_at_load": 0}
    attached = copy.deepcopy(attached)
    steps = optimizer_steps(model) - attached.pop("_steps_at_load", 0)
    if steps > 0:
        return {"kind": "fine_tuned", "from": attached, "optimizer_steps": steps}
    return attached


def is_released(weights_record, canonical):
    """Whether a weights record is `canonical`'s released weights, unchanged."""
    return (weights_record.get("kind") == "pretrained"
            and weights_record.get("preset") in (None, canonical)
            and not weights_record.get("changes"))


def describe(weights_record, canonical):
    """The `metadata.json` description for weights that are not the release."""
    kind = weights_record.get("kind")
    if kind == "random":
        return f"Architecture of {canonical} with randomly initialised weights."
    if kind == "fine_tuned":
        base = weights_record.get("from", {})
        if base.get("kind") == "random":
            start = f"randomly initialised {canonical}"
        else:
            start = base.get("preset") or canonical
        return (f"Trained from {start} for {weights_record.get('optimizer_steps')} "
                "optimizer steps.")
    if kind == "pretrained" and weights_record.get("changes"):
        return (f"Weights of {canonical} ({weights_record.get('source')}) changed on "
                f"loading: {', '.join(weights_record['changes'])}.")
    return f"A model with the architecture of {canonical} (weights of unknown origin)."
