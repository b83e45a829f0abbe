"""keras_vmoe's serializable classes are found whatever was imported.

Keras finds a saved class by its registered name (`keras_vmoe>ImageClassifier`)
in its registry, which a class joins when its module is imported; Keras
imports a module itself only for its own packages. So that a `.keras` file
loads after just `import keras_vmoe` (not only after `keras_vmoe.models`),
`install()` makes Keras' registry import keras_vmoe's classes the first time
a `keras_vmoe>` name is looked up (the package face says how to import
them). Keras has no hook for this: the registry
is `keras.src.saving.object_registration.GLOBAL_CUSTOM_OBJECTS`, a dict that
every lookup reads through the module; it is replaced by a dict that loads
first. `install()` imports nothing: before Keras is imported it waits for
the registry's module to load.
"""

import importlib.abc
import importlib.util
import sys

_PREFIX = "keras_vmoe>"
_REGISTRY_MODULE = "keras.src.saving.object_registration"


class _LoadingRegistry(dict):
    """Keras' registry, importing keras_vmoe's classes on a first miss."""

    _loading = False
    register_all = None  # set by `install`

    def _load(self, key):
        if (isinstance(key, str) and key.startswith(_PREFIX)
                and not dict.__contains__(self, key) and not _LoadingRegistry._loading):
            _LoadingRegistry._loading = True
            try:
                _LoadingRegistry.register_all()
            finally:
                _LoadingRegistry._loading = False

    def __contains__(self, key):
        self._load(key)
        return dict.__contains__(self, key)

    def __getitem__(self, key):
        self._load(key)
        return dict.__getitem__(self, key)

    def get(self, key, default=None):
        self._load(key)
        return dict.get(self, key, default)


def _replace_registry(module):
    if not isinstance(module.GLOBAL_CUSTOM_OBJECTS, _LoadingRegistry):
        module.GLOBAL_CUSTOM_OBJECTS = _LoadingRegistry(module.GLOBAL_CUSTOM_OBJECTS)


class _AfterRegistryImport(importlib.abc.MetaPathFinder):
    """Replaces the registry as soon as Keras imports its module."""

    def find_spec(self, name, path, target=None):
        if name != _REGISTRY_MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        load = spec.loader.exec_module

        def exec_module(module):
            load(module)
            _replace_registry(module)

        spec.loader.exec_module = exec_module
        return spec


def install(register_all):
    """Makes `keras_vmoe>` names resolve in Keras' registry (see the module).

    Args:
        register_all: a function that imports every module defining a
            serializable keras_vmoe class.
    """
    _LoadingRegistry.register_all = staticmethod(register_all)
    module = sys.modules.get(_REGISTRY_MODULE)
    if module is not None:
        _replace_registry(module)
    elif not any(isinstance(f, _AfterRegistryImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterRegistryImport())
