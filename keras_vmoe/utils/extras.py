"""Optional dependencies: import them, or say which extra to install."""

import importlib

# The extra of pyproject.toml that installs each optional top-level module.
EXTRAS = {
    "tensorflow": ("tensorflow", "tensorflow"),
    "tensorflow_datasets": ("tensorflow-datasets", "data"),
    "torch": ("torch", "torch"),
    "skimage": ("scikit-image", "demo"),
    "sklearn": ("scikit-learn", None),
    "orbax": ("orbax-checkpoint", "orbax"),
    "huggingface_hub": ("huggingface_hub", "hub"),
    "kagglehub": ("kagglehub", "hub"),
}


class MissingDependencyError(ImportError):
    """An optional dependency is not installed; the message says how to add it."""


def install_hint(module):
    """`pip install 'keras-vmoe[EXTRA]'` for a top-level module name."""
    top = module.split(".")[0]
    package, extra = EXTRAS.get(top, (top, None))
    if extra is None:
        return f"pip install {package}"
    return f"pip install 'keras-vmoe[{extra}]' (or: pip install {package})"


def require(module, needed_for):
    """Imports `module`, or raises `MissingDependencyError` naming the extra.

    `needed_for` says what needs it (e.g. `"tf.data pipelines"`).

    Examples:

    ```python
    from keras_vmoe.utils.extras import require

    np = require("numpy", "everything")
    ```
    """
    try:
        return importlib.import_module(module)
    except ImportError as error:
        top = module.split(".")[0]
        package = EXTRAS.get(top, (top,))[0]
        raise MissingDependencyError(
            f"{needed_for} needs {package}, which is not installed or does not "
            f"import ({type(error).__name__}: {error}). Install it with: "
            f"{install_hint(module)}") from error


def available(module):
    """True when `module` imports (without raising for a missing one)."""
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True
