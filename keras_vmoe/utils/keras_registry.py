"""Keras finds keras_vmoe's classes by name, whichever modules were imported.

`register_lazily` replaces Keras' registry by one that imports the package's
serializable classes on the first name of the package it does not hold, and
refuses an unknown name with the nearest ones.
"""

import sys

from keras_vmoe.utils import import_hooks

REGISTRATION_MODULE = "keras.src.saving.object_registration"


class UnknownClassError(ValueError):
    """A registered name of the package that the package does not define.

    Not a `TypeError`: Keras would wrap it into one printing the whole config.
    """


class _Registry(dict):
    """Keras' registry, importing a package's classes when first asked."""

    def __init__(self, items, package, register_all):
        super().__init__(items)
        self.package = package
        self.register_all = register_all
        self.loaded = False
        self.loading = False

    def __contains__(self, name):
        if super().__contains__(name):
            return True
        prefix = f"{self.package}>"
        if not (isinstance(name, str) and name.startswith(prefix)) or self.loading:
            return False  # not the package's, or asked while its modules import
        if not self.loaded:
            self.loading = True
            try:
                self.register_all()
            finally:
                self.loading = False
            self.loaded = True
            if super().__contains__(name):
                return True
        import difflib  # here: only an unknown name needs it

        known = sorted(key for key in self if isinstance(key, str) and key.startswith(prefix))
        classes = {key[len(prefix):]: key for key in known}
        near = [classes[c] for c in difflib.get_close_matches(
            name[len(prefix):], list(classes), n=3, cutoff=0.6)]
        listed = (f"did you mean {' or '.join(repr(n) for n in near)}?" if near else
                  f"the classes it defines: {', '.join(known)}.")
        version = getattr(sys.modules.get(self.package), "__version__", "")
        raise UnknownClassError(
            f"A saved config names the class {name!r}, which {self.package} "
            f"{version} does not define: {listed} The file was "
            "edited, or saved by another version of the package; restore its "
            "`registered_name` (in the `.keras` file's config.json) or load it "
            "with the version that saved it."
        )


def install(registration, package, register_all):
    """Replaces `registration.GLOBAL_CUSTOM_OBJECTS` by a lazy `_Registry`."""
    current = registration.GLOBAL_CUSTOM_OBJECTS
    if isinstance(current, _Registry) and current.package == package:
        return
    registration.GLOBAL_CUSTOM_OBJECTS = _Registry(current, package, register_all)


def register_lazily(package, register_all):
    """Makes Keras' registry call `register_all` when it meets a `package>` name
    (installed when Keras is imported, if it is not yet)."""
    registration = sys.modules.get(REGISTRATION_MODULE)
    if registration is not None:
        install(registration, package, register_all)
        return

    def execute_then_install(execute, module):
        execute(module)
        install(module, package, register_all)

    import_hooks.around_import(REGISTRATION_MODULE, f"keras_registry:{package}",
                               execute_then_install)
