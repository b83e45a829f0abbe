"""Saving a model as a preset directory (`save_to_preset`).

A preset is a directory in KerasHub's layout: `config.json` (the serialized
model), `model.weights.h5` and `metadata.json` (versions, parameter count,
date, catalog metadata, SHA-256 hashes), written to a temporary sibling
directory, then renamed.
"""

import datetime
import json
import os
import shutil

import keras

import keras_vmoe
from keras_vmoe.catalog import PRESETS
from keras_vmoe.catalog.names import CONFIG_FILE
from keras_vmoe.catalog.names import is_preset_dir as _is_preset_dir
from keras_vmoe.catalog.names import resolve_preset_name
from keras_vmoe.models.quantized_config import QUANTIZED_LAYERS_KEY
from keras_vmoe.presets import integrity
from keras_vmoe.presets import provenance
from keras_vmoe.presets import quantization
from keras_vmoe.presets import storage

WEIGHTS_FILE = "model.weights.h5"
METADATA_FILE = "metadata.json"


def _to_jsonable(value):
    return json.loads(json.dumps(value, default=_json_default))


def _json_default(value):
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, (set, frozenset)):
        return sorted(value)
    return str(value)


def _model_config(model):
    config = keras.saving.serialize_keras_object(model)
    config.pop("compile_config", None)
    config.pop("build_config", None)
    # Quantized layers are recorded once, at the top (`quantization.record`).
    inner = config.get("config")
    if isinstance(inner, dict):
        inner.pop(QUANTIZED_LAYERS_KEY, None)
        backbone = inner.get("backbone")
        if isinstance(backbone, dict) and isinstance(backbone.get("config"), dict):
            backbone["config"].pop(QUANTIZED_LAYERS_KEY, None)
    return config


def _build_metadata(model, preset_name=None, metadata=None, weights_dtype=None):
    preset_name = preset_name or getattr(model, "_keras_vmoe_preset", None)
    backbone = getattr(model, "backbone", model)
    info = {
        "keras_vmoe_version": getattr(keras_vmoe, "__version__", None),
        "keras_version": keras.__version__,
        "backend": keras.backend.backend(),
        "parameter_count": int(model.count_params()),
        "date_saved": datetime.datetime.now().strftime("%Y-%m-%d@%H:%M:%S"),
        "class_name": type(model).__name__,
        "image_size": getattr(backbone, "image_size", None),
        "weights": provenance.current(model, metadata),
        "weights_dtype": weights_dtype,
    }
    if preset_name is not None:
        info["preset_name"] = preset_name
        canonical = resolve_preset_name(preset_name)
        if canonical is not None:
            entry = PRESETS[canonical]
            info["preset_name"] = canonical
            if entry["weights"] is not None and provenance.is_released(
                info["weights"], canonical
            ):
                info["description"] = entry["description"]
                info["catalog"] = entry["metadata"]  # copied by `_to_jsonable`
                info["upstream_weights"] = entry["weights"]
            else:  # Not the released weights: architecture facts only.
                info["description"] = provenance.describe(info["weights"], canonical)
                info["catalog"] = {"paper": entry["metadata"]["paper"]}
        preset_overrides = getattr(model, "_keras_vmoe_overrides", None)
        if preset_overrides:
            info["preset_overrides"] = preset_overrides
    quantized = quantization.quantized_layers(model)
    if quantized:
        info["quantization"] = {"mode": sorted(set(quantized.values()))[0],
                                "layers": len(quantized)}
    class_names = getattr(model, "class_names", None)
    if class_names is not None:
        info["class_names"] = [str(n) for n in class_names]
    if metadata:
        info.update(metadata)
    return _to_jsonable(info)


