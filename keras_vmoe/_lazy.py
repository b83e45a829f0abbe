"""Lazy package faces (PEP 562): names imported on first use.

A package's `__init__` maps its public names to the modules defining them;
importing the package (or a light submodule of it, such as
`keras_vmoe.distribution.launch`) then loads neither Keras nor JAX until
a name that needs them is touched.
"""

import importlib
import sys

from keras_vmoe.utils.deprecation import warn_renamed


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


def lazy_attribute(module, name):
    """`module.name`, importing `module` now.

    For a class of a lower layer whose method is implemented above it (a
    task's `from_preset` reads presets): the module is named, not imported,
    so importing the lower layer loads nothing above it.
    """
    return getattr(importlib.import_module(module), name)


def deprecated_exports(package, moved, fallback=None, instead=None):
    """A package `__getattr__` for names that left the package's face.

    Each name keeps working until `REMOVAL_VERSION`, with a
    `DeprecationWarning` that says where it lives now
    (`keras_vmoe.utils.deprecation`).

    Args:
        package: the package's `__name__`.
        moved: dict, old name -> `"module"` (same name there) or
            `"module:name"` (renamed).
        fallback: the package's previous `__getattr__`, or `None`.
        instead: optional dict, old name -> what to use instead, when that
            is not the same object under a new path (e.g. a call of another
            function).

    Returns:
        The `__getattr__` to assign in the package.
    """

    def __getattr__(name):
        target = moved.get(name)
        if target is None:
            if fallback is not None:
                return fallback(name)
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module, _, new_name = target.partition(":")
        new_name = new_name or name
        warn_renamed(f"{package}.{name}",
                     (instead or {}).get(name) or f"{module}.{new_name}")
        return getattr(importlib.import_module(module), new_name)

    return __getattr__
