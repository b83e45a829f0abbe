"""keras_vmoe: Vision Mixture-of-Experts for Keras 3.

The subpackages are imported lazily (PEP 562), so `import keras_vmoe` and the
`keras-vmoe --help` command line stay fast: Keras and JAX are loaded the
first time `keras_vmoe.layers`, `.models`, `.presets`, ... is touched.
"""

import importlib
import importlib.util
import os
import sys
import warnings

from keras_vmoe.utils import keras_registry
from keras_vmoe.utils import tensorflow_startup


def _choose_backend():
    """JAX unless chosen otherwise; a warning when Keras already picked one.

    Keras reads `KERAS_BACKEND` once, when it is first imported. Imported
    first without it, Keras picks the backend of `~/.keras/keras.json`
    (TensorFlow by default), and keras_vmoe runs on that backend: every
    layer, model and preset works there, but the JAX-only features do not
    (see `keras_vmoe.backend_support`), so say which backend runs.
    """
    keras = sys.modules.get("keras")
    if "KERAS_BACKEND" in os.environ or keras is None or not hasattr(keras, "config"):
        if "KERAS_BACKEND" not in os.environ:
            _warn_failed_keras_import()
        os.environ.setdefault("KERAS_BACKEND", "jax")
        _check_installed(os.environ["KERAS_BACKEND"])
        return
    chosen = keras.config.backend()
    os.environ["KERAS_BACKEND"] = chosen  # subprocesses follow this process
    if chosen != "jax":
        warnings.warn(
            f"keras was imported before keras_vmoe without KERAS_BACKEND and "
            f"picked the {chosen!r} backend: keras_vmoe runs on {chosen!r}, not "
            "on its default 'jax'. To choose, set KERAS_BACKEND (jax, torch or "
            "tensorflow) before Python starts, or import keras_vmoe before keras.",
            UserWarning,
            stacklevel=3,
        )


def _configured_backend():
    """`(backend, path)` named by Keras' `keras.json`, or `(None, path)`."""
    import json

    home = os.environ.get("KERAS_HOME") or os.path.join(
        os.path.expanduser("~"), ".keras")
    path = os.path.join(home, "keras.json")
    try:
        with open(path) as file:
            backend = json.load(file).get("backend")
    except (OSError, ValueError, AttributeError):
        return None, path
    return (backend if isinstance(backend, str) else None), path


def _warn_failed_keras_import():
    """Says why an earlier `import keras` failed and what runs now.

    Without `KERAS_BACKEND`, Keras takes the backend of `keras.json`
    (TensorFlow by default); when that backend is not installed, `import
    keras` fails (`No module named 'tensorflow'`) and leaves only parts of
    Keras in `sys.modules`. keras_vmoe imported next chooses JAX, so Keras
    imports from then on: say so once.
    """
    if not any(name.startswith("keras.src") for name in sys.modules):
        return  # Keras was never imported
    backend, path = _configured_backend()
    if backend not in _BACKEND_PACKAGES or backend == "jax":
        return
    module = _BACKEND_PACKAGES[backend][0]
    if importlib.util.find_spec(module) is not None:
        return
    warnings.warn(
        f"An earlier `import keras` failed: {path} names the {backend!r} backend, "
        f"which is not installed ({module!r}). keras_vmoe chose JAX for this process "
        "(KERAS_BACKEND=jax), so `import keras` works from now on. To choose, set "
        "KERAS_BACKEND (jax, torch or tensorflow) before Python starts, edit "
        f"{path}, or import keras_vmoe before keras.",
        UserWarning,
        stacklevel=4,
    )


# The package each backend needs, and how to install it.
_BACKEND_PACKAGES = {
    "jax": ("jax", "pip install keras-vmoe"),
    "torch": ("torch", "pip install 'keras-vmoe[torch]' (or a torch build of your choice)"),
    "tensorflow": ("tensorflow", "pip install tensorflow-cpu"),
}


def _check_installed(backend):
    """A clear `ImportError` instead of Keras' `No module named 'torch'`."""
    if backend not in _BACKEND_PACKAGES:
        return  # Keras itself names the valid backends.
    module, install = _BACKEND_PACKAGES[backend]
    if module in sys.modules:
        found = sys.modules[module] is not None
    else:
        found = importlib.util.find_spec(module) is not None
    if not found:
        error = ImportError(
            f"KERAS_BACKEND={backend} but {module!r} is not installed. Install it "
            f"({install}) or choose another backend: KERAS_BACKEND=jax (the "
            "default), torch or tensorflow."
        )
        # `keras-vmoe ...` and `python -m keras_vmoe.cli` import this package
        # before the command line can catch anything: one error line there.
        if sys.argv[:1] == ["-m"] or os.path.basename(sys.argv[0]) == "keras-vmoe":
            print(f"error: {error}", file=sys.stderr)
            raise SystemExit(1)
        raise error


_choose_backend()
# TensorFlow (the tf.data pipelines, exports, Keras' `set_random_seed`)
# prints start-up notices nobody can act on; errors still show. This level
# hides its XLA service lines; TensorFlow 2.21 prints absl's "All log
# messages before absl::InitializeLog()" line and the oneDNN note anyway,
# so each import of TensorFlow from now on drops those lines from stderr
# (`keras_vmoe.utils.tensorflow_startup`; not with TF_CPP_MIN_LOG_LEVEL=0/1).
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
tensorflow_startup.quiet_imports()

__version__ = "0.3.0"

# `keras.saving.load_model` finds keras_vmoe's classes after `import
# keras_vmoe` alone: Keras' registry imports the modules defining them when
# it first meets a `keras_vmoe>` name (nothing is imported now).
keras_registry.register_lazily("keras_vmoe", (
    "keras_vmoe.models", "keras_vmoe.training.recipes", "keras_vmoe.training.schedules"))

_SUBMODULES = (
    "conversion",
    "data",
    "deploy",
    "distribution",
    "evaluation",
    "formats",
    "layers",
    "malloc_tuning",
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
