"""The quantized layers of a model, carried in its config through `.keras` files.

A quantized model's `get_config` lists its int8 layers under
`QUANTIZED_LAYERS_KEY`; `from_config` builds the float model and quantizes the
same layers before Keras loads the int8 weights.
"""

import keras

from keras_vmoe.deploy.quantize import layers_by_path
from keras_vmoe.deploy.quantize import quantized_layers
from keras_vmoe.utils.keras_internals import collect_garbage_once
from keras_vmoe.utils.keras_internals import retrack_variables

QUANTIZED_LAYERS_KEY = "quantized_layers"
SUPPORTED_MODES = ("int8",)


def add_quantized_layers(config, model):
    """`config` (changed in place) with `model`'s quantized layers, if any."""
    layers = quantized_layers(model)
    if layers:
        config[QUANTIZED_LAYERS_KEY] = layers
    return config


def pop_quantized_layers(config):
    """Removes and checks the `{layer path: mode}` record of a config (`None`
    for a float model)."""
    layers = config.pop(QUANTIZED_LAYERS_KEY, None)
    if layers is None:
        return None
    if not isinstance(layers, dict) or not all(
            isinstance(path, str) and mode in SUPPORTED_MODES
            for path, mode in layers.items()):
        raise ValueError(
            f"`{QUANTIZED_LAYERS_KEY}` must map layer paths to a quantization mode "
            f"in {list(SUPPORTED_MODES)}. Received: "
            f"{QUANTIZED_LAYERS_KEY}={str(layers)[:200]}")
    return layers


def quantize_layers(model, layers):
    """Quantizes the layers of `model` named in `layers` (`{path: mode}`)
    that are still float."""
    if not layers:
        return model
    return quantize_named_layers(model, layers, lambda missing: (
        f"`{QUANTIZED_LAYERS_KEY}` names layers that {model.name!r} does not have: "
        f"{_preview(missing)}. The config was edited or comes from another model."))


def _preview(paths):
    return f"{paths[:5]}{' ...' if len(paths) > 5 else ''}"


def quantize_named_layers(model, layers, missing_message):
    """Quantizes the layers of `model` named in `layers` (`{path: mode}`),
    raising `ValueError(missing_message(sorted missing paths))` first."""
    found = layers_by_path(model)
    missing = sorted(set(layers) - set(found))
    if missing:
        raise ValueError(missing_message(missing))
    return quantize_found_layers(model, {found[path]: mode for path, mode in layers.items()})


def quantize_found_layers(model, layers):
    """Quantizes `layers` (`{layer of model: mode}`) that are still float,
    then resets `model`'s compiled functions as `Model.quantize` does."""
    changed = False
    with collect_garbage_once():
        for layer, mode in layers.items():
            if layer.quantization_mode is None:
                layer.quantize(mode)
                changed = True
    if changed:
        model.train_function = model.test_function = model.predict_function = None
        if keras.backend.backend() == "torch":
            retrack_variables(model)
    return model
