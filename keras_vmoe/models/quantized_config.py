"""The quantized layers of a model, carried in its config through `.keras` files.

keras_vmoe's backbones and tasks build their sublayers from their
hyper-parameters, so their config alone does not say which layers hold int8
weights (Keras records that in each layer's dtype policy, which these
configs do not carry). A quantized model's `get_config` therefore lists its
quantized layers under `QUANTIZED_LAYERS_KEY`, and `from_config` builds the
float model and quantizes the same layers before Keras loads the int8
weights: `model.save("q.keras")` then `keras.saving.load_model("q.keras")`
gives the int8 model back. Float models' configs are unchanged.
"""

import keras

from keras_vmoe.deploy.quantize import layers_by_path
from keras_vmoe.deploy.quantize import quantized_layers
from keras_vmoe.utils.keras_internals import collect_garbage_once
from keras_vmoe.utils.keras_internals import retrack_variables

QUANTIZED_LAYERS_KEY = "quantized_layers"
# Modes a config can restore (Keras' int8 for the dense and attention
# layers, keras_vmoe's per-expert int8 for the expert banks).
SUPPORTED_MODES = ("int8",)


def add_quantized_layers(config, model):
    """`config` with `model`'s quantized layers under `QUANTIZED_LAYERS_KEY`.

    Args:
        config: the model's config dict (changed in place and returned).
        model: a built backbone or task.

    Returns:
        `config`; unchanged for a float model.
    """

    layers = quantized_layers(model)
    if layers:
        config[QUANTIZED_LAYERS_KEY] = layers
    return config


def pop_quantized_layers(config):
    """Removes and checks the quantized-layer record of a config.

    Args:
        config: a config dict (changed in place).

    Returns:
        `{layer path: mode}`, or `None` for a float model.

    Raises:
        ValueError: the record is not a `{path: "int8"}` dict.
    """
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
    """Quantizes the layers of `model` named in `layers` (`{path: mode}`).

    Layers already quantized are left as they are (a task's record also
    lists its backbone's layers, which the backbone's config restores).

    Raises:
        ValueError: a named layer is not in the model.
    """
    if not layers:
        return model
    return quantize_named_layers(model, layers, lambda missing: (
        f"`{QUANTIZED_LAYERS_KEY}` names layers that {model.name!r} does not have: "
        f"{_preview(missing)}. The config was edited or comes from another model."))


def _preview(paths):
    return f"{paths[:5]}{' ...' if len(paths) > 5 else ''}"


def quantize_named_layers(model, layers, missing_message):
    """Quantizes the layers of `model` named in `layers` (`{path: mode}`),
    after checking they all exist; the one loop behind `.keras` configs and
    int8 presets.

    Args:
        model: a built model.
        layers: `{layer path: quantization mode}`.
        missing_message: callable, sorted missing paths -> the error text.

    Returns:
        `model`.

    Raises:
        ValueError: a named layer is not in the model.
    """

    found = layers_by_path(model)
    missing = sorted(set(layers) - set(found))
    if missing:
        raise ValueError(missing_message(missing))
    return quantize_found_layers(model, {found[path]: mode for path, mode in layers.items()})


def quantize_found_layers(model, layers):
    """Quantizes `layers` (`{layer of model: mode}`) that are still float,
    then resets `model`'s compiled functions as `Model.quantize` does.

    Returns:
        `model`.
    """
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
