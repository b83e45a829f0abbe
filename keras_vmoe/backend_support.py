"""Which Keras backend runs, and the features that need JAX.

The layers, models, presets, conversion, `predict`, `evaluate` and `fit`
run on the JAX, PyTorch and TensorFlow backends. A few features are built on
JAX itself and refuse the other backends with `JaxOnlyError`, which names
the backend in use and what to do instead:

- `keras_vmoe.distribution` layouts and meshes (`keras.distribution` with
  expert sharding is implemented for JAX only),
- multi-host launch (`keras_vmoe.distribution.initialize`/`launch`, which
  start `jax.distributed`),
- `keras_vmoe.distribution.memory_plan` (XLA's compiled memory analysis),
- the XLA:CPU malloc tuning of `keras_vmoe.malloc_tuning`.

This module does not import Keras: the allocator runs before any backend
starts. When Keras is not imported yet, the backend is the one Keras will
pick (`KERAS_BACKEND`, which `import keras_vmoe` sets to `"jax"` when unset).

Examples:

>>> backend() in ("jax", "torch", "tensorflow", "numpy", "openvino")
True
"""

import os
import sys

_SELECT = (
    "select it with KERAS_BACKEND=jax before Python starts (or before the "
    "first `import keras`)"
)


# What to use instead of the JAX-only features, on the other backends.
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
        # `keras.distribution.list_devices` has no PyTorch implementation
        # (Keras 3.15); Keras puts PyTorch tensors on CUDA when it is there.
        import torch

        return "gpu" if torch.cuda.is_available() else "cpu"
    import keras

    devices = keras.distribution.list_devices()
    return devices[0].split(":")[0].lower() if devices else "cpu"


def require_jax(feature, alternative):
    """Raises `JaxOnlyError` unless the JAX backend runs.

    Args:
        feature: what was asked for (e.g. `"keras_vmoe.distribution.make_mesh"`).
        alternative: what to use on the other backends.

    Raises:
        JaxOnlyError: naming the feature, the backend in use, the
            alternative and how to select JAX.
    """
    name = backend()
    if name != "jax":
        raise JaxOnlyError(
            f"{feature} needs the JAX backend, but Keras runs on {name!r} "
            f"(KERAS_BACKEND={name}). {alternative} To use it, {_SELECT}."
        )
