"""Deprecated path: the converter's names by their old address.

`keras_vmoe.checkpoints.convert` mixed reading, name mapping, building,
validation, writing presets and the command line. They now live in
`keras_vmoe.formats.upstream` (reading), `keras_vmoe.conversion` (name map,
building, validation), `keras_vmoe.presets.convert` (writing presets) and
`keras_vmoe.cli.convert_cmd` (command line).
"""


from keras_vmoe.cli.convert_cmd import build_parser
from keras_vmoe.cli.convert_cmd import run as main
from keras_vmoe.conversion.build import build_model_from_upstream
from keras_vmoe.conversion.build import preset_for_upstream
from keras_vmoe.conversion.build import routing_from_preset
from keras_vmoe.conversion.infer import ConversionError
from keras_vmoe.conversion.infer import RoutingSettings
from keras_vmoe.conversion.validate import ValidationError
from keras_vmoe.conversion.validate import validate
from keras_vmoe.conversion.weights import WeightAssignment
from keras_vmoe.conversion.weights import conversion_plan
from keras_vmoe.conversion.weights import keras_path_for
from keras_vmoe.formats.upstream import iter_upstream_params
from keras_vmoe.formats.upstream import load_upstream_params
from keras_vmoe.formats.upstream import read_upstream_shapes
from keras_vmoe.formats.upstream import resolve_upstream
from keras_vmoe.presets.convert import convert_to_preset
from keras_vmoe.presets.convert import convert_vit_npz_to_preset
from keras_vmoe.utils.deprecation import warn_renamed

__all__ = [
    "ConversionError",
    "RoutingSettings",
    "ValidationError",
    "WeightAssignment",
    "build_model_from_upstream",
    "build_parser",
    "conversion_plan",
    "convert_to_preset",
    "convert_vit_npz_to_preset",
    "iter_upstream_params",
    "keras_path_for",
    "load_upstream_params",
    "main",
    "preset_for_upstream",
    "read_upstream_shapes",
    "resolve_upstream",
    "routing_from_preset",
    "validate",
]

warn_renamed(__name__, "keras_vmoe.conversion and keras_vmoe.presets.convert_to_preset",
             stacklevel=2)
