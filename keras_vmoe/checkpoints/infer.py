"""Deprecated path of `keras_vmoe.conversion.infer` (this name is that module)."""

import importlib
import sys

sys.modules[__name__] = importlib.import_module("keras_vmoe.conversion.infer")
