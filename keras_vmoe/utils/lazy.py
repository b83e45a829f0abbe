"""Lazy package faces (PEP 562): names imported on first use.

A package's `__init__` maps its public names to the modules defining them;
importing the package (or a light submodule of it, such as
`keras_vmoe.distribution.launch`) then loads neither Keras nor JAX until
a name that needs them is touched.
"""

import importlib
import sys


def lazy_exports(package, exports):
    """`(__getattr__, __dir__)` for a package whose names live in submodules.

    Args:
        package: the package's `__name__`.
        exports: dict, public name -> name of the module that defines it.

    Returns:
        The two module-level functions to assign in the package.
    """

    def __getattr__(name):
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__():
        return sorted(set(vars(sys.modules[package])) | set(exports))

    return __getattr__, __dir__
