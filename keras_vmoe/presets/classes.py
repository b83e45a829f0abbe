"""The class-owned preset API: `Class.from_preset` and `Class.presets` of
`keras_vmoe.models.Backbone` and `keras_vmoe.models.Task`."""

from keras_vmoe.catalog import PRESETS

_HEAD_OVERRIDES = ("num_classes", "head_bias_init")


def _kinds(cls):
    from keras_vmoe import models  # lazy: presets face loads without Keras

    if issubclass(cls, models.EnsembleImageClassifier):
        return ("ensemble_classifier",)
    if issubclass(cls, models.ImageClassifier):
        return ("classifier",)
    return ("classifier", "ensemble_classifier")


def class_presets(cls):
    """`{name: description}` of the built-in presets `cls.from_preset` loads."""
    kinds = _kinds(cls)
    return {
        name: entry["description"]
        for name, entry in sorted(PRESETS.items())
        if entry["task"]["kind"] in kinds
    }


def class_from_preset(cls, preset, load_weights=True, **overrides):
    """`cls` built from a preset (see `Backbone.from_preset`, `Task.from_preset`)."""
    from keras_vmoe import models  # lazy: presets face loads without Keras
    from keras_vmoe.presets.load import (
        from_preset,  # lazy: presets face loads without Keras
    )

    if issubclass(cls, models.Backbone):
        given = sorted(set(overrides) & set(_HEAD_OVERRIDES))
        if given:
            raise ValueError(
                f"A backbone has no classification head: {given} do not apply to "
                f"{cls.__name__}.from_preset. Received: "
                + ", ".join(f"{k}={overrides[k]!r}" for k in given)
            )
        model = from_preset(preset, load_weights=load_weights, **overrides)
        backbone = getattr(model, "backbone", model)
        if not isinstance(backbone, cls):
            raise ValueError(
                f"Preset {preset!r} holds a {type(backbone).__name__}, not a "
                f"{cls.__name__}."
            )
        return backbone
    model = from_preset(preset, load_weights=load_weights, **overrides)
    if isinstance(model, models.Backbone):
        raise ValueError(
            f"Preset {preset!r} is a backbone without a head: pass "
            f"`num_classes=...` to build a {cls.__name__} with a new head."
        )
    if not isinstance(model, cls):
        raise ValueError(
            f"Preset {preset!r} is a {type(model).__name__}, not a {cls.__name__}: "
            f"load it with {type(model).__name__}.from_preset(...) or "
            "keras_vmoe.presets.from_preset(...)."
        )
    return model
