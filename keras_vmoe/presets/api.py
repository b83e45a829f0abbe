"""Load, save and list presets.

A preset is a directory in KerasHub's layout:

```
config.json        keras.saving.serialize_keras_object(model)
model.weights.h5   model.save_weights(...)
metadata.json      versions, parameter count, date, catalog metadata
```

`from_preset` accepts a built-in catalog name or alias (see
`list_presets()`), a local preset directory, `gs://...` (or any other
`tf.io.gfile` scheme), `hf://owner/repo[/subdir]` (Hugging Face Hub) and
`kaggle://owner/model/keras/variant[/version]` (Kaggle Models).

Built-in presets of released upstream checkpoints are converted once and
cached in `<keras home>/keras_vmoe/<name>/` (keras home: `$KERAS_HOME`, else
`~/.keras`). The upstream files are read from a local mirror of the bucket
given by `$KERAS_VMOE_CHECKPOINT_ROOT`, else from `gs://` when TensorFlow is
installed.
"""

import copy
import datetime
import importlib
import json
import logging
import os
import shutil
import tempfile
import warnings

import keras

from keras_vmoe.layers.capacity import validate_capacity_factor
from keras_vmoe.models.size import check_serialized_model
from keras_vmoe.presets import integrity
from keras_vmoe.presets import provenance
from keras_vmoe.presets import storage
from keras_vmoe.presets.catalog import ALIASES
from keras_vmoe.presets.catalog import PRESETS
from keras_vmoe.presets.names import CHECKPOINT_ROOT_ENV
from keras_vmoe.presets.names import CONFIG_FILE
from keras_vmoe.presets.names import bucket_relative as _bucket_relative
from keras_vmoe.presets.names import is_preset_dir as _is_preset_dir
from keras_vmoe.presets.names import keras_home
from keras_vmoe.presets.names import mirror_source as _mirror_source
from keras_vmoe.presets.names import preset_cache_dir
from keras_vmoe.presets.names import resolve_preset_name
from keras_vmoe.presets.names import unknown_preset_error as _unknown_preset_error
from keras_vmoe.presets.table import list_presets

logger = logging.getLogger(__name__)

WEIGHTS_FILE = "model.weights.h5"
METADATA_FILE = "metadata.json"
ROUTING_OVERRIDES = (
    "num_selected_experts",
    "capacity_factor",
    "batch_priority",
    "group_size",
    "images_per_group",
    "eval_routing",
)
TASK_OVERRIDES = ("num_classes", "head_bias_init", "image_size", "dtype")
TASK_KINDS = ("classifier", "ensemble_classifier")
# Converter hooks per upstream weight format: (module, function). Each is
# called as `function(source, output_dir, preset_name=name)` and must write a
# preset directory (config.json, model.weights.h5, metadata.json) at
# `output_dir`. `source` is a local path or a gs:// URL.
CONVERTERS = {
    "vmoe_partitioned": ("keras_vmoe.checkpoints.convert", "convert_to_preset"),
    "vit_npz": ("keras_vmoe.checkpoints.convert", "convert_vit_npz_to_preset"),
}


class PresetWeightsUnavailableError(FileNotFoundError):
    """The weights of a built-in preset cannot be found or fetched."""


# ----------------------------------------------------------------------
# Catalog access.
# ----------------------------------------------------------------------


def get_preset_info(name):
    """A copy of a built-in preset's catalog entry.

    The entry (see `keras_vmoe.presets.catalog`) gets two more keys: `name`
    (the catalog name) and `aliases`.

    Args:
        name: a built-in preset name or alias.
    """
    canonical = resolve_preset_name(name)
    if canonical is None:
        raise _unknown_preset_error(name)
    info = copy.deepcopy(PRESETS[canonical])
    info["name"] = canonical
    info["aliases"] = sorted(a for a, target in ALIASES.items() if target == canonical)
    return info


# ----------------------------------------------------------------------
# Saving.
# ----------------------------------------------------------------------


def _package_version():
    try:
        import keras_vmoe

        return getattr(keras_vmoe, "__version__", None)
    except ImportError:  # pragma: no cover
        return None


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
    return config


