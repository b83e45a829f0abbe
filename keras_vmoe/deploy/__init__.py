"""Deployment: export to TensorFlow SavedModel / ONNX, and int8 weights."""

from keras_vmoe._lazy import deprecated_exports
from keras_vmoe.deploy.export import FORMATS
from keras_vmoe.deploy.export import ExportError
from keras_vmoe.deploy.export import export_model
from keras_vmoe.deploy.export import serving_inputs
from keras_vmoe.deploy.quantize import int8_plan
from keras_vmoe.deploy.quantize import quantize_model

__all__ = ["FORMATS", "ExportError", "export_model", "serving_inputs", "int8_plan",
           "quantize_model"]

# Names that left this package's face: they live in their modules, and
# reaching them here warns until 0.4.0.
__getattr__ = deprecated_exports(__name__, {
    "weight_bytes": "keras_vmoe.deploy.quantize",
})