def save_to_preset(model, preset_dir, preset_name=None, metadata=None, dtype=None):
    """Saves a model as a preset directory, atomically.

    Writes `config.json`, `model.weights.h5` and `metadata.json`; on any
    error nothing is left behind. An empty directory or a preset holding only
    its own files is replaced; any other existing path is an error.

    Args:
        model: a `keras_vmoe` model (`ImageClassifier`,
            `EnsembleImageClassifier`, `VisionTransformerBackbone`, ...).
        preset_dir: local directory to create.
        preset_name: optional built-in preset the model comes from (default:
            the name `from_preset` recorded). Its catalog description,
            accuracy and weight source are recorded only when the model holds
            its released weights unchanged; else `metadata.json` `weights`
            says they are random or fine-tuned.
        metadata: optional dict merged into `metadata.json`.
        dtype: optional storage dtype of the float weights (`"bfloat16"`,
            `"float16"`); loading casts them back to the model's dtype.

    Returns:
        The absolute path of the preset directory.
    """
    if not isinstance(model, keras.Model):
        raise ValueError(
            "save_to_preset expects a keras.Model (e.g. from `from_preset`). "
            f"Received: model={model!r:.100} of type {type(model).__name__}.")
    weights_dtype = storage.validate_storage_dtype(dtype)
    preset_dir = local_directory(preset_dir, "save_to_preset")
    integrity.recover_dir(preset_dir, integrity.is_preset_complete)
    _check_replaceable(preset_dir)
    tmp_dir = integrity.new_temp_dir(preset_dir)
    try:
        config = quantization.record(_model_config(model), model)
        with open(os.path.join(tmp_dir, CONFIG_FILE), "w") as f:
            json.dump(_to_jsonable(config), f, indent=2)
        weights_path = os.path.join(tmp_dir, WEIGHTS_FILE)
        full_path = os.path.join(tmp_dir, "full." + WEIGHTS_FILE)
        keras.saving.save_weights(
            model,
            weights_path if weights_dtype is None else full_path,
            objects_to_skip=_training_state(model),
        )
        if weights_dtype is not None:
            storage.cast_weights_file(full_path, weights_path, weights_dtype)
            os.remove(full_path)
        info = _build_metadata(model, preset_name, metadata, weights_dtype)
        integrity.record_hashes(info, tmp_dir)
        with open(os.path.join(tmp_dir, METADATA_FILE), "w") as f:
            json.dump(info, f, indent=2)
        integrity.replace_dir(tmp_dir, preset_dir)
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    return preset_dir


PRESET_FILES = (CONFIG_FILE, WEIGHTS_FILE, METADATA_FILE)


def _check_replaceable(preset_dir):
    """Refuses to replace anything but an empty dir or a preset's own files."""
    if not os.path.lexists(preset_dir):
        return
    if not os.path.isdir(preset_dir) or os.path.islink(preset_dir):
        raise FileExistsError(
            f"{preset_dir!r} exists and is not a directory; refusing to overwrite "
            "it. Choose another path.")
    entries = sorted(os.listdir(preset_dir))
    if entries and not _is_preset_dir(preset_dir):
        raise FileExistsError(
            f"{preset_dir!r} exists and is not a preset directory (no "
            f"{CONFIG_FILE}); refusing to overwrite it. Choose another path.")
    others = [name for name in entries if name not in PRESET_FILES]
    if others:
        listed = ", ".join(others[:5])
        if len(others) > 5:
            listed += f" and {len(others) - 5} more"
        raise FileExistsError(
            f"{preset_dir!r} holds a preset and other files ({listed}); saving "
            "replaces the whole directory and would delete them. Move them "
            "out, or choose another path.")


def _training_state(model):
    """Objects whose state a preset leaves out: the optimizer."""
    optimizer = getattr(model, "optimizer", None)
    return [optimizer] if optimizer is not None else []


def local_directory(path, caller):
    """Absolute local path of an output directory; remote URLs are refused."""
    path = os.fspath(path)
    if "://" in path:
        raise ValueError(
            f"{caller} writes to a local directory. Save locally and upload the "
            f"directory (e.g. with gsutil or huggingface_hub). Received: {path!r}")
    return os.path.abspath(os.path.expanduser(path))
