"""Deployment: export to TensorFlow SavedModel / ONNX, and int8 weights."""

from keras_vmoe.deploy.export import FORMATS
from keras_vmoe.deploy.export import ExportError
from keras_vmoe.deploy.export import export_model
from keras_vmoe.deploy.export import serving_inputs
from keras_vmoe.deploy.quantize import int8_plan
from keras_vmoe.deploy.quantize import quantize_model

__all__ = ["FORMATS", "ExportError", "export_model", "serving_inputs", "int8_plan",
           "quantize_model"]