def _build_metadata(model, preset_name=None, metadata=None, weights_dtype=None):
    preset_name = preset_name or getattr(model, "_keras_vmoe_preset", None)
    backbone = getattr(model, "backbone", model)
    info = {
        "keras_vmoe_version": _package_version(),
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
                info["catalog"] = copy.deepcopy(entry["metadata"])
                info["upstream_weights"] = copy.deepcopy(entry["weights"])
            else:  # Not the released weights: architecture facts only.
                info["description"] = provenance.describe(info["weights"], canonical)
                info["catalog"] = {"paper": entry["metadata"]["paper"]}
        preset_overrides = getattr(model, "_keras_vmoe_overrides", None)
        if preset_overrides:
            info["preset_overrides"] = copy.deepcopy(preset_overrides)
    class_names = getattr(model, "class_names", None)
    if class_names is not None:
        # Kept by whatever trained the model (`finetune`, a dataset's names).
        info["class_names"] = [str(n) for n in class_names]
    if metadata:
        info.update(metadata)
    return _to_jsonable(info)


def save_to_preset(model, preset_dir, preset_name=None, metadata=None, dtype=None):
    """Saves a model as a preset directory, atomically.

    Writes `config.json` (the serialized model), `model.weights.h5` and
    `metadata.json` into a temporary directory next to `preset_dir`, then
    renames it to `preset_dir`; on any error nothing is left behind. An
    existing preset directory holding only the preset's own files (or an
    empty directory) at `preset_dir` is replaced; any other existing path,
    or a preset directory holding other files, is an error (nothing is
    deleted).

    Args:
        model: a `keras_vmoe` model (`ImageClassifier`,
            `EnsembleImageClassifier`, `VisionTransformerBackbone`, ...).
        preset_dir: local directory to create.
        preset_name: optional built-in preset name the model comes from
            (default: the name `from_preset` recorded). Its catalog
            description, reported accuracy and weight source are recorded in
            `metadata.json` only when the model holds that preset's released
            weights unchanged; otherwise `metadata.json` describes the
            weights as random or fine-tuned (see
            `keras_vmoe.presets.provenance`; the record is under `weights`).
        metadata: optional dict merged into `metadata.json`.
        dtype: optional storage dtype of the floating-point weights:
            `"bfloat16"` (half the size of float32) or `"float16"`. The
            model config keeps its own dtype: loading casts the weights back.

    Returns:
        The absolute path of the preset directory.
    """
    if not isinstance(model, keras.Model):
        raise ValueError(
            "save_to_preset expects a keras.Model (e.g. from `from_preset`). "
            f"Received: model={model!r:.100} of type {type(model).__name__}."
        )
    weights_dtype = storage.validate_storage_dtype(dtype)
    preset_dir = local_directory(preset_dir, "save_to_preset")
    integrity.recover_dir(preset_dir, integrity.is_preset_complete)
    _check_replaceable(preset_dir)
    tmp_dir = integrity.new_temp_dir(preset_dir)
    try:
        config = _model_config(model)
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
    """Refuses to replace anything but an empty dir or a preset's own files.

    Saving replaces the whole directory, so a directory holding anything
    besides `PRESET_FILES` (notes, data, sub-directories) is refused,
    naming what it holds, rather than deleting files `save_to_preset` did
    not write.
    """
    if not os.path.lexists(preset_dir):
        return
    if not os.path.isdir(preset_dir) or os.path.islink(preset_dir):
        raise FileExistsError(
            f"{preset_dir!r} exists and is not a directory; refusing to overwrite "
            "it. Choose another path."
        )
    entries = sorted(os.listdir(preset_dir))
    if entries and not _is_preset_dir(preset_dir):
        raise FileExistsError(
            f"{preset_dir!r} exists and is not a preset directory (no "
            f"{CONFIG_FILE}); refusing to overwrite it. Choose another path."
        )
    others = [name for name in entries if name not in PRESET_FILES]
    if others:
        listed = ", ".join(others[:5]) + (f" and {len(others) - 5} more" if len(others) > 5 else "")
        raise FileExistsError(
            f"{preset_dir!r} holds a preset and other files ({listed}); saving "
            "replaces the whole directory and would delete them. Move them "
            "out, or choose another path."
        )


def _training_state(model):
    """Objects whose state a preset leaves out: the optimizer.

    A preset holds the model's weights only. `Model.save_weights` would also
    write the optimizer's slots (twice the weights again for Adam) of a
    compiled, trained model, and loading them into a fresh model warns that
    they are skipped.
    """
    optimizer = getattr(model, "optimizer", None)
    return [optimizer] if optimizer is not None else []


def local_directory(path, caller):
    """Absolute local path of an output directory; remote URLs are refused."""
    path = os.fspath(path)
    if "://" in path:
        raise ValueError(
            f"{caller} writes to a local directory. Save locally and upload the "
            f"directory (e.g. with gsutil or huggingface_hub). Received: {path!r}"
        )
    return os.path.abspath(os.path.expanduser(path))


# ----------------------------------------------------------------------
# Building models.
# ----------------------------------------------------------------------


def _split_overrides(overrides):
    routing = {k: overrides.pop(k) for k in ROUTING_OVERRIDES if k in overrides}
    if routing.get("capacity_factor") is not None:  # before any download/build
        routing["capacity_factor"] = validate_capacity_factor(routing["capacity_factor"])
    eval_routing = routing.get("eval_routing")
    if eval_routing is not None:
        if not isinstance(eval_routing, dict):
            raise ValueError(
                "`eval_routing` must be a dict of routing settings for evaluation, "
                f"e.g. {{'capacity_factor': 4.0}}. Received: eval_routing={eval_routing!r}"
            )
        unknown = sorted(set(eval_routing) - set(ROUTING_OVERRIDES[:-1]))
        if unknown:
            raise ValueError(
                f"Unknown `eval_routing` settings {unknown}. Valid: "
                f"{list(ROUTING_OVERRIDES[:-1])}."
            )
        if eval_routing.get("capacity_factor") is not None:
            validate_capacity_factor(
                eval_routing["capacity_factor"], name="eval_routing['capacity_factor']"
            )
    task = {k: overrides.pop(k) for k in TASK_OVERRIDES if k in overrides}
    return routing, task, overrides  # the rest: architecture overrides


def _make_task(kind, backbone, num_classes, head_bias_init=0.0, activation=None,
               image_converter=None):
    from keras_vmoe import models

    if kind == "ensemble_classifier" or getattr(backbone, "ensemble_size", 1) > 1:
        return models.EnsembleImageClassifier(
            backbone, num_classes=num_classes, head_bias_init=head_bias_init,
            image_converter=image_converter,
        )
    if kind != "classifier":
        raise ValueError(f"Unknown task kind {kind!r}. Valid kinds: {TASK_KINDS}.")
    return models.ImageClassifier(
        backbone,
        num_classes=num_classes,
        head_bias_init=head_bias_init,
        activation=activation,
        image_converter=image_converter,
    )


def _catalog_backbone_config(entry, architecture=None, image_size=None, dtype=None):
    from keras_vmoe.models import backbone_config

    kwargs = dict(entry["overrides"])
    kwargs["image_size"] = entry["image_size"]
    kwargs.update(entry["routing"])
    if entry.get("eval_routing"):
        kwargs["eval_routing"] = dict(entry["eval_routing"])
    kwargs.update(architecture or {})
    if image_size is not None:
        kwargs["image_size"] = image_size
    config = backbone_config(entry["family"], entry["variant"], **kwargs)
    if dtype is not None:
        config["dtype"] = dtype
    return config


def _build_from_catalog(name, architecture, task_overrides):
    from keras_vmoe import models

    entry = PRESETS[name]
    config = _catalog_backbone_config(
        entry,
        architecture,
        task_overrides.get("image_size"),
        task_overrides.get("dtype"),
    )
    backbone = models.VisionTransformerBackbone(**config)
    task = entry["task"]
    num_classes = task_overrides.get("num_classes", task["num_classes"])
    head_bias_init = task_overrides.get(
        "head_bias_init", task.get("head_bias_init", 0.0)
    )
    return _make_task(task["kind"], backbone, num_classes, head_bias_init)


def _set_backbone_option(config, key, value):
    """Sets `key` in the backbone config inside a serialized model config."""
    inner = config.get("config", {})
    if isinstance(inner.get("backbone"), dict):
        inner["backbone"].setdefault("config", {})[key] = value
    else:
        inner[key] = value


def _backbone_arguments():
    import inspect

    from keras_vmoe.models import VisionTransformerBackbone

    parameters = inspect.signature(VisionTransformerBackbone.__init__).parameters
    return {
        name
        for name, p in parameters.items()
        if name not in ("self", "dtype") and p.kind is not inspect.Parameter.VAR_KEYWORD
    }


def _load_preset_dir(path, load_weights, architecture, task_overrides):
    config_path = os.path.join(path, CONFIG_FILE)
    config = integrity.read_json_object(config_path)
    registered = str(config.get("registered_name", ""))
    if not registered.startswith("keras_vmoe>"):
        raise ValueError(
            f"{path!r} is not a keras_vmoe preset: {CONFIG_FILE} describes "
            f"{registered or config.get('class_name')!r}, not a `keras_vmoe` model."
        )
    # Registers the keras_vmoe classes for deserialization.
    import keras_vmoe.models  # noqa: F401

    if architecture:
        # Unknown names first: "pass load_weights=False" would not help them.
        valid = _backbone_arguments()
        unknown = sorted(set(architecture) - valid)
        if unknown:
            raise ValueError(
                f"Unknown overrides {unknown}. Valid overrides: "
                f"{sorted(ROUTING_OVERRIDES + TASK_OVERRIDES)}, and with "
                f"load_weights=False the backbone arguments {sorted(valid)}."
            )
        if load_weights:
            raise ValueError(
                f"Architecture overrides {sorted(architecture)} change the weights' "
                "shapes; they need load_weights=False."
            )
        for key, value in architecture.items():
            _set_backbone_option(config, key, value)
    if task_overrides.get("dtype") is not None:
        _set_backbone_option(config, "dtype", task_overrides["dtype"])
    metadata = _verified_metadata(path, config_path, load_weights)
    # The sizes the config asks for, from its numbers alone (nothing built).
    try:
        check_serialized_model(config)
    except ValueError as error:
        raise type(error)(f"{config_path}: {error}") from None
    weights = None
    if load_weights:
        weights = _checked_weights_file(path, config, config_path, metadata)
    model = keras.saving.deserialize_keras_object(config)
    if weights is not None:
        keras.saving.load_weights(
            model, weights, objects_to_skip=_training_state(model)
        )
    return model


_FIX_HINT = (
    "Re-download the preset, or re-convert it (`keras-vmoe convert ... "
    "--overwrite`; for a built-in preset, delete the directory and call "
    "from_preset again)."
)


def _verified_metadata(path, config_path, load_weights):
    """`metadata.json` of a preset, after checking the files it hashes.

    `config.json` (and with `load_weights` the weights file) must match the
    SHA-256 recorded in `metadata.json`; a preset recording no hash of a
    loaded file loads with a `UserWarning` that it is unverified.
    """
    metadata_path = os.path.join(path, METADATA_FILE)
    metadata = (
        integrity.read_json_object(metadata_path)
        if os.path.lexists(metadata_path)
        else None
    )
    integrity.verify_config_hash(config_path, metadata, _FIX_HINT)
    files = {CONFIG_FILE: integrity.CONFIG_HASH_KEY}
    if load_weights:
        files[WEIGHTS_FILE] = integrity.WEIGHTS_HASH_KEY
    integrity.warn_unverified(path, metadata, files)
    return metadata


def _checked_weights_file(path, config, config_path, metadata):
    """The weights file of a preset, checked before the model is built.

    Checks that it is a readable HDF5 file, that its SHA-256 matches the one
    recorded in `metadata.json` (presets saved without hashes load with a
    warning, see `_verified_metadata`) and that it holds exactly the
    variables, with the shapes, of the model `config` describes. Sharded
    weights (`model.weights.json`) are refused: no recorded hash covers them.
    """
    weights = os.path.join(path, WEIGHTS_FILE)
    if not os.path.lexists(weights):
        sharded = os.path.join(path, "model.weights.json")
        if os.path.lexists(sharded):
            raise integrity.PresetIntegrityError(
                f"The preset directory {path!r} holds sharded weights "
                f"(model.weights.json) instead of {WEIGHTS_FILE}. keras_vmoe "
                f"presets store one {WEIGHTS_FILE}, whose SHA-256 metadata.json "
                "records; sharded weights cannot be verified and are not loaded. "
                + _FIX_HINT
            )
        raise FileNotFoundError(
            f"The preset directory {path!r} has no {WEIGHTS_FILE}. Pass "
            "load_weights=False to build the architecture only."
        )
    integrity.check_weights_file(weights)
    integrity.verify_weights_hash(weights, metadata, _FIX_HINT)
    # Always: hashes only say the files are those the publisher wrote.
    integrity.check_weights_match(config, config_path, weights)
    return weights


def _with_image_size(model, image_size):
    """Rebuilds `model` at a new resolution; position embeddings are resized."""
    from keras_vmoe import models

    backbone = getattr(model, "backbone", model)
    if not isinstance(backbone, models.VisionTransformerBackbone):
        raise ValueError(
            "The image_size override needs a VisionTransformerBackbone model. "
            f"Received a {type(backbone).__name__}."
        )
    if _pair(backbone.image_size) == _pair(image_size):
        return model
    config = backbone.get_config()
    config["image_size"] = image_size
    grid = _grid(image_size, backbone.patch_size)
    moe = config.get("moe")
    group_size = (moe or {}).get("group_size")
    old_tokens = backbone.num_tokens
    if group_size and group_size % old_tokens == 0:
        # A group of whole images keeps its number of images.
        new_tokens = grid[0] * grid[1] + int(backbone.classifier == "token")
        config["moe"] = {**moe, "group_size": group_size // old_tokens * new_tokens}
    new_backbone = models.VisionTransformerBackbone.from_config(config)
    new_backbone.load_weights_from(backbone)
    if model is backbone:
        return new_backbone
    task_config = model.get_config()
    task_config["backbone"] = new_backbone
    new_model = type(model)(**task_config)
    _copy_head_weights(model, new_model)
    return new_model


def _pair(value):
    return tuple(value) if isinstance(value, (list, tuple)) else (value, value)


def _grid(image_size, patch_size):
    image_hw, patch_hw = _pair(image_size), _pair(patch_size)
    for size, patch in zip(image_hw, patch_hw, strict=True):
        if size % patch:
            raise ValueError(
                f"`image_size` must be a multiple of the patch size {patch_hw}. "
                f"Received: image_size={image_size}. Valid sizes are e.g. "
                f"{(size // patch) * patch} or {(size // patch + 1) * patch}."
            )
    return image_hw[0] // patch_hw[0], image_hw[1] // patch_hw[1]


def _head_weights(model):
    backbone_ids = {id(v) for v in model.backbone.weights}
    return [v for v in model.weights if id(v) not in backbone_ids]


def _copy_head_weights(source, target):
    src, dst = _head_weights(source), _head_weights(target)
    if len(src) != len(dst):
        raise ValueError(
            f"Cannot copy the head: {len(src)} source weights, {len(dst)} target weights."
        )
    for s, d in zip(src, dst, strict=True):
        if tuple(s.shape) != tuple(d.shape):
            raise ValueError(
                f"Head weight shape mismatch: {s.path} {tuple(s.shape)} vs "
                f"{d.path} {tuple(d.shape)}."
            )
        d.assign(s.value)


def _with_num_classes(model, num_classes, head_bias_init):
    """Puts a new (zero-kernel) head with `num_classes` outputs on the backbone.

    A custom image converter of the task is kept (a copy); the default one is
    rebuilt for the backbone.
    """
    import keras

    backbone = getattr(model, "backbone", model)
    activation = getattr(model, "activation", None)
    converter = None
    if getattr(model, "_custom_image_converter", False):
        converter = keras.layers.deserialize(keras.layers.serialize(model.image_converter))
    kind = (
        "ensemble_classifier"
        if getattr(backbone, "ensemble_size", 1) > 1
        else "classifier"
    )
    return _make_task(
        kind, backbone, num_classes, head_bias_init, activation=activation,
        image_converter=converter,
    )


def _without_pre_logits(model):
    """Rebuilds `model`'s backbone without its `pre_logits` layer.

    Upstream's V-MoE fine-tuning configs set `representation_size=None` and
    do not restore `pre_logits/*` (e.g. `vmoe_s32_last2_ilsvrc2012_randaug_
    light1_ft_ilsvrc2012.py:88,152`); every other weight is copied.
    """
    from keras_vmoe import models

    backbone = getattr(model, "backbone", model)
    if not isinstance(backbone, models.VisionTransformerBackbone):
        raise ValueError(
            "The representation_size=None override needs a VisionTransformerBackbone "
            f"model. Received a {type(backbone).__name__}."
        )
    if not backbone.representation_size:
        return model
    config = backbone.get_config()
    config["representation_size"] = None
    new_backbone = models.VisionTransformerBackbone.from_config(config)
    new_backbone.load_weights_from(backbone)
    if model is backbone:
        return new_backbone
    task_config = model.get_config()
    task_config["backbone"] = new_backbone
    return type(model)(**task_config)


def _apply_overrides(model, routing, task_overrides, rebuild_head):
    if rebuild_head and "representation_size" in task_overrides:
        if "num_classes" not in task_overrides:
            raise ValueError(
                "representation_size=None drops the pre-logits layer the head "
                "was trained on: pass `num_classes` too for a new head (as "
                "upstream's fine-tuning configs do)."
            )
        model = _without_pre_logits(model)
    if (
        rebuild_head
        and "head_bias_init" in task_overrides
        and ("num_classes" not in task_overrides)
    ):
        raise ValueError(
            "`head_bias_init` only applies to a new head: pass `num_classes` too. "
            f"Received: head_bias_init={task_overrides['head_bias_init']!r}"
        )
    if "image_size" in task_overrides and task_overrides["image_size"] is not None:
        model = _with_image_size(model, task_overrides["image_size"])
    if rebuild_head and "num_classes" in task_overrides:
        model = _with_num_classes(
            model,
            task_overrides["num_classes"],
            task_overrides.get("head_bias_init", 0.0),
        )
    if routing:
        target = getattr(model, "backbone", model)
        routing = dict(routing)
        eval_routing = routing.pop("eval_routing", None)
        if routing:
            target.set_routing(**routing)
        if eval_routing:
            target.set_routing(phase="eval", **eval_routing)
    return model


def _record_origin(model, name, overrides, weights):
    object.__setattr__(model, "_keras_vmoe_preset", name)
    object.__setattr__(model, "_keras_vmoe_overrides", _to_jsonable(overrides))
    provenance.record(model, _to_jsonable(weights))


# ----------------------------------------------------------------------
# Handles: hf://, kaggle://, gs:// (tf.io.gfile).
# ----------------------------------------------------------------------


def _download_hf(handle):
    try:
        import huggingface_hub
    except ImportError as error:
        raise ImportError(
            f"Loading {handle!r} needs the `huggingface_hub` package. Install it "
            "with `pip install huggingface_hub` (or `pip install keras-vmoe[hub]`)."
        ) from error
    parts = handle[len("hf://") :].strip("/").split("/")
    if len(parts) < 2 or not all(parts):
        raise ValueError(
            "Hugging Face handles look like 'hf://owner/repo' or "
            f"'hf://owner/repo/subdir'. Received: {handle!r}"
        )
    repo_id, subdir = "/".join(parts[:2]), "/".join(parts[2:])
    local = huggingface_hub.snapshot_download(repo_id=repo_id)
    return os.path.join(local, subdir) if subdir else local


def _download_kaggle(handle):
    try:
        import kagglehub
    except ImportError as error:
        raise ImportError(
            f"Loading {handle!r} needs the `kagglehub` package. Install it with "
            "`pip install kagglehub` (or `pip install keras-vmoe[hub]`)."
        ) from error
    path = handle[len("kaggle://") :].strip("/")
    parts = path.split("/")
    if len(parts) not in (4, 5) or not all(parts) or parts[2] != "keras":
        raise ValueError(
            "Kaggle handles look like 'kaggle://owner/model/keras/variant' or "
            f"'kaggle://owner/model/keras/variant/version'. Received: {handle!r}"
        )
    return kagglehub.model_download(path)


def _import_gfile(what):
    try:
        import tensorflow as tf
    except ImportError as error:
        raise ImportError(
            f"Reading {what!r} needs TensorFlow (tf.io.gfile). Install it with "
            "`pip install 'keras-vmoe[tensorflow]'`, or "
            "copy the files to a local directory first."
        ) from error
    return tf.io.gfile


def _download_gfile(handle, target_dir):
    gfile = _import_gfile(handle)
    if not gfile.exists(handle.rstrip("/") + "/" + CONFIG_FILE):
        raise FileNotFoundError(
            f"{handle!r} is not a preset directory: it has no {CONFIG_FILE}."
        )
    for entry in gfile.listdir(handle):
        entry = entry.rstrip("/")
        source = handle.rstrip("/") + "/" + entry
        if gfile.isdir(source):
            continue
        gfile.copy(source, os.path.join(target_dir, entry), overwrite=True)
    return target_dir


# ----------------------------------------------------------------------
# Released upstream checkpoints.
# ----------------------------------------------------------------------


def _converter(weights_format):
    module_name, function_name = CONVERTERS[weights_format]
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        if getattr(error, "name", None) not in (
            module_name,
            module_name.rsplit(".", 1)[0],
        ):
            raise
        module = None
    function = getattr(module, function_name, None) if module is not None else None
    if function is None:
        raise NotImplementedError(
            f"Converting {weights_format!r} checkpoints needs "
            f"`{module_name}.{function_name}(source, output_dir, preset_name=...)`, "
            "which this installation of keras_vmoe does not provide."
        )
    return function


def _mirror_expected(weights, root):
    _, relative = _bucket_relative(weights["upstream"])
    suffix = ".index" if weights["format"] == "vmoe_partitioned" else ""
    return os.path.join(root, relative + suffix)


def _weights_help(name, entry, reasons):
    weights = entry["weights"]
    upstream = weights["upstream"]
    if weights["format"] == "vmoe_partitioned":
        files = f"{upstream}.index and {upstream}.data-*"
        copy_cmd = f"gsutil -m cp '{upstream}.*' /path/to/mirror/"
    else:
        files = upstream
        copy_cmd = f"gsutil cp '{upstream}' /path/to/mirror/"
    _, relative = _bucket_relative(upstream)
    lines = [
        f"The pretrained weights of preset {name!r} are not available here.",
        f"They come from the upstream checkpoint {upstream} ({files}), which "
        "must be converted to a Keras preset once.",
        *[f"  - {reason}" for reason in reasons],
        "To get the weights, either:",
        f"  1. download the checkpoint (e.g. `{copy_cmd}`, keeping the bucket's "
        f"relative path {relative!r}) and set {CHECKPOINT_ROOT_ENV}=/path/to/mirror; "
        "from_preset then converts it and caches the result in "
        f"{preset_cache_dir(name)};",
        f"  2. or convert it yourself: `keras-vmoe convert --upstream {upstream} "
        f"--preset {name} --output DIR` and load it with from_preset(DIR);",
        "  3. or install TensorFlow (`pip install 'keras-vmoe[tensorflow]'`) so that "
        "gs:// can be read directly.",
        "Pass load_weights=False to build the architecture with random weights.",
    ]
    return "\n".join(lines)


def _fetch_released(name, entry, cache_dir, corrupt=None):
    """Converts a released checkpoint into `cache_dir` (atomically).

    `corrupt`: why the existing cache entry is unusable (it is replaced).
    """
    weights = entry["weights"]
    reasons = [
        f"the cached conversion {cache_dir} is corrupt: {corrupt}"
        if corrupt
        else f"no converted preset in the cache ({cache_dir})"
    ]
    source = None
    root = os.environ.get(CHECKPOINT_ROOT_ENV)
    if root:
        source = _mirror_source(weights, os.path.expanduser(root))
        if source is None:
            reasons.append(
                f"{CHECKPOINT_ROOT_ENV}={root!r} does not hold the checkpoint "
                f"(expected {_mirror_expected(weights, os.path.expanduser(root))})"
            )
    else:
        reasons.append(
            f"{CHECKPOINT_ROOT_ENV} (a local mirror of the bucket) is not set"
        )
    remote = source is None
    if remote:
        try:
            _import_gfile(weights["upstream"])
        except ImportError:
            reasons.append("TensorFlow is not installed, so gs:// cannot be read")
            raise PresetWeightsUnavailableError(
                _weights_help(name, entry, reasons)
            ) from None
        source = weights["upstream"]
    convert = _converter(weights["format"])
    tmp_root = integrity.new_temp_dir(cache_dir)
    try:
        output = os.path.join(tmp_root, "preset")
        try:
            convert(source, output, preset_name=name)
        except (NotImplementedError, KeyboardInterrupt):
            raise
        except Exception as error:
            if not remote:
                raise
            reasons.append(f"reading {source} failed: {type(error).__name__}: {error}")
            raise PresetWeightsUnavailableError(
                _weights_help(name, entry, reasons)
            ) from error
        if not _is_preset_dir(output):
            raise RuntimeError(
                f"The converter for {weights['format']!r} wrote no preset "
                f"({CONFIG_FILE} missing) in {output!r}."
            )
        if corrupt:
            integrity.replace_dir(output, cache_dir)
        else:
            try:
                os.rename(output, cache_dir)
            except OSError:
                if not _is_preset_dir(cache_dir):  # not a concurrent conversion
                    raise
    finally:
        shutil.rmtree(tmp_root, ignore_errors=True)
    return cache_dir


def _load_builtin(name, load_weights, routing, task_overrides, architecture):
    entry = PRESETS[name]
    if not load_weights or entry["weights"] is None:
        if load_weights:
            warnings.warn(
                f"Preset {name!r} has no pretrained weights (no checkpoint of this "
                "model was released): returning a randomly initialised model. Pass "
                "load_weights=False to build the architecture without this warning.",
                UserWarning,
                stacklevel=3,
            )
        else:
            logger.info("Building preset %r without weights.", name)
        if "representation_size" in task_overrides:
            architecture = {**architecture, "representation_size": None}
        model = _build_from_catalog(name, architecture, task_overrides)
        return _apply_overrides(model, routing, {}, rebuild_head=False)
    if architecture:
        from keras_vmoe.models import configs

        valid = configs._backbone_arguments() | set(configs.MOE_OVERRIDES)
        unknown = sorted(set(architecture) - valid)
        if unknown:
            raise ValueError(
                f"Unknown overrides {unknown}. Valid overrides: "
                f"{sorted(ROUTING_OVERRIDES + TASK_OVERRIDES)}, and with "
                f"load_weights=False {sorted(valid - set(ROUTING_OVERRIDES))}."
            )
        raise ValueError(
            f"Architecture overrides {sorted(architecture)} change the weights' "
            f"shapes; they need load_weights=False. Overrides valid with weights: "
            f"{sorted(ROUTING_OVERRIDES + TASK_OVERRIDES)}."
        )
    cache_dir = preset_cache_dir(name)
    integrity.clean_stale_dirs(os.path.dirname(cache_dir))
    corrupt = (
        integrity.preset_problem(cache_dir) if os.path.lexists(cache_dir) else None
    )
    if corrupt:
        logger.warning(
            "The cached preset %s is unusable (%s); converting it again.",
            cache_dir,
            corrupt,
        )
    if corrupt or not _is_preset_dir(cache_dir):
        _fetch_released(name, entry, cache_dir, corrupt=corrupt)
    model = _load_preset_dir(cache_dir, True, {}, task_overrides)
    return _apply_overrides(model, routing, task_overrides, rebuild_head=True)


# ----------------------------------------------------------------------
# from_preset.
# ----------------------------------------------------------------------


def from_preset(name_or_handle, load_weights=True, **overrides):
    """Builds a model from a preset name, directory or handle.

    Args:
        name_or_handle: a built-in preset name or alias (`list_presets()`),
            a local preset directory, `gs://...` (needs TensorFlow),
            `hf://owner/repo[/subdir]` (needs `huggingface_hub`) or
            `kaggle://owner/model/keras/variant[/version]` (needs
            `kagglehub`).
        load_weights: bool. `False` builds the architecture with random
            weights. Built-in presets without released weights always do,
            with a `UserWarning` when `load_weights=True`.
        **overrides:
            - routing, applied with `set_routing` after loading (to both
              the training and the evaluation routing):
              `num_selected_experts`, `capacity_factor`, `batch_priority`,
              `images_per_group` or `group_size` (int or `"all"`); and
              `eval_routing`, a dict of those settings for evaluation only
              (`evaluate`/`predict`; `fit` keeps the training routing);
            - `image_size`: rebuilds the model at this resolution; learned
              position embeddings are resized (bilinear, class token kept)
              and a `group_size` that is a whole number of images keeps its
              number of images;
            - `num_classes` (and `head_bias_init`): a new, zero-initialised
              head for fine-tuning;
            - `representation_size=None` with `num_classes`: drops the
              `pre_logits` layer (tanh) and keeps every other weight, as
              upstream's V-MoE fine-tuning configs do (light1 has one);
            - `dtype`: dtype policy of the model (e.g. `"bfloat16"`,
              `"mixed_bfloat16"`);
            - with `load_weights=False` (or a preset without weights), any
              `keras_vmoe.models.configs.backbone_config` override for
              built-in names (e.g. `hidden_dim`, `num_layers`,
              `num_experts`, `layout`) or backbone argument for
              directories.

    Returns:
        A `keras.Model`: usually an `ImageClassifier` or an
        `EnsembleImageClassifier` (E³), or whatever model the preset
        directory holds.

    Raises:
        ValueError: unknown preset name (with close matches).
        PresetWeightsUnavailableError: the weights of a released checkpoint
            are neither cached, nor in `$KERAS_VMOE_CHECKPOINT_ROOT`, nor
            reachable on gs://.
        keras_vmoe.presets.integrity.PresetIntegrityError: a file differs
            from the SHA-256 recorded in `metadata.json`, the weights do
            not have the shapes `config.json` describes, or a file is
            unreadable (a FIFO, truncated or too deeply nested JSON).
        keras_vmoe.budget.MemoryBudgetError: the config asks for more
            memory than this machine has (see `keras_vmoe.budget`).

    A preset directory whose `metadata.json` records no hash of a file it
    loads gives a `UserWarning` that it is unverified.

    Examples:

    Released weights (a local mirror or gs://, see the module docstring):

    ```
    model = keras_vmoe.presets.from_preset(
        "vmoe_s32_last2_ilsvrc2012_randaug_light1", capacity_factor=1.05)
    finetune = keras_vmoe.presets.from_preset(
        "vmoe_s32_last2_ilsvrc2012_randaug_light1", num_classes=10,
        image_size=384)
    ```

    An architecture with random weights, shrunk by overrides:

    ```python
    import keras_vmoe

    tiny = keras_vmoe.presets.from_preset(
        "vmoe_b32", load_weights=False, hidden_dim=64, num_heads=4,
        mlp_dim=128, num_layers=4, num_experts=4, representation_size=None,
        image_size=64, num_classes=10)
    ```
    """
    overrides = dict(overrides)
    original_overrides = dict(overrides)
    routing, task_overrides, architecture = _split_overrides(overrides)
    if load_weights and "representation_size" in architecture and (
        architecture["representation_size"] is None
    ):
        # Dropping the pre-logits layer keeps every other weight's shape.
        task_overrides["representation_size"] = architecture.pop("representation_size")
    handle = name_or_handle
    if isinstance(handle, os.PathLike):
        handle = os.fspath(handle)
    if not isinstance(handle, str):
        raise ValueError(
            "`name_or_handle` must be a preset name, a directory or a handle "
            f"string. Received: {name_or_handle!r}"
        )
    canonical = resolve_preset_name(handle)
    if canonical is not None:
        model = _load_builtin(
            canonical, load_weights, routing, task_overrides, architecture
        )
        weights = provenance.builtin_record(
            canonical, PRESETS[canonical], load_weights, original_overrides
        )
        _record_origin(model, canonical, original_overrides, weights)
        return model

    cleanup = None
    if handle.startswith("hf://"):
        path = _download_hf(handle)
    elif handle.startswith("kaggle://"):
        path = _download_kaggle(handle)
    elif "://" in handle and not handle.startswith("file://"):
        cleanup = tempfile.mkdtemp(prefix="keras_vmoe_preset-")
        try:
            path = _download_gfile(handle, cleanup)
        except BaseException:
            shutil.rmtree(cleanup, ignore_errors=True)
            raise
    else:
        path = handle[len("file://") :] if handle.startswith("file://") else handle
        path = os.path.expanduser(path)
        integrity.recover_dir(os.path.abspath(path), integrity.is_preset_complete)
        if not os.path.isdir(path):
            if os.path.exists(path):
                raise ValueError(f"{handle!r} is a file, not a preset directory.")
            raise _unknown_preset_error(handle)
    try:
        if not os.path.lexists(os.path.join(path, CONFIG_FILE)):
            raise ValueError(
                f"{path!r} is not a preset directory: it has no {CONFIG_FILE}."
            )
        model = _load_preset_dir(path, load_weights, architecture, task_overrides)
        model = _apply_overrides(model, routing, task_overrides, rebuild_head=True)
        stored = _read_metadata(path)
    finally:
        if cleanup is not None:
            shutil.rmtree(cleanup, ignore_errors=True)
    weights = provenance.directory_record(stored, load_weights, original_overrides)
    _record_origin(model, stored.get("preset_name"), original_overrides, weights)
    _restore_class_names(model, stored.get("class_names"))
    return model


def _restore_class_names(model, names):
    """`model.class_names` from a preset's metadata when they fit its head."""
    if (isinstance(names, list) and all(isinstance(n, str) for n in names)
            and len(names) == getattr(model, "num_classes", None)):
        model.class_names = list(names)


def _read_metadata(path):
    try:
        with open(os.path.join(path, METADATA_FILE)) as f:
            stored = json.load(f)
    except (OSError, ValueError):
        return {}
    return stored if isinstance(stored, dict) else {}


__all__ = [
    "CHECKPOINT_ROOT_ENV",
    "CONFIG_FILE",
    "METADATA_FILE",
    "WEIGHTS_FILE",
    "PresetWeightsUnavailableError",
    "from_preset",
    "get_preset_info",
    "keras_home",
    "list_presets",
    "preset_cache_dir",
    "resolve_preset_name",
    "save_to_preset",
]
