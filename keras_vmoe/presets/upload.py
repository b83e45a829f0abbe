"""Uploading a preset to Hugging Face (`hf://`) or Kaggle (`kaggle://`).

`upload_preset(uri, preset)` has KerasHub's name and behaviour; the clients
(the `[hub]` extra) are imported only here.
"""

import os

from keras_vmoe.catalog.names import CONFIG_FILE
from keras_vmoe.presets import integrity
from keras_vmoe.presets.handles import _check_handle_parts
from keras_vmoe.presets.handles import hf_parts
from keras_vmoe.presets.handles import missing_client

PRESET_FILES = (CONFIG_FILE, "metadata.json", "model.weights.h5")

_HINT = ("Upload the directory written by save_to_preset or `keras-vmoe convert` "
         "as it is (re-save or re-convert it if it was changed).")


def check_uploadable(preset):
    """Returns the path of the preset directory `preset` once checked complete and
    unaltered (`ValueError`, `PresetIntegrityError` otherwise)."""
    path = os.fspath(preset)
    if not os.path.isdir(path):
        raise ValueError(
            f"`preset` must be a local preset directory. Received: preset={preset!r} "
            "(not a directory).")
    missing = [f for f in PRESET_FILES if not os.path.isfile(os.path.join(path, f))]
    if missing:
        raise ValueError(
            f"{path} is not a complete preset: {', '.join(missing)} missing "
            f"(a preset holds {', '.join(PRESET_FILES)}). {_HINT}")
    metadata = integrity.read_json_object(os.path.join(path, "metadata.json"))
    unrecorded = [key for key in (integrity.CONFIG_HASH_KEY, integrity.WEIGHTS_HASH_KEY)
                  if not metadata.get(key)]
    if unrecorded:
        raise integrity.PresetIntegrityError(
            f"{path}: metadata.json records no {', '.join(unrecorded)}, so the files "
            "cannot be checked before upload. Load it and save it again with "
            "save_to_preset to record them.")
    integrity.read_json_object(os.path.join(path, CONFIG_FILE))
    integrity.verify_config_hash(os.path.join(path, CONFIG_FILE), metadata, _HINT)
    weights = os.path.join(path, "model.weights.h5")
    integrity.check_weights_file(weights)
    integrity.verify_weights_hash(weights, metadata, _HINT)
    return path


def _kaggle_target(uri):
    handle = uri[len("kaggle://"):].strip("/")
    parts = handle.split("/")
    if len(parts) != 4 or not all(parts) or parts[2] != "keras":
        raise ValueError(
            "Kaggle upload handles look like 'kaggle://owner/model/keras/variant' "
            f"(no version: Kaggle numbers it). Received: uri={uri!r}")
    _check_handle_parts(uri, parts)
    return handle


def upload_preset(uri, preset):
    """Uploads a preset directory to Hugging Face or Kaggle Models.

    The preset is checked first (complete, config and weights unaltered),
    then uploaded as it is: `hf://` through `huggingface_hub` (a public model
    repository is created if needed; `huggingface-cli login` or `$HF_TOKEN`
    authenticates), `kaggle://` through `kagglehub.model_upload` (a new
    version; `kagglehub.login()` or `$KAGGLE_USERNAME` / `$KAGGLE_KEY`
    authenticates). `from_preset(uri)` loads it back.

    Args:
        uri: `hf://owner/repo[/subdir]` or `kaggle://owner/model/keras/variant`.
        preset: a local preset directory, as written.

    Returns:
        `uri`.

    Raises:
        ValueError: a malformed `uri`, or an incomplete preset.
        keras_vmoe.presets.PresetIntegrityError: the preset was altered.
        ImportError: the client package is not installed.

    Example:

    ```
    keras_vmoe.presets.upload_preset("hf://me/vmoe-s32-light1", "./vmoe_s32_light1")
    ```
    """
    if not isinstance(uri, str) or not uri.startswith(("hf://", "kaggle://")):
        raise ValueError(
            "`uri` must start with 'hf://' (Hugging Face) or 'kaggle://' (Kaggle "
            f"Models). Received: uri={uri!r}")
    if uri.startswith("hf://"):
        repo_id, subdir = hf_parts(uri, name="uri")
        path = check_uploadable(preset)
        try:
            import huggingface_hub as hub
        except ImportError as error:
            raise missing_client("huggingface_hub", "Uploading to", uri) from error
        hub.create_repo(repo_id, repo_type="model", exist_ok=True)
        hub.upload_folder(repo_id=repo_id, folder_path=path,
                          path_in_repo=subdir or None, repo_type="model",
                          commit_message="Upload a keras_vmoe preset")
    else:
        handle = _kaggle_target(uri)
        path = check_uploadable(preset)
        try:
            import kagglehub
        except ImportError as error:
            raise missing_client("kagglehub", "Uploading to", uri) from error
        kagglehub.model_upload(handle, path)
    return uri
