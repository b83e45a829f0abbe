"""Lazy package faces (PEP 562): names imported on first use."""

import importlib
import sys


def lazy_exports(package, exports):
    """`(__getattr__, __dir__)` for `package`, whose `exports` map each public
    name to the module defining it."""

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
