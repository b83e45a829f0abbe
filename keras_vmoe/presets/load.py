"""Loading presets: `from_preset` and `get_preset_info`.

`from_preset` takes a built-in name or alias, a local preset directory, or a
`gs://`, `hf://` or `kaggle://` handle; timm, transformers and KerasHub ViTs
are converted on load (`hub_vits`), released checkpoints once (`released`).
"""

import contextlib
import copy
import json
import logging
import os
import shutil
import tempfile
import warnings

import keras

import keras_vmoe.layers  # noqa: F401
import keras_vmoe.models  # noqa: F401
import keras_vmoe.preprocessing  # noqa: F401
from keras_vmoe import models
from keras_vmoe.catalog import ALIASES
from keras_vmoe.catalog import PRESETS
from keras_vmoe.catalog.names import CONFIG_FILE
from keras_vmoe.catalog.names import is_preset_dir as _is_preset_dir
from keras_vmoe.catalog.names import preset_cache_dir
from keras_vmoe.catalog.names import resolve_preset_name
from keras_vmoe.catalog.names import unknown_preset_error as _unknown_preset_error
from keras_vmoe.models import backbone_config
from keras_vmoe.models import configs
from keras_vmoe.models.configs import ROUTING_OVERRIDES
from keras_vmoe.models.size_estimate import check_serialized_model
from keras_vmoe.presets import hub_vits
from keras_vmoe.presets import integrity
from keras_vmoe.presets import provenance
from keras_vmoe.presets import quantization
from keras_vmoe.presets.handles import _download_gfile
from keras_vmoe.presets.handles import _download_hf
from keras_vmoe.presets.handles import _download_kaggle
from keras_vmoe.presets.overrides import TASK_OVERRIDES
from keras_vmoe.presets.overrides import _apply_overrides
from keras_vmoe.presets.overrides import _backbone_arguments
from keras_vmoe.presets.overrides import _backbone_copy
from keras_vmoe.presets.overrides import _record_origin
from keras_vmoe.presets.overrides import _set_backbone_option
from keras_vmoe.presets.overrides import _split_overrides
from keras_vmoe.presets.overrides import new_head_bias_init
from keras_vmoe.presets.overrides import task_copy
from keras_vmoe.presets.released import _fetch_released
from keras_vmoe.presets.save import METADATA_FILE
from keras_vmoe.presets.save import WEIGHTS_FILE
from keras_vmoe.presets.save import _training_state
from keras_vmoe.utils import initialization
from keras_vmoe.utils import keras_registry
from keras_vmoe.utils import memory_budget
from keras_vmoe.utils.backend import host_array

logger = logging.getLogger(__name__)


