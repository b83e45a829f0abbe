"""Upstream parameter trees -> keras_vmoe models (names, architecture, routing).

* `infer`: the architecture from the parameter shapes; routing settings.
* `weights`: the name map (upstream path -> Keras weight) and the loading
  plan.
* `build`: `build_model_from_upstream`, routing of the catalog's released
  configs and of upstream config dicts.
* `validate`: a converted model against reference outputs.

Reading files is `keras_vmoe.formats`; writing a preset directory is
`keras_vmoe.presets.convert` (`convert_to_preset`).
"""

from keras_vmoe.conversion.build import build_model_from_upstream
from keras_vmoe.conversion.build import preset_for_upstream
from keras_vmoe.conversion.build import routing_from_preset
from keras_vmoe.conversion.build import routing_from_upstream_config
from keras_vmoe.conversion.infer import ConversionError
from keras_vmoe.conversion.infer import RoutingSettings
from keras_vmoe.conversion.infer import UpstreamArchitecture
from keras_vmoe.conversion.infer import infer_architecture
from keras_vmoe.conversion.validate import ValidationError
from keras_vmoe.conversion.validate import validate
from keras_vmoe.conversion.weights import WeightAssignment
from keras_vmoe.conversion.weights import conversion_plan
from keras_vmoe.conversion.weights import keras_path_for

__all__ = [
    "ConversionError",
    "RoutingSettings",
    "UpstreamArchitecture",
    "ValidationError",
    "WeightAssignment",
    "build_model_from_upstream",
    "conversion_plan",
    "infer_architecture",
    "keras_path_for",
    "preset_for_upstream",
    "routing_from_preset",
    "routing_from_upstream_config",
    "validate",
]
