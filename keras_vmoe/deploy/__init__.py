"""Deployment: export to TensorFlow SavedModel / ONNX for serving."""

from keras_vmoe.deploy.export import FORMATS
from keras_vmoe.deploy.export import ExportError
from keras_vmoe.deploy.export import export_model
from keras_vmoe.deploy.export import serving_inputs

__all__ = ["FORMATS", "ExportError", "export_model", "serving_inputs"]
