"""Quantized presets: which layers `model.quantize` changed, saved and re-applied.

`save_to_preset` records the int8 layers in `config.json` (a subclassed
backbone's config does not carry them); `from_preset` builds the float model,
quantizes the same layers, then checks and loads the int8 weights.
"""


from keras_vmoe.deploy.quantize import quantized_layers
from keras_vmoe.models.quantized_config import quantize_named_layers
from keras_vmoe.presets import integrity

QUANTIZATION_KEY = "keras_vmoe_quantization"
# Modes whose weights a preset can restore.
SUPPORTED_MODES = ("int8",)


def record(config, model):
    """Adds the quantized layers of `model` to its serialized `config`."""
    layers = quantized_layers(model)
    if not layers:
        return config
    unsupported = sorted({mode for mode in layers.values()
                          if mode not in SUPPORTED_MODES})
    if unsupported:
        raise ValueError(
            f"save_to_preset supports quantization modes {list(SUPPORTED_MODES)}; "
            f"the model has layers quantized with {unsupported}. Save the float "
            "model and quantize it after loading.")
    return {**config, QUANTIZATION_KEY: {"layers": layers}}


def pop_record(config, config_path):
    """Pops and checks the quantization record: `{layer path: mode}` or None."""
    entry = config.pop(QUANTIZATION_KEY, None)
    if entry is None:
        return None
    layers = entry.get("layers") if isinstance(entry, dict) else None
    if not isinstance(layers, dict) or not layers:
        raise ValueError(
            f"{config_path}: `{QUANTIZATION_KEY}` must be "
            '{"layers": {"<layer path>": "int8", ...}}. '
            f"Received: {str(entry)[:200]}")
    for path, mode in layers.items():
        if not isinstance(path, str) or mode not in SUPPORTED_MODES:
            raise ValueError(
                f"{config_path}: `{QUANTIZATION_KEY}` layer {str(path)[:100]!r} has "
                f"mode {str(mode)[:50]!r}; valid modes: {list(SUPPORTED_MODES)}.")
    return layers


def apply(model, layers, config_path):
    """Quantizes the layers named in a preset's record (weights come next)."""
    return quantize_named_layers(model, layers, lambda missing: (
        f"{config_path} records quantized layers that the model does not have: "
        f"{missing[:5]}{' ...' if len(missing) > 5 else ''}. The file was "
        "edited or comes from another model: re-save the preset."))


def check_weights(model, config, config_path, weights_path):
    """Checks, before loading, that int8 weights are stored as int8 (not cast
    silently) and that every scale is finite and positive."""
    import h5py
    import numpy as np

    expected = integrity.expected_weight_shapes(config, model)
    if expected is None:
        return
    variables = {v.path: v for v in model.weights}
    problems = []
    with h5py.File(weights_path, "r") as file:
        for key, (name, _) in expected.items():
            variable = variables.get(name)
            if variable is None or key not in file:
                continue
            dataset = file[key]
            wanted = np.dtype(str(variable.dtype))
            if wanted == np.int8 and dataset.dtype != np.int8:
                problems.append(f"{name} is stored as {dataset.dtype}, not int8")
            elif name.endswith("_scale") and dataset.dtype.kind == "f":
                values = dataset[()]
                if not np.all(np.isfinite(values) & (values > 0)):
                    problems.append(f"{name} holds scales that are not finite and > 0")
            elif name.endswith("_scale"):
                problems.append(f"{name} is stored as {dataset.dtype}, not float")
    if problems:
        raise integrity.PresetIntegrityError(
            f"{weights_path} does not hold valid int8 weights for {config_path}: "
            + "; ".join(problems[:5])
            + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
            + ". The file was edited or damaged: re-save or re-download the preset.")
