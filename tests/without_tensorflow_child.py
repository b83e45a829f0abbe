"""Runs `keras-vmoe` commands in a process where TensorFlow cannot be imported.

    python without_tensorflow_child.py ARGS...   # as `keras-vmoe ARGS...`

A meta-path finder makes every `import tensorflow` (and TensorFlow
Datasets, scikit-learn, scikit-image: none of them is a core dependency)
fail, as on a machine where `pip install keras-vmoe` brought no
TensorFlow. Exits with the command's status; a blocked import attempt that
the code swallowed is still reported on stderr ("blocked import: ...").
"""

import importlib.abc
import os
import sys

BLOCKED = ("tensorflow", "tensorflow_datasets", "sklearn", "skimage")


class _Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            print(f"blocked import: {name}", file=sys.stderr, flush=True)
            raise ModuleNotFoundError(f"No module named {name!r} (blocked by the test)",
                                      name=name)
        return None


sys.meta_path.insert(0, _Block())
os.environ.setdefault("KERAS_BACKEND", "jax")

if __name__ == "__main__":
    from keras_vmoe import cli

    status = cli.main(sys.argv[1:])
    loaded = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
    if loaded:
        print(f"error: loaded {loaded}", file=sys.stderr)
        status = status or 3
    sys.exit(status)
