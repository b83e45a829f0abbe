"""`Backbone`: the base class of keras_vmoe backbones.

A backbone maps images to features; the tasks (`keras_vmoe.models.Task`)
put a head on one. The base carries what every backbone shares, as
KerasHub's `Backbone` does: the class-owned presets (`from_preset`,
`save_to_preset`, `presets`), LoRA (`enable_lora`, `save_lora_weights`,
`load_lora_weights`), int8 quantization that reaches the MoE expert banks,
layout maps for `keras.distribution`, and `fit`/`evaluate`/`predict` that
keep the model usable after an error (`keras_vmoe.models.state_guard`).

The presets sit above the models (docs/architecture.md), so their
implementation is imported on first use.
"""

import warnings

import keras

from keras_vmoe._lazy import lazy_attribute
from keras_vmoe.distribution.layouts import layout_map
from keras_vmoe.distribution.validation import check_divisible
from keras_vmoe.keras_internals import collect_garbage_once
from keras_vmoe.keras_internals import flatten_layers
from keras_vmoe.layers.experts import Experts
from keras_vmoe.models import lora
from keras_vmoe.models import state_guard
from keras_vmoe.models.quantized_config import quantize_found_layers
from keras_vmoe.utils import initialization

# `.keras` files of keras_vmoe models load without drawing the weights they hold.
initialization.skip_initializers_in_keras_files()

# The class-owned preset API (`from_preset`, `presets`) and the preset writer.
_PRESET_CLASSES = "keras_vmoe.presets.classes"
_PRESET_SAVE = "keras_vmoe.presets.save"


class PresetListing:
    """`Class.presets`: `{name: description}` of the built-in presets that
    `Class.from_preset` loads."""

    def __get__(self, instance, owner):
        return lazy_attribute(_PRESET_CLASSES, "class_presets")(owner)


def load_preset(cls, preset, load_weights=True, **overrides):
    """`cls` built from a preset: `Backbone.from_preset` and `Task.from_preset`."""
    load = lazy_attribute(_PRESET_CLASSES, "class_from_preset")
    return load(cls, preset, load_weights=load_weights, **overrides)


def save_preset(model, preset_dir, **kwargs):
    """Writes `model` as a preset: `save_to_preset` of the bases."""
    return lazy_attribute(_PRESET_SAVE, "save_to_preset")(model, preset_dir, **kwargs)


def quantize_with_experts(model, mode, config=None, filters=None, **kwargs):
    """Keras' `Model.quantize` on `model`, plus its MoE expert banks.

    Keras quantizes the dense and attention layers (leaf layers only); the
    `Experts` banks (a layer with a dropout sublayer) are quantized here:
    weight-only int8 with per-expert, per-output-channel scales
    (`Experts.quantize`). Other modes leave the experts in float.
    """

    with warnings.catch_warnings():
        # Keras warns for every leaf layer without int8 weights (norms,
        # dropout, routers, embeddings): expected, not actionable.
        warnings.filterwarnings(
            "ignore", message=r"Layer \w+ does not have a `quantize` method")
        with collect_garbage_once():
            keras.Model.quantize(model, mode, config=config, filters=filters, **kwargs)
    if mode != "int8":
        return
    quantize_found_layers(model, {
        layer: mode for layer in flatten_layers(model) if isinstance(layer, Experts)})


