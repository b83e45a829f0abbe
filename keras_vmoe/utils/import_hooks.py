"""Running code around the import of a module that is not imported yet.

`around_import(name, key, wrap)` makes every later import of `name` run
`wrap(execute, module)` around its loader. Nothing is imported here.
"""

import sys

# Duck-typed finder and loader: `importlib.abc` would slow `import keras_vmoe`.


class _Wrapped:
    """A module's own loader, its `exec_module` run through `wrap`."""

    def __init__(self, loader, wrap):
        self.loader = loader
        self.wrap = wrap

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.wrap(self.loader.exec_module, module)

    def __getattr__(self, name):  # get_source, get_filename, ... for tracebacks
        if name == "loader":
            raise AttributeError(name)
        return getattr(self.loader, name)


class _Hook:
    """Finds the module `name` with the other finders and wraps its loader."""

    def __init__(self, name, key, wrap):
        self.name = name
        self.key = key
        self.wrap = wrap

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _Wrapped(spec.loader, self.wrap)
                return spec
        return None


def around_import(name, key, wrap):
    """Runs `wrap(execute, module)` (which must call `execute(module)`) around
    each later import of `name`; a second hook with the same `key` is ignored."""
    if any(isinstance(f, _Hook) and f.key == key for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _Hook(name, key, wrap))