def get_preset_info(name):
    """A copy of a built-in preset's catalog entry, with its `name` and `aliases`.

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


def catalog_backbone_config(entry, architecture=None, image_size=None, dtype=None):
    """The backbone arguments of a catalog entry, with `architecture` overrides."""
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


@initialization.batched_build  # backbone and head drawn in one XLA program
def _build_from_catalog(name, architecture, task_overrides):
    entry = PRESETS[name]
    size, dtype = task_overrides.get("image_size"), task_overrides.get("dtype")
    config = catalog_backbone_config(entry, architecture, size, dtype)
    for key in ("remat", "scan"):  # settings that keep the weights
        if task_overrides.get(key) is not None:
            config[key] = task_overrides[key]
    backbone = models.VisionTransformerBackbone(**config)
    task = entry["task"]
    task_class = keras.saving.get_registered_object(f"keras_vmoe>{task['class']}")
    num_classes = task_overrides.get("num_classes", task["num_classes"])
    if "num_classes" in task_overrides:  # a new head, as upstream's fine-tuning
        head_bias_init = new_head_bias_init(task_overrides)
    else:
        head_bias_init = task_overrides.get(
            "head_bias_init", task.get("head_bias_init", 0.0))
    return task_class(backbone, num_classes=num_classes, head_bias_init=head_bias_init)


def _load_preset_dir(path, load_weights, architecture, task_overrides):
    config_path = os.path.join(path, CONFIG_FILE)
    config = integrity.read_json_object(config_path)
    registered = str(config.get("registered_name", ""))
    if not registered.startswith("keras_vmoe>"):
        raise ValueError(
            f"{path!r} is not a keras_vmoe preset: {CONFIG_FILE} describes "
            f"{registered or config.get('class_name')!r}, not a `keras_vmoe` model.")
    if architecture:  # unknown names first: load_weights=False would not help them
        valid = _backbone_arguments()
        unknown = sorted(set(architecture) - valid)
        if unknown:
            raise ValueError(
                f"Unknown overrides {unknown}. Valid overrides: "
                f"{sorted(ROUTING_OVERRIDES + TASK_OVERRIDES)}, and with "
                f"load_weights=False the backbone arguments {sorted(valid)}.")
        if load_weights:
            raise ValueError(
                f"Architecture overrides {sorted(architecture)} change the weights' "
                "shapes; they need load_weights=False.")
        for key, value in architecture.items():
            _set_backbone_option(config, key, value)
    for key in ("dtype", "remat", "scan"):  # settings that keep the weights
        if task_overrides.get(key) is not None:
            _set_backbone_option(config, key, task_overrides[key])
    metadata = _verified_metadata(path, config_path, load_weights)
    quantized = quantization.pop_record(config, config_path)
    # The sizes the config asks for, from its numbers alone (nothing built).
    try:
        check_serialized_model(config)
    except ValueError as error:
        raise type(error)(f"{config_path}: {error}") from None
    _refuse_foreign_objects(config, config_path)
    _check_backbone_arguments(config, config_path)
    weights = finish_hash = None
    shapes_checked = False
    if load_weights:
        weights = _weights_file(path)
        if memory_budget.large_allowed() and not quantized:
            # Past the memory budget: shapes checked on an abstract build first.
            shapes_checked = True
            integrity.check_weights_match(config, config_path, weights)
        finish_hash = integrity.start_weights_hash(weights, metadata, _FIX_HINT)
    # Weights come from the file: placeholders, not initializers, until loaded.
    scope = (initialization.skip_initializers() if load_weights
             else contextlib.nullcontext())
    with scope as skipped:
        try:
            model = keras.saving.deserialize_keras_object(config)
            if quantized:  # int8 layers exist only after `quantize`
                quantization.apply(model, quantized, config_path)
            if weights is not None:
                if not shapes_checked:  # hashes only say who wrote the files
                    integrity.check_weights_match(config, config_path, weights, model)
                if quantized:
                    quantization.check_weights(model, config, config_path, weights)
                keras.saving.load_weights(
                    model, weights, objects_to_skip=_training_state(model)
                )
        finally:
            if finish_hash is not None:  # hashed meanwhile; a mismatch raises
                finish_hash()
    if skipped is not None:
        skipped.check_assigned(model, source=weights)
    if weights is not None:
        _check_finite_weights(model, weights)
    return model


def _refuse_foreign_objects(config, config_path):
    """Refuses objects from outside Keras and keras_vmoe, naming the JSON field."""
    stack = [(config, "$")]
    while stack:
        node, where = stack.pop()
        if isinstance(node, list):
            stack += [(v, f"{where}[{i}]") for i, v in enumerate(node)]
            continue
        if not isinstance(node, dict):
            continue
        module = node.get("module")
        ours = isinstance(module, str) and (module in ("keras", "keras_vmoe") or (
            module.startswith(("keras.", "keras_vmoe."))))
        registered = node.get("registered_name")
        registered = registered if isinstance(registered, str) else ""
        problem = None
        if node.get("class_name") == "__lambda__":
            problem = "a Python lambda (code)"
        elif module is not None and not ours:
            problem = f"an object of module {module!r}"
        elif ">" in registered and not registered.startswith("keras_vmoe>"):
            problem = f"a custom object {registered!r} of another package"
        elif registered.startswith("keras_vmoe>") and not _is_registered(registered):
            problem = (f"the class {registered!r}, which keras_vmoe does not have "
                       "(a misspelt name, or a preset of a newer version)")
        elif node.get("class_name") == "function" and not (
                isinstance(module, str) and module.startswith("keras.")):
            problem = f"a function of module {module!r}"
        if problem:
            raise integrity.PresetIntegrityError(
                f"{config_path}: field {where} holds {problem}; a keras_vmoe preset "
                "holds only Keras and keras_vmoe objects. Refusing to load it.")
        stack += [(v, f"{where}.{k}") for k, v in node.items()]


def _is_registered(registered_name):
    """Whether `keras_vmoe>Name` is one of the package's serializable classes."""
    try:
        return keras.saving.get_registered_object(registered_name) is not None
    except keras_registry.UnknownClassError:  # a keras_vmoe> name it does not define
        return False


