"""keras_vmoe: Vision Mixture-of-Experts for Keras 3."""

import os

os.environ.setdefault("KERAS_BACKEND", "jax")

from keras_vmoe import layers  # noqa: E402
from keras_vmoe import models  # noqa: E402
from keras_vmoe import presets  # noqa: E402

__version__ = "0.1.0"
__all__ = ["layers", "models", "presets", "__version__"]
