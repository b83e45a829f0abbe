"""Which Keras backend runs: choosing it, and the features that need JAX.

`choose()` follows Keras' order (`KERAS_BACKEND`, `keras.json`, then JAX)
before Keras loads; JAX-only features raise `JaxOnlyError`. Imports no Keras.

>>> backend() in ("jax", "torch", "tensorflow", "numpy", "openvino")
True
"""

import contextlib
import importlib.util
import json
import os
import sys
import warnings

DISTRIBUTION_ALTERNATIVE = (
    "On PyTorch and TensorFlow, run on one device (the default) or wrap the "
    "model in the backend's own data parallelism (torch.distributed, "
    "tf.distribute)."
)
MEMORY_PLAN_ALTERNATIVE = (
    "On PyTorch and TensorFlow, estimate the weights' memory with "
    "`keras_vmoe.models.size_estimate.backbone_sizes` and measure a step with the "
    "backend's profiler."
)
ALLOCATOR_ALTERNATIVE = (
    "The malloc settings were measured for XLA:CPU only; PyTorch and "
    "TensorFlow manage their own buffers, so there is nothing to tune."
)


class JaxOnlyError(RuntimeError):
    """A JAX-only feature was used with another Keras backend."""


def backend():
    """The Keras backend of this process (`"jax"`, `"torch"`, ...)."""
    keras = sys.modules.get("keras")
    if keras is not None and hasattr(keras, "config"):
        return keras.config.backend()
    return os.environ.get("KERAS_BACKEND", "jax")


def compute_platform():
    """Platform of the first device the backend computes on (`"cpu"`, `"gpu"`, ...)."""
    if backend() == "torch":
        # Keras' `list_devices` has no PyTorch implementation.
        import torch

        return "gpu" if torch.cuda.is_available() else "cpu"
    import keras

    devices = keras.distribution.list_devices()
    return devices[0].split(":")[0].lower() if devices else "cpu"


def host_array(value):
    """A tensor's values as a read-only NumPy array (no copy for JAX on CPU)."""
    import keras
    import numpy as np

    if backend() == "jax":
        return np.asarray(value)
    return keras.ops.convert_to_numpy(value)


def require_jax(feature, alternative):
    """Raises `JaxOnlyError` unless the JAX backend runs; `feature` names what
    was asked for, `alternative` what to use on the other backends."""
    name = backend()
    if name != "jax":
        raise JaxOnlyError(
            f"{feature} needs the JAX backend, but Keras runs on {name!r} "
            f"(KERAS_BACKEND={name}). {alternative} To use it, select it with "
            "KERAS_BACKEND=jax before Python starts (or before the first "
            "`import keras`)."
        )


_BACKEND_PACKAGES = {
    "jax": ("jax", "pip install keras-vmoe"),
    "torch": ("torch", "pip install 'keras-vmoe[torch]' (or a torch build of your choice)"),
    "tensorflow": ("tensorflow", "pip install tensorflow-cpu"),
    "numpy": ("numpy", "pip install numpy"),
    "openvino": ("openvino", "pip install openvino"),
}


def keras_config_path():
    """The path of Keras' `keras.json` (`$KERAS_HOME` or `~/.keras`)."""
    home = os.environ.get("KERAS_HOME") or os.path.join(os.path.expanduser("~"), ".keras")
    return os.path.join(home, "keras.json")


def _configured_backend(path):
    """The backend `keras.json` names, None if none, False without the file."""
    try:
        with open(path) as file:
            backend = json.load(file).get("backend")
    except FileNotFoundError:
        return False
    except (OSError, ValueError, AttributeError):
        return None
    return backend if isinstance(backend, str) else None


def _installed(backend):
    module = _BACKEND_PACKAGES[backend][0]
    if module in sys.modules:
        return sys.modules[module] is not None
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _write_default_config(path):
    """Writes Keras' default `keras.json` naming JAX, atomically, if it can."""
    config = {"floatx": "float32", "epsilon": 1e-07, "backend": "jax",
              "image_data_format": "channels_last"}
    partial = f"{path}.{os.getpid()}.tmp"
    with contextlib.suppress(OSError):
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(partial, "w") as file:
                json.dump(config, file, indent=4)
            os.link(partial, path)  # fails when another process wrote it first
        finally:
            os.remove(partial)


def _check_installed(backend):
    """A clear `ImportError` instead of Keras' `No module named 'torch'`."""
    if backend not in _BACKEND_PACKAGES or _installed(backend):
        return  # Keras itself names the valid backends.
    module, install = _BACKEND_PACKAGES[backend]
    error = ImportError(
        f"KERAS_BACKEND={backend} but {module!r} is not installed. Install it "
        f"({install}) or choose another backend: KERAS_BACKEND=jax (the "
        "default), torch or tensorflow."
    )
    # The command line imports this before it can catch anything.
    if sys.argv[:1] == ["-m"] or os.path.basename(sys.argv[0]) == "keras-vmoe":
        print(f"error: {error}", file=sys.stderr)
        raise SystemExit(1)
    raise error


def choose():
    """Chooses the Keras backend before Keras loads, as Keras would.

    Sets `KERAS_BACKEND` (for child processes too); warns when `keras.json`
    names a backend that is not installed.

    Returns:
        str, the backend's name.
    """
    keras = sys.modules.get("keras")
    if keras is not None and hasattr(keras, "config"):
        chosen = keras.config.backend()
        os.environ["KERAS_BACKEND"] = chosen
        return chosen
    if "KERAS_BACKEND" in os.environ:
        _check_installed(os.environ["KERAS_BACKEND"])
        return os.environ["KERAS_BACKEND"]
    path = keras_config_path()
    configured = _configured_backend(path)
    chosen = "jax"
    if configured is False:
        _write_default_config(path)
    elif configured in _BACKEND_PACKAGES and _installed(configured):
        chosen = configured
    elif configured is not None:
        module = _BACKEND_PACKAGES.get(configured, (configured,))[0]
        failed = any(name.startswith("keras.src") for name in sys.modules)
        warnings.warn(
            f"{path} names the {configured!r} backend, which is not installed "
            f"({module!r}){': an earlier `import keras` failed' if failed else ''}. "
            "keras_vmoe chose JAX for this process (KERAS_BACKEND=jax), so "
            "`import keras` works from now on. To choose, set KERAS_BACKEND (jax, "
            f"torch or tensorflow) before Python starts or edit {path}.",
            UserWarning,
            stacklevel=3,
        )
    os.environ["KERAS_BACKEND"] = chosen
    return chosen