class Backbone(keras.Model):
    """Base class of the keras_vmoe backbones (images -> features).

    Subclass it and build the graph in `__init__` with the functional API
    (`super().__init__(inputs=..., outputs=..., **kwargs)`); implement
    `get_config` and `get_moe_layers` (the MoE layers, in order; an empty
    list for a dense model). The base then gives the subclass presets,
    `save_to_preset`, LoRA, int8 quantization of the expert banks and the
    error-safe `fit`/`evaluate`/`predict`, with no plumbing of its own.
    `VisionTransformerBackbone` is the backbone of every model family here.

    Examples:

    ```python
    import keras_vmoe

    backbone = keras_vmoe.models.VisionTransformerBackbone.from_preset(
        "vmoe_b32", load_weights=False, hidden_dim=64, num_heads=4,
        mlp_dim=128, num_layers=4, num_experts=4, image_size=32)
    assert isinstance(backbone, keras_vmoe.models.Backbone)
    path = backbone.save_to_preset("tiny_backbone_preset")
    again = keras_vmoe.models.VisionTransformerBackbone.from_preset(path)
    ```
    """

    presets = PresetListing()

    @classmethod
    def from_preset(cls, preset, load_weights=True, **overrides):
        """Builds this backbone from a preset name, directory or handle.

        Takes the arguments of `keras_vmoe.presets.from_preset`; for a task
        preset it returns the task's backbone. Head arguments
        (`num_classes`, `head_bias_init`) are refused.

        Args:
            preset: a built-in preset name (see `Class.presets`), a preset
                directory or a handle (`hf://`, `kaggle://`, `gs://`).
            load_weights: bool, `False` builds the architecture with random
                weights.
            **overrides: as `keras_vmoe.presets.from_preset` (routing,
                `image_size`, `dtype`, ...).

        Returns:
            An instance of this class.
        """
        return load_preset(cls, preset, load_weights, **overrides)

    def save_to_preset(self, preset_dir, **kwargs):
        """Saves this backbone as a preset directory, atomically.

        Args:
            preset_dir: local directory to create.
            **kwargs: `preset_name`, `metadata`, `dtype`, as
                `keras_vmoe.presets.save_to_preset`.

        Returns:
            The absolute path of the preset directory.
        """
        return save_preset(self, preset_dir, **kwargs)

    def get_moe_layers(self):
        """The MoE layers, in order (an empty list for a dense model)."""
        raise NotImplementedError(f"{type(self).__name__} must implement get_moe_layers.")

    def enable_lora(self, rank, **kwargs):
        """LoRA on the attention query/value (and optionally the experts).

        Only the LoRA factors of this backbone train afterwards; a task that
        wraps it finds the settings too (`keras_vmoe.models.lora`).

        Args:
            rank: int r.
            **kwargs: `lora_alpha`, `targets`, `experts`, as
                `keras_vmoe.models.lora.enable_lora`.

        Returns:
            This backbone.
        """
        return lora.enable_lora(self, rank, **kwargs)

    def save_lora_weights(self, path, **kwargs):
        """Writes the LoRA factors to a `.npz` (`keras_vmoe.models.lora`)."""
        return lora.save_lora_weights(self, path, **kwargs)

    def load_lora_weights(self, path):
        """Loads LoRA factors saved by `save_lora_weights`."""
        return lora.load_lora_weights(self, path)

    def quantize(self, mode=None, config=None, filters=None, **kwargs):
        """Keras' `Model.quantize`, plus the MoE expert banks (int8)."""
        quantize_with_experts(self, mode, config=config, filters=filters, **kwargs)

    def get_layout_map(self, device_mesh, layout="expert", batch_size=None):
        """Layout map that splits this backbone over a device mesh.

        Args:
            device_mesh: `keras_vmoe.distribution.make_mesh(...)` mesh with
                axes `("data", "expert", "model")`.
            layout: `"data"`, `"expert"`, `"expert_model"` or `"pod"` (see
                `keras_vmoe.distribution`).
            batch_size: optional global batch size to check as well.

        Returns:
            A `keras.distribution.LayoutMap`, after checking that experts,
            heads, MLP sizes (and the batch) divide the mesh axes.

        Example:

        >>> mesh = keras_vmoe.distribution.make_mesh(data=2, expert=4)  # doctest: +SKIP
        >>> layout_map = backbone.get_layout_map(mesh, "expert")  # doctest: +SKIP
        """
        check_divisible(
            dict(zip(device_mesh.axis_names, device_mesh.shape, strict=True)),
            layout, config=self.get_config(), batch_size=batch_size)
        return layout_map(device_mesh, layout)

    @state_guard.restore_on_error
    def fit(self, *args, **kwargs):
        state_guard.check_not_empty("fit", args, kwargs)
        return super().fit(*args, **kwargs)

    @state_guard.restore_on_error
    def evaluate(self, *args, **kwargs):
        state_guard.check_not_empty("evaluate", args, kwargs)
        return super().evaluate(*args, **kwargs)

    @state_guard.restore_on_error
    def predict(self, *args, **kwargs):
        state_guard.check_not_empty("predict", args, kwargs)
        return state_guard.predict_whole_batches(super().predict, args, kwargs)
