"""Loading timm, transformers and KerasHub ViTs: `hf://` downloads and directories.

`fetch_hf` downloads an `hf://` checkpoint's config first (an inexpressible
one is refused before its weights are fetched), caching the files under
`<keras home>/keras_vmoe_hub/hf/`; `load_directory` builds the model (the
mapping itself is `keras_vmoe.conversion.hub_vits`).
"""

import os

import keras
import numpy as np

from keras_vmoe import models
from keras_vmoe.catalog.names import CONFIG_FILE
from keras_vmoe.catalog.names import keras_home
from keras_vmoe.conversion import hub_vits
from keras_vmoe.formats import remote
from keras_vmoe.preprocessing.image_converter import ImageConverter
from keras_vmoe.presets import integrity
from keras_vmoe.presets.handles import hf_parts
from keras_vmoe.presets.released import _ByteProgress
from keras_vmoe.presets.released import _download
from keras_vmoe.utils import initialization

DEFAULT_ENDPOINT = "https://huggingface.co"


def _extra_config(path, source):
    """transformers' preprocessor config or KerasHub's task config, if present."""
    name = {"transformers": hub_vits.HF_PREPROCESSOR_FILE,
            "keras_hub": "task.json"}.get(source)
    if name and os.path.isfile(os.path.join(path, name)):
        return integrity.read_json_object(os.path.join(path, name))
    return None


def source_of_directory(path):
    """The library whose checkpoint the directory `path` holds, or `None`."""
    try:  # checked reading; its errors come from the preset path
        config = integrity.read_json_object(os.path.join(path, CONFIG_FILE))
    except (OSError, ValueError):
        return None
    return hub_vits.detect_source(config)


def load_directory(path, source, load_weights=True, where=None):
    """The `source` checkpoint in directory `path` as an `ImageClassifier`
    (with a classification head) or a `VisionTransformerBackbone`."""
    where = where or path
    config = integrity.read_json_object(os.path.join(path, CONFIG_FILE))
    spec = hub_vits.read_spec(source, config, _extra_config(path, source), where)
    if not load_weights:
        return _build(spec)
    required, _ = hub_vits.weight_files(source)
    for name in required:
        if not os.path.isfile(os.path.join(path, name)):
            raise FileNotFoundError(
                f"{where}: the {source} checkpoint has no {name} in {path!r}. "
                "Pass load_weights=False to build the architecture only.")
    weights = hub_vits.read_weights(path, spec)  # may set representation_size
    with initialization.skip_initializers() as skipped:
        model = _build(spec)
        _assign(model, weights, where)
    skipped.check_assigned(model, source=where)
    return model


def _build(spec):
    backbone = models.VisionTransformerBackbone(**spec.backbone)
    if not spec.num_classes:
        return backbone
    preprocessor = None
    if spec.interpolation != "bilinear":
        preprocessor = models.ImageClassifierPreprocessor(ImageConverter(
            backbone.image_size, interpolation=spec.interpolation, name="image_converter"))
    model = models.ImageClassifier(backbone, num_classes=spec.num_classes,
                                   activation=spec.activation, preprocessor=preprocessor)
    if spec.class_names:
        model.class_names = list(spec.class_names)
    return model


def _assign(model, weights, where):
    weights = dict(weights)
    for variable in model.weights:
        path = variable.path
        if path not in weights:
            raise ValueError(f"{where}: the checkpoint has no weight for `{path}`.")
        value = weights.pop(path)
        shape = tuple(variable.shape)
        value = np.zeros(shape, "float32") if value is None else np.asarray(value)
        if value.shape != shape:
            raise ValueError(
                f"{where}: weight `{path}` has shape {value.shape} in the checkpoint "
                f"and {shape} in the model its config describes.")
        variable.assign(value.astype(keras.backend.standardize_dtype(variable.dtype)))
    unused = sorted(k for k, v in weights.items() if v is not None)
    if unused:
        raise ValueError(f"{where}: checkpoint weights {unused} have no place in "
                         "the model.")


def hf_cache_dir(handle):
    """The local folder of an `hf://` handle's files."""
    repo, subdir = hf_parts(handle)
    return os.path.join(keras_home(), "keras_vmoe_hub", "hf", *repo.split("/"),
                        *(subdir.split("/") if subdir else ()))


def _fetch(handle, name, target, required=True, verbose="auto"):
    """`target/name` from the cache, else downloaded; `None` if optional and missing."""
    local = os.path.join(target, name)
    if os.path.isfile(local):
        return local
    repo, subdir = hf_parts(handle)
    endpoint = os.environ.get("HF_ENDPOINT", DEFAULT_ENDPOINT).rstrip("/")
    url = f"{endpoint}/{repo}/resolve/main/{subdir + '/' if subdir else ''}{name}"
    offline_help = (
        f"To load it offline, put the repository's files ({CONFIG_FILE}, "
        f"{hub_vits.SAFETENSORS_FILE}, ...) in a directory and pass that directory "
        f"to from_preset, or copy them into {target}.")
    offline = os.environ.get("HF_HUB_OFFLINE", "").strip().lower()
    if offline in ("1", "true", "yes", "on"):
        if not required:
            return None
        raise FileNotFoundError(
            f"{handle}: {name} is not in the cache ({target}) and HF_HUB_OFFLINE is "
            f"set. {offline_help}")
    try:
        stat = remote.remote_stat(url)
        progress = (_ByteProgress(stat.size, f"{handle}/{name}", verbose)
                    if stat.size > 2**20 else None)
        return _download(url, local, stat, progress)
    except remote.RemoteNotFoundError:
        if not required:
            return None
        raise FileNotFoundError(
            f"{handle}: the repository has no {name} ({url}), or it is private or "
            "gated. keras_vmoe reads timm and transformers ViTs saved as "
            f"{hub_vits.SAFETENSORS_FILE}.") from None
    except remote.RemoteUnreachableError as error:
        raise remote.RemoteUnreachableError(
            f"{handle}: {name} is not in the cache ({target}) and {endpoint} cannot "
            f"be reached ({error}). {offline_help}") from None


def fetch_hf(handle, verbose="auto"):
    """`(directory, source)` of a timm/transformers `hf://` checkpoint, else `None`
    (refused before the weights are downloaded if keras_vmoe cannot express it)."""
    target = hf_cache_dir(handle)
    config_path = _fetch(handle, CONFIG_FILE, target, verbose=verbose)
    config = integrity.read_json_object(config_path)
    source = hub_vits.detect_source(config)
    if source in (None, "keras_hub"):  # KerasHub: a whole-folder download
        return None
    required, optional = hub_vits.weight_files(source)
    for name in optional:
        _fetch(handle, name, target, required=False, verbose=verbose)
    hub_vits.read_spec(source, config, _extra_config(target, source), handle)
    for name in required:
        _fetch(handle, name, target, verbose=verbose)
    return target, source
