"""Keeps a model usable after `fit`/`evaluate`/`predict` raise (JAX backend).

Keras' JAX `predict`/`evaluate` leave the variables detached when a batch
raises, and every later call fails; `restore_on_error` reattaches them before
re-raising (`tests/utils/test_keras_internals.py` fails when Keras fixes this).
It also makes `verbose="auto"` plain when stdout is not a terminal.
"""

import functools
import inspect
import os
import sys

import keras

from keras_vmoe.utils import keras_internals
from keras_vmoe.utils.validation import check_int


def _all_variables(model):
    variables = [*model.variables, *getattr(model, "metrics_variables", [])]
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None:
        variables += list(optimizer.variables)
    return list({id(v): v for v in variables}.values())


def restore_on_error(method):
    """Wraps `fit`/`evaluate`/`predict`: on an error, reattaches the model's
    variables (JAX) before re-raising."""
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        args, kwargs = plain_progress(method.__name__, args, kwargs)
        if keras.backend.backend() != "jax":
            return method(self, *args, **kwargs)
        saved = [(v, keras_internals.variable_value(v)) for v in _all_variables(self)]
        try:
            return method(self, *args, **kwargs)
        except BaseException:
            # The last successful batch's values, then those from before.
            if keras_internals.has_pending_jax_state(self):
                try:
                    keras_internals.sync_jax_state(self)
                except Exception:  # pragma: no cover - best effort
                    pass
            for variable, value in saved:
                if keras_internals.variable_value(variable) is None and value is not None:
                    keras_internals.reattach_value(variable, value)
            keras_internals.clear_jax_state(self)
            raise

    return wrapper


def _terminal():
    """Whether stdout shows Keras' progress bar as a bar (Keras' own test)."""
    isatty = getattr(sys.stdout, "isatty", None)
    try:
        tty = bool(isatty and isatty())
    except ValueError:  # a closed stream
        tty = False
    return tty or "ipykernel" in sys.modules or "PYCHARM_HOSTED" in os.environ


def plain_progress(method_name, args, kwargs):
    """`(args, kwargs)` of `fit`/`evaluate`/`predict` with `verbose="auto"`
    made `2` (one plain line per epoch) when stdout is not a terminal."""
    if _terminal():
        return args, kwargs
    names = list(inspect.signature(getattr(keras.Model, method_name)).parameters)[1:]
    position = names.index("verbose")
    if len(args) > position:
        if isinstance(args[position], str) and args[position] == "auto":
            args = (*args[:position], 2, *args[position + 1:])
        return args, kwargs
    if kwargs.get("verbose", "auto") == "auto":
        kwargs = {**kwargs, "verbose": 2}
    return args, kwargs


def check_data_arguments(method_name, args, kwargs):
    """Refuses, with a clear message, what Keras' loops mishandle: an
    in-memory `x` with 0 examples and a `batch_size` that is not an int >= 1."""
    x = args[0] if args else kwargs.get("x")
    if isinstance(x, (list, tuple)) and not x:
        raise ValueError(
            f"`{method_name}` received no images: x is an empty "
            f"{type(x).__name__}. Pass at least one image.")
    first = next(iter(x.values()), None) if isinstance(x, dict) else x
    shape = getattr(first, "shape", None)
    if shape is not None and len(shape) > 0 and shape[0] == 0:
        raise ValueError(
            f"`{method_name}` received an empty batch: x has batch size 0 "
            f"(shape {tuple(shape)}). Pass at least one image."
        )
    position = 2 if method_name in ("fit", "evaluate") else 1
    batch_size = args[position] if len(args) > position else kwargs.get("batch_size")
    if batch_size is not None:
        check_int(batch_size, "batch_size")


def predict_whole_batches(predict, args, kwargs):
    """`predict(*args, **kwargs)`; under a distribution, an in-memory `x` is
    padded with zero images to whole batches (a partial batch cannot be split
    over the devices) and the padding's outputs are dropped."""
    import numpy as np

    x = args[0] if args else kwargs.get("x")
    if (keras.distribution.distribution() is None or not isinstance(x, np.ndarray)
            or x.ndim == 0):
        return predict(*args, **kwargs)
    batch_size = kwargs.get("batch_size") or (args[1] if len(args) > 1 else None) or 32
    count = len(x)
    missing = -count % batch_size
    if not missing:
        return predict(*args, **kwargs)
    padded = np.concatenate([x, np.zeros((missing, *x.shape[1:]), x.dtype)])
    if args:
        args = (padded, *args[1:])
    else:
        kwargs = {**kwargs, "x": padded}
    outputs = predict(*args, **kwargs)
    return keras.tree.map_structure(lambda array: array[:count], outputs)
