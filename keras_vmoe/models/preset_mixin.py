"""`from_preset` and `presets` on the model classes.

The presets sit above the models (README, "Package layers"), so the
implementation (`keras_vmoe.presets.classes`) is imported on first use.
"""

from keras_vmoe._lazy import lazy_attribute

_IMPLEMENTATION = "keras_vmoe.presets.classes"


class _PresetListing:
    """`Class.presets`: `{name: description}` of the built-in presets that
    `Class.from_preset` loads."""

    def __get__(self, instance, owner):
        return lazy_attribute(_IMPLEMENTATION, "class_presets")(owner)


class PresetMixin:
    """Class-owned presets: `Class.from_preset(...)` returns a `Class`."""

    presets = _PresetListing()

    @classmethod
    def from_preset(cls, preset, load_weights=True, **overrides):
        """Builds this class from a preset name, directory or handle.

        Takes the arguments of `keras_vmoe.presets.from_preset` and returns
        an instance of this class: a backbone class returns the preset's
        backbone; a task class returns the preset's task, or, for a
        backbone preset, a new task with a fresh head (`num_classes` is
        then required).

        Args:
            preset: a built-in preset name (see `Class.presets`), a preset
                directory or a handle (`hf://`, `kaggle://`, `gs://`).
            load_weights: bool, `False` builds the architecture with random
                weights.
            **overrides: as `keras_vmoe.presets.from_preset` (routing,
                `image_size`, `num_classes`, `dtype`, ...).

        Returns:
            An instance of this class.

        Examples:

        ```python
        import keras_vmoe

        backbone = keras_vmoe.models.VisionTransformerBackbone.from_preset(
            "vmoe_b32", load_weights=False, hidden_dim=64, num_heads=4,
            mlp_dim=128, num_layers=4, num_experts=4, image_size=32)
        classifier = keras_vmoe.models.ImageClassifier.from_preset(
            "vmoe_b32", load_weights=False, hidden_dim=64, num_heads=4,
            mlp_dim=128, num_layers=4, num_experts=4, image_size=32,
            num_classes=10)
        ```
        """
        load = lazy_attribute(_IMPLEMENTATION, "class_from_preset")
        return load(cls, preset, load_weights=load_weights, **overrides)
