"""keras_vmoe: Vision Mixture-of-Experts for Keras 3.

The subpackages are imported lazily (PEP 562), so `import keras_vmoe` and the
`keras-vmoe --help` command line stay fast: Keras and JAX are loaded the
first time `keras_vmoe.layers`, `.models`, `.presets`, ... is touched.
"""

import importlib
import os

from keras_vmoe.utils import backend as _backend
from keras_vmoe.utils import keras_registry as _keras_registry
from keras_vmoe.utils import tensorflow_startup as _tensorflow_startup

_backend.choose()
# TensorFlow (the tf.data pipelines, exports, Keras' `set_random_seed`)
# prints start-up notices nobody can act on; errors still show. This level
# hides its XLA service lines; TensorFlow 2.21 prints absl's "All log
# messages before absl::InitializeLog()" line and the oneDNN note anyway,
# so each import of TensorFlow from now on drops those lines from stderr
# (`keras_vmoe.utils.tensorflow_startup`; not with TF_CPP_MIN_LOG_LEVEL=0/1).
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
_tensorflow_startup.quiet_imports()

__version__ = "0.3.0"

_SUBMODULES = (
    "conversion",
    "data",
    "deploy",
    "distribution",
    "evaluation",
    "formats",
    "layers",
    "models",
    "preprocessing",
    "presets",
    "training",
    "utils",
)
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


# `keras.saving.load_model` finds keras_vmoe's classes after `import
# keras_vmoe` alone: Keras' registry imports the modules defining them when
# it first meets a `keras_vmoe>` name (nothing is imported now).
_keras_registry.register_lazily("keras_vmoe", _register_all)


def __dir__():
    return sorted(set(globals()) | set(_SUBMODULES))
