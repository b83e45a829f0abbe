"""Deprecated module path: the preset functions by their old address.

`keras_vmoe.presets.api` held saving, loading, remote handles, overrides
and convert-on-load in one module. They now live in `presets.save`,
`presets.load`, `presets.handles`, `presets.overrides`, `presets.released`
and `presets.convert`; import them from `keras_vmoe.presets`. This module
re-exports the public names for code written against the old path, with
a `DeprecationWarning`.
"""


from keras_vmoe.catalog.names import CHECKPOINT_ROOT_ENV
from keras_vmoe.catalog.names import CONFIG_FILE
from keras_vmoe.catalog.names import keras_home
from keras_vmoe.catalog.names import preset_cache_dir
from keras_vmoe.catalog.names import resolve_preset_name
from keras_vmoe.presets.load import from_preset
from keras_vmoe.presets.load import get_preset_info
from keras_vmoe.presets.released import PresetWeightsUnavailableError
from keras_vmoe.presets.save import METADATA_FILE
from keras_vmoe.presets.save import WEIGHTS_FILE
from keras_vmoe.presets.save import local_directory
from keras_vmoe.presets.save import save_to_preset
from keras_vmoe.presets.table import list_presets
from keras_vmoe.utils.deprecation import warn_renamed

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
    "local_directory",
    "preset_cache_dir",
    "resolve_preset_name",
    "save_to_preset",
]

warn_renamed(__name__, "keras_vmoe.presets", stacklevel=2)
