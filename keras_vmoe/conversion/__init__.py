"""Upstream parameter trees -> keras_vmoe models (names, architecture, routing).

Reading files is `keras_vmoe.formats`; writing a preset is `keras_vmoe.presets`.
"""

from keras_vmoe.conversion.build import build_model_from_upstream
from keras_vmoe.conversion.build import preset_for_upstream
from keras_vmoe.conversion.build import routing_from_preset
from keras_vmoe.conversion.build import routing_from_upstream_config
from keras_vmoe.conversion.infer import ConversionError
from keras_vmoe.conversion.infer import infer_architecture
from keras_vmoe.conversion.validate import ValidationError
from keras_vmoe.conversion.validate import validate

__all__ = [
    "ConversionError",
    "ValidationError",
    "build_model_from_upstream",
    "infer_architecture",
    "preset_for_upstream",
    "routing_from_preset",
    "routing_from_upstream_config",
    "validate",
]
