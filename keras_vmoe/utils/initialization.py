"""Building models whose every weight then comes from a file.

A Keras layer draws each weight from its initializer when it builds. On
JAX every initializer and weight shape is one compiled XLA program (a
ViT-S/32 V-MoE compiles about 40), and loading a preset then overwrites
every value it drew. Under `skip_initializers()` the weights of the models
built are created as zeros on the host instead (no random draw, no XLA
program); the loader then assigns every one of them, and
`SkippedInitializers.check_assigned` refuses a model with a weight that
was never assigned, so no weight silently stays zero.

Only variables whose initializer is a `keras.initializers.Initializer`
are skipped: the state of a `keras.random.SeedGenerator` (a dropout's,
say) is created as usual, with its seed.

Builds whose weights are meant to be random (`load_weights=False`, a new
head, an upcycled router) must not run under this scope.
"""

import contextlib
import math
import mmap
import threading

import keras
import numpy as np

from keras_vmoe.utils import keras_internals

_local = threading.local()
_patch_lock = threading.Lock()
_patch_users = 0


class UnassignedWeightsError(ValueError):
    """A model built without initializers has weights that were never loaded."""


class SkippedInitializers:
    """The variables created under one `skip_initializers()` scope.

    Records which of them were assigned (`variable.assign`) while the scope
    was active.
    """

    def __init__(self):
        self._skipped = {}
        self._assigned = set()

    @property
    def num_skipped(self):
        """How many variables were created without running their initializer."""
        return len(self._skipped)

    def unassigned(self, model):
        """The variables of `model` created as placeholders and never assigned."""
        return [
            v for v in model.variables
            if id(v) in self._skipped and id(v) not in self._assigned
        ]

    def check_assigned(self, model, source=None):
        """Raises `UnassignedWeightsError` unless every placeholder of `model` was assigned.

        Args:
            model: the model (or layer) built under the scope.
            source: optional name of what the weights came from, for the
                error message.
        """
        missing = self.unassigned(model)
        if missing:
            paths = [v.path for v in missing]
            shown = ", ".join(paths[:10]) + (", ..." if len(paths) > 10 else "")
            origin = f" from {source}" if source else ""
            raise UnassignedWeightsError(
                f"{len(paths)} weight(s) of the model were not loaded{origin}: "
                f"{shown}. The weights do not cover the model."
            )


def _active():
    """The innermost `skip_initializers` record of this thread, or None."""
    stack = getattr(_local, "stack", None)
    return stack[-1] if stack else None


def _numpy_dtype(dtype):
    dtype = keras.backend.standardize_dtype(dtype)
    try:
        return np.dtype(dtype)
    except TypeError:  # bfloat16 and float8 types live in ml_dtypes.
        import ml_dtypes

        return np.dtype(getattr(ml_dtypes, dtype))


def _placeholder(variable):
    """Zeros of the variable's shape and dtype, on the host.

    The zeros are a fresh anonymous memory map: page-aligned (so JAX can
    alias rather than copy them, see `keras_internals.initialize_variable`)
    and never written, so they take no memory until something writes them.
    `np.zeros` takes small arrays from the heap, where they are neither.
    """
    shape = tuple(variable.shape)
    dtype = _numpy_dtype(variable.dtype)
    count = math.prod(shape)
    if count == 0:
        return np.zeros(shape, dtype)
    buffer = mmap.mmap(-1, count * dtype.itemsize)
    return np.frombuffer(buffer, dtype, count=count).reshape(shape)


def _install():
    original_init = keras.Variable._initialize_with_initializer
    original_assign = keras.Variable.assign
    original_convert = keras.Variable._convert_to_tensor

    def convert_to_tensor(variable, value, dtype=None):
        # A Python number becomes a host array of the variable's dtype first:
        # JAX would otherwise compile a conversion program for it (the
        # optimizer's `iterations` and learning rate, say).
        if _active() is not None and dtype is not None and isinstance(
                value, (bool, int, float)):
            value = np.asarray(value, _numpy_dtype(dtype))
        return original_convert(variable, value, dtype=dtype)

    def initialize_with_initializer(variable, initializer):
        record = _active()
        if record is None or not isinstance(initializer, keras.initializers.Initializer):
            return original_init(variable, initializer)
        keras_internals.initialize_variable(variable, _placeholder(variable))
        record._skipped[id(variable)] = variable
        return None

    def assign(variable, value):
        result = original_assign(variable, value)
        # Any enclosing scope may have created the variable.
        for record in getattr(_local, "stack", ()):
            if id(variable) in record._skipped:
                record._assigned.add(id(variable))
        return result

    return keras_internals.patch_variable_methods(
        _initialize_with_initializer=initialize_with_initializer, assign=assign,
        _convert_to_tensor=convert_to_tensor)


@contextlib.contextmanager
def skip_initializers():
    """Variables created in this block skip their initializers (zeros instead).

    Use it around a build whose every weight is then loaded, and the loading
    itself (assignments are recorded only inside the block); then call
    `check_assigned(model)` on the yielded record.

    Yields:
        A `SkippedInitializers` record.

    Examples:

    ```python
    import keras
    from keras_vmoe.utils.initialization import skip_initializers

    def build():
        return keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])

    build().save_weights("dense.weights.h5")
    with skip_initializers() as skipped:
        model = build()  # zeros on the host: nothing drawn, nothing compiled
        model.load_weights("dense.weights.h5")
    skipped.check_assigned(model)  # every weight came from the file
    ```
    """
    global _patch_users
    record = SkippedInitializers()
    if not hasattr(_local, "stack"):
        _local.stack = []
    outer = _active()
    with _patch_lock:
        if _patch_users == 0:
            _local_restore.append(_install())
        _patch_users += 1
    _local.stack.append(record)
    try:
        yield record
    finally:
        _local.stack.pop()
        if outer is not None:
            # A nested scope's variables belong to the enclosing one too.
            outer._skipped.update(record._skipped)
            outer._assigned.update(record._assigned)
        with _patch_lock:
            _patch_users -= 1
            if _patch_users == 0:
                _local_restore.pop()()


_local_restore = []
