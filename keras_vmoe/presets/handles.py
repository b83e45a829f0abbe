"""Remote preset handles: `hf://`, `kaggle://` and `gs://` (tf.io.gfile).

Each downloads a preset directory to a local folder; the optional
packages (huggingface_hub, kagglehub, TensorFlow) are imported lazily.
"""

import os

from keras_vmoe.catalog.names import CONFIG_FILE


def _check_handle_parts(handle, parts):
    """Refuses `.` and `..` (a folder outside the repository) in a hub handle."""
    bad = [part for part in parts if part in (".", "..")]
    if bad:
        raise ValueError(
            f"A hub handle names a repository and a folder inside it: its parts "
            f"cannot be {bad[0]!r}. Received: {handle!r}")


def hf_parts(handle, name=None):
    """`(repo_id, subdir)` of `hf://owner/repo[/subdir]` (checked; `name`:
    the argument the messages name)."""
    parts = handle[len("hf://") :].strip("/").split("/")
    if len(parts) < 2 or not all(parts):
        received = f"{name}={handle!r}" if name else repr(handle)
        raise ValueError(
            "Hugging Face handles look like 'hf://owner/repo' or "
            f"'hf://owner/repo/subdir'. Received: {received}")
    _check_handle_parts(handle, parts)
    return "/".join(parts[:2]), "/".join(parts[2:])


def missing_client(module, action, handle):
    """The `ImportError` of a missing hub client, saying how to install it."""
    return ImportError(
        f"{action} {handle!r} needs the `{module}` package. Install it with "
        f"`pip install {module}` (or `pip install 'keras-vmoe[hub]'`).")


def _download_hf(handle):
    repo_id, subdir = hf_parts(handle)
    try:
        import huggingface_hub
    except ImportError as error:
        raise missing_client("huggingface_hub", "Loading", handle) from error
    local = huggingface_hub.snapshot_download(repo_id=repo_id)
    return os.path.join(local, subdir) if subdir else local


def _download_kaggle(handle):
    path = handle[len("kaggle://") :].strip("/")
    parts = path.split("/")
    if len(parts) not in (4, 5) or not all(parts) or parts[2] != "keras":
        raise ValueError(
            "Kaggle handles look like 'kaggle://owner/model/keras/variant' or "
            f"'kaggle://owner/model/keras/variant/version'. Received: {handle!r}")
    _check_handle_parts(handle, parts)
    try:
        import kagglehub
    except ImportError as error:
        raise missing_client("kagglehub", "Loading", handle) from error
    return kagglehub.model_download(path)


def _download_gfile(handle, target_dir):
    try:
        import tensorflow as tf
    except ImportError as error:
        raise ImportError(
            f"Reading {handle!r} needs TensorFlow (tf.io.gfile). Install it with "
            "`pip install 'keras-vmoe[tensorflow]'`, or "
            "copy the files to a local directory first."
        ) from error
    gfile = tf.io.gfile
    if not gfile.exists(handle.rstrip("/") + "/" + CONFIG_FILE):
        raise FileNotFoundError(
            f"{handle!r} is not a preset directory: it has no {CONFIG_FILE}.")
    for entry in gfile.listdir(handle):
        entry = entry.rstrip("/")
        source = handle.rstrip("/") + "/" + entry
        if gfile.isdir(source):
            continue
        gfile.copy(source, os.path.join(target_dir, entry), overwrite=True)
    return target_dir