def _check_backbone_arguments(config, config_path):
    """Refuses a backbone config holding arguments the backbone does not take."""
    inner = config.get("config")
    backbone = inner.get("backbone") if isinstance(inner, dict) else None
    if not (isinstance(backbone, dict) and backbone.get("class_name")
            == "VisionTransformerBackbone" and isinstance(backbone.get("config"), dict)):
        return
    valid = _backbone_arguments() | {"name", "trainable", "dtype", "remat", "scan"}
    unknown = sorted(str(k) for k in set(backbone["config"]) - valid)
    if unknown:
        raise integrity.PresetIntegrityError(
            f"{config_path}: the backbone config holds unknown argument(s) {unknown}; "
            f"VisionTransformerBackbone takes {sorted(valid)}. The file was edited "
            "or written by another program.")


def _check_finite_weights(model, path):
    """Refuses loaded float weights (int8 models' too) holding NaN or infinity."""
    import numpy as np

    chunk = 1 << 20  # values checked at a time: no copy of a whole weight
    for variable in model.weights:
        if not keras.backend.is_float_dtype(variable.dtype):
            continue
        flat = host_array(variable.value).reshape(-1)
        for start in range(0, flat.size, chunk):
            values = flat[start:start + chunk].astype("float32", copy=False)
            if not np.isfinite(values).all():
                raise integrity.PresetIntegrityError(
                    f"{path}: weight {variable.path} holds NaN or infinite values; "
                    f"the preset is corrupt. {_FIX_HINT}")


_FIX_HINT = (
    "Re-download the preset, or re-convert it (`keras-vmoe convert ... "
    "--overwrite`; for a built-in preset, delete the directory and call "
    "from_preset again).")


def _verified_metadata(path, config_path, load_weights):
    """`metadata.json` of a preset once the config hash is checked (None if absent)."""
    metadata_path = os.path.join(path, METADATA_FILE)
    metadata = (integrity.read_json_object(metadata_path)
                if os.path.lexists(metadata_path) else None)
    integrity.verify_config_hash(config_path, metadata, _FIX_HINT)
    files = {CONFIG_FILE: integrity.CONFIG_HASH_KEY}
    if load_weights:
        files[WEIGHTS_FILE] = integrity.WEIGHTS_HASH_KEY
    integrity.warn_unverified(path, metadata, files)
    return metadata


def _weights_file(path):
    """The checked HDF5 weights file of a preset directory (sharded ones refused)."""
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
            "load_weights=False to build the architecture only.")
    integrity.check_weights_file(weights)
    return weights


