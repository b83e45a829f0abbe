"""keras_vmoe: Vision Mixture-of-Experts for Keras 3.

The subpackages are imported lazily (PEP 562), so `import keras_vmoe` and the
`keras-vmoe --help` command line stay fast: Keras and JAX are loaded the
first time `keras_vmoe.layers`, `.models`, `.presets`, ... is touched.
"""

import importlib
import os

os.environ.setdefault("KERAS_BACKEND", "jax")
# TensorFlow (the tf.data pipelines) prints start-up notices nobody can act
# on ("All log messages before absl::InitializeLog()", CPU-feature and oneDNN
# notes) unless told otherwise before it is imported; errors still show.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

__version__ = "0.2.0"

_SUBMODULES = (
    "allocator",
    "checkpoints",
    "data",
    "deploy",
    "distribution",
    "evaluation",
    "layers",
    "models",
    "preprocessing",
    "presets",
    "training",
)
__all__ = [*_SUBMODULES, "__version__"]


def __getattr__(name):
    if name in _SUBMODULES:
        module = importlib.import_module(f"keras_vmoe.{name}")
        globals()[name] = module
        return module
    raise AttributeError(f"module 'keras_vmoe' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_SUBMODULES))
