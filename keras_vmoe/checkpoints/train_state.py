"""Deprecated path of `keras_vmoe.formats.train_state` (this name is that module)."""

import importlib
import sys

sys.modules[__name__] = importlib.import_module("keras_vmoe.formats.train_state")