def _load_builtin(name, load_weights, routing, task_overrides, architecture,
                  verbose="auto"):
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
        valid = configs._backbone_arguments() | set(configs.MOE_OVERRIDES)
        unknown = sorted(set(architecture) - valid)
        if unknown:
            raise ValueError(
                f"Unknown overrides {unknown}. Valid overrides: "
                f"{sorted(ROUTING_OVERRIDES + TASK_OVERRIDES)}, and with "
                f"load_weights=False {sorted(valid - set(ROUTING_OVERRIDES))}.")
        raise ValueError(
            f"Architecture overrides {sorted(architecture)} change the weights' "
            f"shapes; they need load_weights=False. Overrides valid with weights: "
            f"{sorted(ROUTING_OVERRIDES + TASK_OVERRIDES)}.")
    cache_dir = preset_cache_dir(name)
    integrity.clean_stale_dirs(os.path.dirname(cache_dir))
    corrupt = (integrity.preset_problem(cache_dir)
               if os.path.lexists(cache_dir) else None)
    if corrupt:
        logger.warning("The cached preset %s is unusable (%s); converting it again.",
                       cache_dir, corrupt)
    if corrupt or not _is_preset_dir(cache_dir):
        _fetch_released(name, entry, cache_dir, corrupt=corrupt, verbose=verbose)
    model = _load_preset_dir(cache_dir, True, {}, task_overrides)
    return _apply_overrides(model, routing, task_overrides, rebuild_head=True)


