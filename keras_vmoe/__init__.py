"""keras_vmoe: Vision Mixture-of-Experts for Keras 3.

Subpackages are imported lazily (PEP 562): Keras and JAX load on first use.
"""

import importlib
import os

from keras_vmoe.utils import backend as _backend
from keras_vmoe.utils import keras_registry as _keras_registry
from keras_vmoe.utils import tensorflow_startup as _tensorflow_startup

_backend.choose()
# TensorFlow's start-up notices are hidden (errors still show); the lines
# this level misses are dropped by `tensorflow_startup` on each import.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
_tensorflow_startup.quiet_imports()

__version__ = "0.3.0"

_SUBMODULES = ("conversion", "data", "deploy", "distribution", "evaluation", "formats",
               "layers", "models", "preprocessing", "presets", "training", "utils")
__all__ = [*_SUBMODULES, "__version__"]


def __getattr__(name):
    if name in _SUBMODULES:
        module = importlib.import_module(f"keras_vmoe.{name}")
        globals()[name] = module
        return module
    raise AttributeError(f"module 'keras_vmoe' has no attribute {name!r}")


def _register_all():
    """Imports the subpackages whose modules define every serializable class."""
    for name in ("models", "training"):
        __getattr__(name)


# `keras.saving.load_model` imports the defining modules on the first
# `keras_vmoe>` name it meets.
_keras_registry.register_lazily("keras_vmoe", _register_all)


def __dir__():
    return sorted(set(globals()) | set(_SUBMODULES))
