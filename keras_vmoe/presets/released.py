"""Released upstream checkpoints of built-in presets: fetch and convert once.

The upstream files are read from a local mirror of the bucket given by
`$KERAS_VMOE_CHECKPOINT_ROOT`, else from `gs://` when TensorFlow is
installed, converted with `keras_vmoe.presets.convert` and cached in
`<keras home>/keras_vmoe/<name>/`.
"""

import logging
import os
import shutil

from keras_vmoe.catalog.names import CHECKPOINT_ROOT_ENV
from keras_vmoe.catalog.names import CONFIG_FILE
from keras_vmoe.catalog.names import bucket_relative as _bucket_relative
from keras_vmoe.catalog.names import is_preset_dir as _is_preset_dir
from keras_vmoe.catalog.names import mirror_source as _mirror_source
from keras_vmoe.catalog.names import preset_cache_dir
from keras_vmoe.presets import convert as preset_convert
from keras_vmoe.presets import integrity
from keras_vmoe.presets.handles import _import_gfile

logger = logging.getLogger(__name__)


class PresetWeightsUnavailableError(FileNotFoundError):
    """The weights of a built-in preset cannot be found or fetched.

    The message ends with `RANDOM_WEIGHTS_HINT`, how to go on without the
    weights from Python; the command line puts its own flag there.
    """

    RANDOM_WEIGHTS_HINT = ("Pass load_weights=False to build the architecture "
                           "with random weights.")


# Converter per upstream weight format (a function of
# `keras_vmoe.presets.convert`), called as `function(source, output_dir,
# preset_name=name)`; it writes a preset directory at `output_dir`. `source`
# is a local path or a gs:// URL.
CONVERTERS = {
    "vmoe_partitioned": "convert_to_preset",
    "vit_npz": "convert_vit_npz_to_preset",
}


def _converter(weights_format):
    """The function converting released checkpoints of `weights_format`."""
    return getattr(preset_convert, CONVERTERS[weights_format])


def _mirror_expected(weights, root):
    _, relative = _bucket_relative(weights["upstream"])
    suffix = ".index" if weights["format"] == "vmoe_partitioned" else ""
    return os.path.join(root, relative + suffix)


def _weights_help(name, entry, reasons, tensorflow_missing=True):
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
        f"--preset {name} --output DIR` and load it with from_preset(DIR)"
        + (";" if tensorflow_missing else "."),
        *(["  3. or install TensorFlow (`pip install 'keras-vmoe[tensorflow]'`) so "
           "that gs:// can be read directly."] if tensorflow_missing else []),
        PresetWeightsUnavailableError.RANDOM_WEIGHTS_HINT,
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
                _weights_help(name, entry, reasons, tensorflow_missing=False)
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
