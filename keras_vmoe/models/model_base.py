"""`ModelBase`: what every keras_vmoe backbone and task shares: presets, LoRA
and int8 quantization that reaches the MoE expert banks.

`from_preset` and `save_to_preset` import the presets (which sit above the
models) on first use: the only imports that go up the layers.
"""

import warnings

import keras

from keras_vmoe.catalog import PRESETS
from keras_vmoe.layers.experts import Experts
from keras_vmoe.models import lora
from keras_vmoe.models.quantized_config import quantize_found_layers
from keras_vmoe.utils.keras_internals import collect_garbage_once
from keras_vmoe.utils.keras_internals import flatten_layers


class PresetListing:
    """`Class.presets`: `{name: description}` of the built-in presets that
    `Class.from_preset` loads."""

    def __get__(self, instance, owner):
        return {name: entry["description"] for name, entry in sorted(PRESETS.items())
                if owner.loads_task(entry["task"]["class"])}


def quantize_with_experts(model, mode, config=None, filters=None, **kwargs):
    """Keras' `Model.quantize` on `model`, plus its `Experts` banks (int8
    only: Keras quantizes leaf layers, and an expert bank is not one)."""
    with warnings.catch_warnings():
        # Keras warns for every leaf layer without int8 weights.
        warnings.filterwarnings(
            "ignore", message=r"Layer \w+ does not have a `quantize` method")
        with collect_garbage_once():
            keras.Model.quantize(model, mode, config=config, filters=filters, **kwargs)
    if mode != "int8":
        return
    quantize_found_layers(model, {
        layer: mode for layer in flatten_layers(model) if isinstance(layer, Experts)})


class ModelBase(keras.Model):
    """Presets, LoRA and int8 quantization of a keras_vmoe model (subclass
    `Backbone` or `Task`, not this)."""

    presets = PresetListing()

    @classmethod
    def loads_task(cls, task_class_name):
        """Whether `cls.from_preset` loads a preset whose task is the
        registered keras_vmoe class `task_class_name`."""
        raise NotImplementedError

    @classmethod
    def from_preset(cls, preset, load_weights=True, **overrides):
        """Builds this class from a preset name (`Class.presets`), directory or
        handle (`hf://`, `kaggle://`, `gs://`), with random weights when
        `load_weights=False`; `overrides` as `keras_vmoe.presets.from_preset`.

        A task class given a backbone preset puts a new head on it
        (`num_classes` required); a backbone class returns the backbone of
        any preset and refuses head arguments.
        """
        from keras_vmoe.presets import load  # lazy: the presets sit above the models

        return load.class_from_preset(cls, preset, load_weights=load_weights, **overrides)

    def save_to_preset(self, preset_dir, **kwargs):
        """Saves this model as a preset directory, atomically, and returns its
        absolute path; `kwargs` as `keras_vmoe.presets.save_to_preset`."""
        from keras_vmoe.presets import save  # lazy: the presets sit above the models

        return save.save_to_preset(self, preset_dir, **kwargs)

    def enable_lora(self, rank, **kwargs):
        """LoRA of rank `rank` on the attention query/value (and optionally the
        experts; `kwargs` as `keras_vmoe.models.lora.enable_lora`): only the
        LoRA factors (and a task's head) train afterwards. Returns the model."""
        return lora.enable_lora(self, rank, **kwargs)

    def save_lora_weights(self, path, **kwargs):
        """Writes the LoRA factors (and a task's head) to a `.npz`
        (`keras_vmoe.models.lora`)."""
        return lora.save_lora_weights(self, path, **kwargs)

    def load_lora_weights(self, path):
        """Loads LoRA factors (and a head) saved by `save_lora_weights`."""
        return lora.load_lora_weights(self, path)

    def quantize(self, mode=None, config=None, filters=None, **kwargs):
        """Keras' `Model.quantize`, plus the MoE expert banks (int8)."""
        quantize_with_experts(self, mode, config=config, filters=filters, **kwargs)
