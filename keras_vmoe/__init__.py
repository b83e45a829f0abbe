"""keras_vmoe: Vision Mixture-of-Experts for Keras 3.

The subpackages are imported lazily (PEP 562), so `import keras_vmoe` and the
`keras-vmoe --help` command line stay fast: Keras and JAX are loaded the
first time `keras_vmoe.layers`, `.models`, `.presets`, ... is touched.
"""

import importlib
import os

from keras_vmoe.utils import backend as _backend
from keras_vmoe.utils import registration as _registration

_backend.choose()
# TensorFlow (the tf.data pipelines) prints start-up notices nobody can act
# on unless told otherwise before it is imported; errors still show.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

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


# A `.keras` file of a keras_vmoe model loads after `import keras_vmoe` alone.
_registration.install(_register_all)


def __dir__():
    return sorted(set(globals()) | set(_SUBMODULES))
