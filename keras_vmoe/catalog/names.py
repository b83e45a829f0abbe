"""Preset names and where their weights live, without importing Keras (so
`keras-vmoe presets` and `list_presets()` stay fast)."""

import difflib
import os

from keras_vmoe.catalog import ALIASES
from keras_vmoe.catalog import PRESETS

CONFIG_FILE = "config.json"
CHECKPOINT_ROOT_ENV = "KERAS_VMOE_CHECKPOINT_ROOT"


def _normalize(name):
    return name.strip().lower().replace("-", "_")


# Lower-cased names and aliases -> catalog name.
_LOOKUP = {
    **{_normalize(name): name for name in PRESETS},
    **{_normalize(alias): target for alias, target in ALIASES.items()},
}


def resolve_preset_name(name):
    """The catalog name of a built-in preset name or alias, or `None`.

    Matching ignores case, surrounding spaces and `-` versus `_`.

    Args:
        name: a preset name or alias.

    Returns:
        The catalog name, or `None` when `name` is no built-in preset.

    Examples:

    >>> resolve_preset_name("VMOE_S32")
    'vmoe_s32_last2'
    >>> resolve_preset_name("not_a_preset") is None
    True
    """
    if not isinstance(name, str):
        return None
    return _LOOKUP.get(_normalize(name))


def suggest_preset_names(name, n=5):
    """Built-in names and aliases close to `name` (case-insensitive).

    Examples:

    >>> suggest_preset_names("vmoe_s23")[0]
    'vmoe_s32'
    """
    key = _normalize(str(name))
    by_key = {_normalize(n): n for n in [*sorted(PRESETS), *sorted(ALIASES)]}
    # Names holding every part of `name` first (shortest first), then the
    # names spelled close to it.
    parts = set(key.split("_")) - {""}
    holding = sorted((k for k in by_key if len(parts) > 1 and parts <= set(k.split("_"))),
                     key=lambda k: (len(k), k))
    close = difflib.get_close_matches(key, list(by_key), n=n, cutoff=0.6)
    found = list(dict.fromkeys([*holding, *close]))[:n]
    return [by_key[k] for k in found]


def unknown_preset_error(handle):
    """A `ValueError` for an unknown preset, with close matches."""
    close = suggest_preset_names(handle)
    hint = f" Did you mean: {', '.join(close)}?" if close else ""
    return ValueError(
        f"Unknown preset {handle!r}: it is neither a built-in preset name nor an "
        "existing local preset directory, nor a handle such as "
        "'hf://owner/repo', 'kaggle://owner/model/keras/variant' or "
        f"'gs://bucket/dir'.{hint} Call keras_vmoe.presets.list_presets() "
        "(or run `keras-vmoe presets`) to see all built-in presets.")


def keras_home():
    """The Keras cache directory: `$KERAS_HOME`, else `~/.keras` (as Keras)."""
    home = os.environ.get("KERAS_HOME")
    if home:
        return os.path.expanduser(home)
    home = os.path.expanduser(os.path.join("~", ".keras"))
    if not os.access(os.path.dirname(home), os.W_OK):  # Keras' own fallback
        home = os.path.join("/tmp", ".keras")
    return home


def preset_cache_dir(name=None):
    """`<keras home>/keras_vmoe[/<name>]`: where converted presets are cached."""
    root = os.path.join(keras_home(), "keras_vmoe")
    if name is None:
        return root
    return os.path.join(root, resolve_preset_name(name) or name)


def is_preset_dir(path):
    return os.path.isfile(os.path.join(path, CONFIG_FILE))


def bucket_relative(url):
    """`gs://bucket/a/b` -> (`bucket`, `a/b`)."""
    rest = url.split("://", 1)[1]
    bucket, _, relative = rest.partition("/")
    return bucket, relative


def mirror_source(weights, root):
    """The local copy of `weights["upstream"]` under a mirror root, or None."""
    bucket, relative = bucket_relative(weights["upstream"])
    suffix = ".index" if weights["format"] == "vmoe_partitioned" else ""
    for candidate in (os.path.join(root, relative),
                      os.path.join(root, bucket, relative),
                      os.path.join(root, os.path.basename(relative))):
        if os.path.isfile(candidate + suffix):
            return candidate
    return None


def weights_location(name):
    """Where a built-in preset's weights are: `"here"` (in the cache or the local
    mirror), `"downloadable"` (on first use) or `"none"` (architecture only)."""
    canonical = resolve_preset_name(name)
    if canonical is None:
        raise unknown_preset_error(name)
    weights = PRESETS[canonical]["weights"]
    if weights is None:
        return "none"
    if is_preset_dir(preset_cache_dir(canonical)):
        return "here"
    root = os.environ.get(CHECKPOINT_ROOT_ENV)
    if root and mirror_source(weights, os.path.expanduser(root)) is not None:
        return "here"
    return "downloadable"