def from_preset(name_or_handle, load_weights=True, verbose="auto", **overrides):
    """Builds a model from a preset name, directory or handle.

    Args:
        name_or_handle: a built-in preset name or alias (`list_presets()`),
            a local preset directory, `gs://...` (needs TensorFlow),
            `hf://owner/repo[/subdir]` (needs `huggingface_hub`) or
            `kaggle://owner/model/keras/variant[/version]` (needs
            `kagglehub`). A timm, transformers or KerasHub ViT (handle or
            saved directory) loads with the source's logits (no
            architecture overrides; its `hf://` needs no `huggingface_hub`).
        load_weights: bool. `False` builds the architecture with random
            weights, as built-in presets without released weights always do
            (with a `UserWarning` when `load_weights=True`).
        verbose: download progress of released weights: `"auto"` (on a
            terminal), `1` (always) or `0` (never).
        **overrides:
            - routing, set (for training and evaluation) after loading:
              `num_selected_experts`, `capacity_factor`, `batch_priority`,
              `images_per_group` or `group_size` (int or `"all"`), and
              `eval_routing`, a dict of those for `evaluate`/`predict` only;
            - `image_size`: rebuilds the model at this resolution (position
              embeddings resized bilinearly, class token kept; a
              `group_size` of whole images keeps its number of images);
            - `num_classes` (and `head_bias_init`, default
              `-log(num_classes)` as upstream's fine-tuning): a new head,
              kernel zeros;
            - `representation_size=None` with `num_classes`: drops the
              `pre_logits` layer, keeping every other weight;
            - `dtype`: dtype policy (e.g. `"bfloat16"`, `"mixed_bfloat16"`);
            - `remat`, `scan`: bool, rematerialised or scanned encoder
              blocks (see `VisionTransformerBackbone`);
            - with `load_weights=False` (or a preset without weights), any
              `keras_vmoe.models.configs.backbone_config` override for
              built-in names (e.g. `hidden_dim`, `num_layers`,
              `num_experts`, `layout`) or backbone argument for directories.

    Returns:
        A `keras.Model`, usually an `ImageClassifier` or an
        `EnsembleImageClassifier`.

    Raises:
        ValueError: unknown preset name (with close matches).
        PresetWeightsUnavailableError: released weights neither cached, in
            `$KERAS_VMOE_CHECKPOINT_ROOT`, nor downloadable.
        keras_vmoe.presets.integrity.PresetIntegrityError: a file differs
            from the SHA-256 in `metadata.json`, the weights do not have the
            shapes `config.json` describes, or a file is unreadable. A
            preset recording no hash of a loaded file loads with a
            `UserWarning`.
        keras_vmoe.utils.memory_budget.MemoryBudgetError: the config asks
            for more memory than this machine has.

    Examples:

    Released weights (downloaded over HTTPS, or from a mirror):

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
    if verbose not in ("auto", 0, 1) or isinstance(verbose, float):
        raise ValueError(
            f"`verbose` must be 'auto', 0 or 1. Received: verbose={verbose!r}")
    original_overrides = dict(overrides)
    routing, task_overrides, architecture = _split_overrides(overrides)
    if load_weights and architecture.get("representation_size", 0) is None:
        # Dropping the pre-logits layer keeps every other weight's shape.
        task_overrides["representation_size"] = architecture.pop("representation_size")
    handle = name_or_handle
    if isinstance(handle, os.PathLike):
        handle = os.fspath(handle)
    if not isinstance(handle, str):
        raise ValueError(
            "`name_or_handle` must be a preset name, a directory or a handle "
            f"string. Received: {name_or_handle!r}")
    canonical = resolve_preset_name(handle)
    if canonical is not None:
        model = _load_builtin(canonical, load_weights, routing, task_overrides,
                              architecture, verbose)
        weights = provenance.builtin_record(canonical, PRESETS[canonical], load_weights,
                                            original_overrides)
        _record_origin(model, canonical, original_overrides, weights)
        return model

    cleanup = None
    source = None
    if handle.startswith("hf://"):
        fetched = hub_vits.fetch_hf(handle, verbose=verbose)
        path, source = fetched if fetched else (_download_hf(handle), None)
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
                f"{path!r} is not a preset directory: it has no {CONFIG_FILE}.")
        source = source or hub_vits.source_of_directory(path)
        if source is not None:  # a timm, transformers or KerasHub ViT
            model = _load_hub_vit(path, source, handle, load_weights, architecture,
                                  task_overrides)
            stored = {"weights": {"kind": source, "handle": handle}}
        else:
            model = _load_preset_dir(path, load_weights, architecture, task_overrides)
            stored = _read_metadata(path)
        model = _apply_overrides(model, routing, task_overrides, rebuild_head=True)
    finally:
        if cleanup is not None:
            shutil.rmtree(cleanup, ignore_errors=True)
    weights = provenance.directory_record(stored, load_weights, original_overrides)
    _record_origin(model, stored.get("preset_name"), original_overrides, weights)
    _restore_class_names(model, stored.get("class_names"))
    return model


def class_from_preset(cls, preset, load_weights=True, **overrides):
    """`cls` built from a preset: `Backbone.from_preset` and `Task.from_preset`."""
    if issubclass(cls, models.Backbone):
        given = sorted(set(overrides) & {"num_classes", "head_bias_init"})
        if given:
            raise ValueError(
                f"A backbone has no classification head: {given} do not apply to "
                f"{cls.__name__}.from_preset. Received: "
                + ", ".join(f"{k}={overrides[k]!r}" for k in given)
            )
        model = from_preset(preset, load_weights=load_weights, **overrides)
        backbone = getattr(model, "backbone", model)
        if not isinstance(backbone, cls):
            raise ValueError(f"Preset {preset!r} holds a {type(backbone).__name__}, "
                             f"not a {cls.__name__}.")
        return backbone
    model = from_preset(preset, load_weights=load_weights, **overrides)
    if isinstance(model, models.Backbone):
        raise ValueError(
            f"Preset {preset!r} is a backbone without a head: pass "
            f"`num_classes=...` to build a {cls.__name__} with a new head.")
    if not isinstance(model, cls):
        raise ValueError(
            f"Preset {preset!r} is a {type(model).__name__}, not a {cls.__name__}: "
            f"load it with {type(model).__name__}.from_preset(...) or "
            "keras_vmoe.presets.from_preset(...).")
    return model


def _load_hub_vit(path, source, handle, load_weights, architecture, task_overrides):
    """A timm, transformers or KerasHub ViT checkpoint as a keras_vmoe model."""
    if architecture:
        raise ValueError(
            f"{handle!r} is a {source} checkpoint: its architecture comes from its "
            f"config. Received architecture overrides {sorted(architecture)}; valid "
            f"overrides: {sorted(ROUTING_OVERRIDES + TASK_OVERRIDES)}.")
    model = hub_vits.load_directory(path, source, load_weights, where=handle)
    settings = {key: task_overrides[key] for key in ("remat", "scan", "dtype")
                if task_overrides.get(key) is not None}  # settings that keep the weights
    if not settings:
        return model
    backbone = getattr(model, "backbone", model)
    new_backbone = _backbone_copy(backbone, {**backbone.get_config(), **settings})
    return new_backbone if model is backbone else task_copy(model, new_backbone)


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
